"""The offline bench's parts without a model: prompt sets, `--spec` parsing, the table, the plot, the
run info; `tests/test_cli.py` runs the whole offline bench on a tiny model."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from specserve.bench_data import cycle, mtbench_texts, select_texts, sharegpt_exchanges, sharegpt_texts
from specserve.bench_plot import plot_throughput
from specserve.bench_report import format_table, run_info
from specserve.cli import _with_bench_mode
from specserve.cli_spec_args import draft_slots, parse_spec, spec_name


def test_mtbench_first_turns_in_file_order(mtbench_questions):
    from specserve.assets import dataset_path

    texts = mtbench_texts(dataset_path("mt-bench"))
    assert texts == mtbench_questions and len(texts) == 80
    assert select_texts(texts, shuffle=False) == [t for t in texts if len(t) <= 4000]


def test_sharegpt_first_human_turns_filtered_and_shuffled_by_seed(tmp_path):
    conversations = [
        {"id": "a", "conversations": [{"from": "human", "value": " What is KV cache? "}, {"from": "gpt"}]},
        {
            "id": "b",
            "conversations": [{"from": "gpt", "value": "Hi"}, {"from": "human", "value": "Explain TP."}],
        },
        {"id": "c", "conversations": []},
        {"id": "d", "conversations": [{"from": "human", "value": "hi"}]},  # too short to measure anything
        {"id": "e", "conversations": [{"from": "human", "value": "x" * 5000}]},  # too long
    ] + [
        {"id": f"n{i}", "conversations": [{"from": "human", "value": f"Question number {i}"}]}
        for i in range(20)
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    texts = sharegpt_texts(path)
    assert texts[:2] == ["What is KV cache?", "Explain TP."] and len(texts) == 24
    picked = select_texts(texts, shuffle=True, seed=0)
    assert sorted(picked) == sorted(t for t in texts if 4 <= len(t) <= 4000)
    assert picked == select_texts(texts, shuffle=True, seed=0)  # deterministic
    assert picked != select_texts(texts, shuffle=True, seed=1)
    assert select_texts(texts, shuffle=False, max_chars=12) == ["Explain TP."]


def test_sharegpt_exchanges_pair_the_first_question_with_the_answer_after_it(tmp_path):
    """Draft training's `answers` phase: (first human turn, the gpt turn right after it); a
    conversation without that answer gives no pair."""
    conversations = [
        {"conversations": [{"from": "human", "value": " Q1 "}, {"from": "gpt", "value": " A1 "}]},
        {"conversations": [{"from": "human", "value": "Q2"}, {"from": "gpt"}]},  # no answer text
        {"conversations": [{"from": "gpt", "value": "Hi"}, {"from": "human", "value": "Q3"}]},  # none after
        {"conversations": [{"from": "human", "value": "Q4"}, {"from": "human", "value": "Q4b"}]},
        {
            "conversations": [
                {"from": "human", "value": "Q5"},
                {"from": "gpt", "value": "A5"},
                {"from": "human", "value": "Q6"},
            ]
        },
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    assert sharegpt_exchanges(path) == [("Q1", "A1"), ("Q5", "A5")]
    assert sharegpt_texts(path) == ["Q1", "Q2", "Q3", "Q4", "Q5"]


def test_sharegpt_reads_the_conversations_before_a_truncated_tail(tmp_path):
    """The pinned ShareGPT wheel's file stops mid-conversation: everything before the cut is read."""
    whole = json.dumps([{"conversations": [{"from": "human", "value": f"Question {i}?"}]} for i in range(5)])
    path = tmp_path / "cut.json"
    path.write_text(whole[: whole.index("Question 4") + 4])
    assert sharegpt_texts(path) == [f"Question {i}?" for i in range(4)]


def test_cycle_wraps_and_refuses_nothing():
    assert cycle(["a", "b"], 5) == ["a", "b", "a", "b", "a"]
    with pytest.raises(ValueError, match="no prompts"):
        cycle([], 3)


def test_spec_parsing():
    assert parse_spec("ngram") == {"method": "ngram", "num_steps": 4}
    assert parse_spec("ngram:2") == {"method": "ngram", "num_steps": 2}
    assert parse_spec("eagle3:5:heads/a:b") == {
        "method": "eagle3",
        "num_steps": 5,
        "draft_model": "heads/a:b",
    }
    assert spec_name(parse_spec("mtp:3:h")) == "specserve-mtp-3" and spec_name(None) == "specserve"
    tree = parse_spec("eagle3:6x8x64:heads/a")
    assert tree == {
        "method": "eagle3",
        "num_steps": 6,
        "topk": 8,
        "num_draft_tokens": 64,
        "draft_model": "heads/a",
    }
    assert spec_name(tree) == "specserve-eagle3-6x8x64"
    assert spec_name(parse_spec("ngram:4x2")) == "specserve-ngram-4x2x8"  # the default node count
    assert draft_slots(tree) == 64 and draft_slots(parse_spec("ngram:6x16x8")) == 80
    assert draft_slots(parse_spec("ngram:3")) == 3 and draft_slots(None) == 0
    cut = parse_spec("eagle3:3@8192:specserve/heads/smollm2-135m-instruct")
    assert cut["draft_vocab"] == 8192 and cut["num_steps"] == 3
    assert spec_name(cut) == "specserve-eagle3-3-vocab8192"
    assert parse_spec("ngram:adaptive-8") == {"method": "ngram", "num_steps": 8, "adaptive": True}
    variant = parse_spec("ngram:adaptive-8,hysteresis=0.1,patience=5")
    assert variant["adaptive"] == {"hysteresis": 0.1, "patience": 5} and variant["num_steps"] == 8
    assert spec_name(variant) == "specserve-ngram-8-adaptive-hysteresis0.1-patience5"
    assert spec_name(parse_spec("ngram:adaptive-8")) == "specserve-ngram-8-adaptive"
    assert parse_spec("eagle3:adaptive-4,hysteresis=0.2:heads/a:b")["draft_model"] == "heads/a:b"
    bad_specs = [
        ("ngram:4,hysteresis=0.1", "adaptive one"),
        ("ngram:adaptive-8,hysteresis", "NAME=VALUE"),
        ("ngram:adaptive-8,no_such_knob=1", "no_such_knob"),
        ("ngram:adaptive-8,patience=0", "patience"),
        ("magic:4", "method"),
        ("ngram:x", "NUM_STEPS"),
        ("eagle3:5", "draft_model"),
        ("ngram:4x0", "topk"),
        ("ngram:4x2x1000", "num_draft_tokens"),
        ("ngram:4x1x3", "num_draft_tokens"),
        ("ngram:4x2x8x1", "SHAPE"),
        ("eagle3:3@big:h", "@N"),
        ("ngram:3@100", "draft_vocab"),
    ]
    for bad, why in bad_specs:
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            parse_spec(bad)


def test_bench_without_a_mode_is_offline():
    assert _with_bench_mode(["bench", "--hf"]) == ["bench", "offline", "--hf"]
    assert _with_bench_mode(["bench"]) == ["bench", "offline"]
    for kept in (["bench", "online", "--url", "x"], ["bench", "--help"], ["generate", "--prompt", "x"]):
        assert _with_bench_mode(kept) == kept


def test_table_aligns_columns():
    table = format_table(["system", "tok/s"], [["specserve", "10.0"], ["hf", "9.5"]]).splitlines()
    assert table == ["system     tok/s", "specserve   10.0", "hf           9.5"]


def test_run_info_records_the_command_line():
    info = run_info(["bench", "--dataset", "mt-bench", "--spec", "eagle3:5:a b"])
    assert info["command"] == "specserve bench --dataset mt-bench --spec 'eagle3:5:a b'"
    assert {"commit", "started_at", "python", "torch"} <= info.keys()


def test_plot_is_skipped_with_a_note_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # the import fails as if not installed
    assert not plot_throughput([("specserve", 1, 10.0)], tmp_path / "p.png", "t")
    assert "matplotlib" in capsys.readouterr().err and not (tmp_path / "p.png").exists()


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    points = [("specserve", 1, 10.0), ("specserve", 16, 120.0), ("hf-generate-prompt-lookup", 1, 12.0)]
    assert plot_throughput(points, tmp_path / "sub" / "p.png", "title")
    assert (tmp_path / "sub" / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mixed_prompts_pick_code_edits_and_summaries_by_rule(tmp_path):
    from specserve.bench_data import is_code_edit, is_summary, mixed_texts, prompt_texts, write_prompts

    code = "Please fix this function:\n```python\ndef f(x):\n    return x +\n```\n" + "# context\n" * 30
    lines = "Refactor it.\n" + "\n".join(["def a():", "import os", "return 1"]) + "\n" + "x = 1\n" * 60
    summary = "Summarize the following article.\n\n" + "The quick brown fox jumps. " * 50
    chat = ["What is a KV cache?", "Write a poem about the sea.", "summary please", "```print(1)```"]
    assert is_code_edit(code) and is_code_edit(lines) and not is_code_edit("```print(1)``` fix it")
    assert is_summary(summary) and not is_summary("summary please") and not is_summary(code)
    sharegpt = [chat[1], code, summary, chat[2], lines, chat[3]]
    mixed = mixed_texts(["question one", "question two"], sharegpt, seed=0, per_kind=1)
    assert sorted(mixed) == sorted(
        ["question one", "question two", code, summary]
    )  # the first of each kind, in ShareGPT order
    assert mixed == mixed_texts(["question one", "question two"], sharegpt, seed=0, per_kind=1)
    assert {
        tuple(mixed_texts(["question one", "question two"], sharegpt, seed=s, per_kind=1)) for s in range(6)
    } != {tuple(mixed)}
    path = write_prompts(mixed, tmp_path / "mixed.jsonl.gz")  # what a machine without the wheels gets
    assert prompt_texts(str(path)) == mixed
    with pytest.raises(ValueError, match="dataset: 'nope' is neither"):
        prompt_texts("nope")


def test_the_kv_pool_holds_the_warm_up_whatever_max_new_tokens():
    """`--max-new-tokens 4` at batch 1 crashed in the warm-up, which generates 8 tokens a request."""
    from specserve.bench import WARMUP_TOKENS, _pool_tokens

    args = argparse.Namespace(max_new_tokens=1, page_size=1)
    prompts = [[1] * 50, [2] * 60]
    assert _pool_tokens(prompts, args, slots=0, batch=1) >= 60 + WARMUP_TOKENS + 1
