"""The command line, in-process: generate (text and JSON), pull errors, and bench on a tiny model."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from specserve.cli import main
from specserve.model.tokenizer import load_tokenizer

from tiny_models import save_tiny_llama3


@pytest.fixture(scope="module")
def tiny_folder(smollm2_gguf, tmp_path_factory):
    return save_tiny_llama3(tmp_path_factory.mktemp("tiny") / "model", load_tokenizer(smollm2_gguf))


def test_generate_json(tiny_folder, capsys):
    code = main(
        [
            "generate",
            "--model",
            str(tiny_folder),
            "--prompt",
            "Hello",
            "--max-new-tokens",
            "5",
            "--device",
            "cpu",
            "--json",
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["token_ids"]) == 5 and result["finish_reason"] == "length"
    assert result["meta_info"]["completion_tokens"] == 5


def test_generate_with_a_draft_head(tiny_folder, tmp_path, capsys):
    from specserve.model.arch import arch_from_hf_config
    from specserve.model.head_checkpoint import random_head, save_head

    arch = arch_from_hf_config(json.loads((tiny_folder / "config.json").read_text()))
    head = save_head(tmp_path / "head", *random_head("mtp", arch, num_modules=2))
    args = ["generate", "--model", str(tiny_folder), "--prompt", "Hello", "--max-new-tokens", "6"]
    args += ["--device", "cpu", "--json", "--speculative", "mtp", "--num-steps", "3"]
    assert main([*args, "--draft-model", str(head)]) == 0
    meta = json.loads(capsys.readouterr().out)["meta_info"]
    assert meta["completion_tokens"] == 6 and meta["spec_verify_ct"] >= 2
    tree = ["--topk", "2", "--num-draft-tokens", "4", "--draft-model", str(head)]
    assert main([*args, *tree]) == 0  # a draft tree
    assert json.loads(capsys.readouterr().out)["meta_info"]["completion_tokens"] == 6
    assert main([*args, "--topk", "1", "--num-draft-tokens", "4", "--draft-model", str(head)]) == 2
    assert "speculative.num_draft_tokens" in capsys.readouterr().err
    assert main(args) == 2  # a head method without its folder
    assert "speculative.draft_model" in capsys.readouterr().err


def test_generate_reports_bad_arguments(tiny_folder, capsys):
    code = main(
        [
            "generate",
            "--model",
            str(tiny_folder),
            "--prompt",
            "Hello",
            "--temperature",
            "-1",
            "--device",
            "cpu",
        ]
    )
    assert code == 2
    assert "temperature" in capsys.readouterr().err


def test_shape_flags_reach_the_default_drafter_and_need_a_method(tiny_folder, tmp_path, capsys):
    import argparse

    from specserve.cli_spec_args import add_speculative_arguments, speculative_from_args
    from specserve.serve.launch import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_speculative_arguments(parser)
    parser.add_argument("--model", default=str(tiny_folder))
    given = speculative_from_args(
        parser.parse_args(["--speculative", "default", "--num-steps", "7", "--topk", "2"])
    )
    assert (given["num_steps"], given["topk"]) == (7, 2)  # were the head's own 3, and a chain
    assert speculative_from_args(parser.parse_args(["--speculative", "ngram"]))["num_steps"] == 4
    with pytest.raises(ValueError, match="--num-steps: needs --speculative"):  # was plain decoding
        speculative_from_args(parser.parse_args(["--num-steps", "7"]))
    serve = argparse.ArgumentParser()
    add_arguments(serve)
    config = config_from_args(serve.parse_args(["--speculative", "default", "--num-steps", "7"]))
    assert config["speculative"] == {"method": "default", "num_steps": 7}
    # usage errors: exit 2 naming the flag
    assert main(["generate", "--model", str(tiny_folder), "--prompt", "Hi", "--num-steps", "7"]) == 2
    assert "--num-steps" in capsys.readouterr().err
    out = str(tmp_path / "b.json")
    for bad in (
        ["--batch-sizes", "0"],
        ["--batch-sizes", "abc"],
        ["--repeats", "0"],
        ["--max-new-tokens", "0"],
        ["--temperature", "-1"],
        ["--temperature", "nan"],
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "--model", str(tiny_folder), "--out", out, *bad])
        assert exit_.value.code == 2 and bad[0] in capsys.readouterr().err
    assert main(["bench", "--model", str(tmp_path / "nothing"), "--out", out]) == 2
    assert "model: cannot resolve" in capsys.readouterr().err


def test_bench_samples_at_a_temperature(tiny_folder, tmp_path):
    """`--temperature`: every system's requests (and HF's) sample at it; the report records it."""
    out = tmp_path / "sampled.json"
    argv = ["bench", "--model", str(tiny_folder), "--batch-sizes", "2", "--max-new-tokens", "4", "--device"]
    argv += ["cpu", "--temperature", "0.8", "--spec", "ngram:2", "--hf", "--repeats", "1", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["temperature"] == 0.8
    assert {r["system"] for r in report["rows"]} >= {"specserve", "specserve-ngram-2", "hf-generate"}


def test_bench_runs_untimed_warm_up_rounds_before_the_timed_ones(tiny_folder, tmp_path, monkeypatch):
    """`--warmup-rounds`: every engine runs each batch size's batches that many times untimed before
    the timed rounds (the first run of a shape was slow in whichever engine ran it first), and the
    report records it; the timed rows still hold one time per repeat."""
    from specserve import bench

    runs: list[tuple[str, int]] = []
    time_engine = bench._time_engine

    def counted(llm, batches, new_tokens, temperature=0.0):
        runs.append((llm.engine.config.speculative is not None, len(batches[0])))
        return time_engine(llm, batches, new_tokens, temperature)

    monkeypatch.setattr(bench, "_time_engine", counted)
    out = tmp_path / "warm.json"
    argv = ["bench", "--model", str(tiny_folder), "--batch-sizes", "1,2", "--max-new-tokens", "3"]
    argv += ["--device", "cpu", "--spec", "ngram:2", "--repeats", "2", "--warmup-rounds", "2"]
    argv += ["--min-prompts", "1", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["warmup_rounds"] == 2
    assert all(len(r["repeat_seconds"]) == 2 for r in report["rows"])
    # per engine: the start-up warm-up (2 prompts), then 2 + 2 runs at each batch size
    for speculative in (False, True):
        sizes = [b for s, b in runs if s == speculative]
        assert sizes == [2] + [1] * 4 + [2] * 4
    with pytest.raises(SystemExit):
        main([*argv[:-2], "--warmup-rounds", "-1", "--out", str(out)])


def test_pull_unknown_asset_fails_cleanly(capsys):
    assert main(["pull", "no-such-asset"]) == 2  # a usage error
    assert "no-such-asset" in capsys.readouterr().err


def test_bench_writes_json_table_and_plot(tiny_folder, tmp_path, capsys):
    """The offline bench end to end on CPU: plain and n-gram engines over one load of the model, HF
    generate beside them, two batch sizes; JSON rows for each, the table, and the PNG."""
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(tiny_folder), "--batch-sizes", "1,3", "--max-new-tokens", "4"]
    argv += ["--device", "cpu", "--hf", "--spec", "ngram:3", "--spec", "ngram:3x2x4", "--out", str(out)]
    argv += ["--spec", "ngram:adaptive-3", "--min-prompts", "2", "--min-batches", "2", "--plain-sync"]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["attention_backend"] == "torch"  # auto on the CPU
    assert report["command"].startswith("specserve bench --model") and report["device"] == "cpu"
    assert report["mode"] == "offline" and report["dtype"] == "float32" and report["gpu"] is None
    assert report["systems"]["specserve-ngram-3"]["speculative"] == {"method": "ngram", "num_steps": 3}
    assert report["systems"]["specserve-sync"] == {"speculative": None, "decode_steps": 0}
    rows = {(r["system"], r["batch_size"]): r for r in report["rows"]}
    assert set(rows) == {
        *(
            (s, b)
            for s in (
                "specserve",
                "specserve-ngram-3",
                "specserve-ngram-3x2x4",
                "specserve-ngram-3-adaptive",
                "specserve-sync",
                "hf-generate",
            )
            for b in (1, 3)
        ),
        ("hf-generate-prompt-lookup", 1),
    }
    assert all(r["tokens_per_s"] > 0 and r["new_tokens"] == 4 for r in rows.values())
    # batch 1 covers two prompts (--min-prompts 2), batch 3 runs twice (--min-batches 2): batches back
    # to back; HF runs the first only
    assert rows[("specserve", 1)]["batches"] == 2 and rows[("specserve-ngram-3", 3)]["batches"] == 2
    assert rows[("hf-generate", 1)]["batches"] == 1
    assert rows[("specserve-ngram-3", 3)]["accept_length"] >= 1
    # accepted drafts + 1 per verify step: never past the chain's 3 + 1, plain steps' tokens aside
    for b in (1, 3):
        for system in ("specserve-ngram-3", "specserve-ngram-3-adaptive"):
            assert rows[(system, b)]["accept_length"] is None or 1 <= rows[(system, b)]["accept_length"] <= 4
    assert report["systems"]["specserve-ngram-3x2x4"]["speculative"]["topk"] == 2
    assert rows[("specserve", 3)]["accept_length"] is None
    # where each engine step's host time went: the whole step, and drafting only with speculation
    spec_steps, plain_steps = rows[("specserve-ngram-3", 3)]["step_ms"], rows[("specserve", 3)]["step_ms"]
    assert spec_steps["step"] >= spec_steps["draft"] > 0 and spec_steps["target"] > 0
    assert plain_steps["step"] > 0 and "draft" not in plain_steps
    assert rows[("hf-generate", 3)]["step_ms"] is None
    # adaptive speculation: the steps each tier ran (a request's first token comes from its prefill)
    tiers = rows[("specserve-ngram-3-adaptive", 1)]["tier_steps"]
    # at most one step per new token: an overlapped step may launch before the last token lands
    assert set(tiers) <= {"off", "1", "2", "3"} and 2 <= sum(tiers.values()) <= 8
    assert rows[("specserve-ngram-3", 1)]["tier_steps"] is None
    # ... beside each repeat too (the row's is its median repeat's)
    row = rows[("specserve-ngram-3-adaptive", 1)]
    assert len(row["repeat_tier_steps"]) == len(row["repeat_seconds"]) and tiers in row["repeat_tier_steps"]
    assert rows[("specserve-ngram-3", 1)]["repeat_tier_steps"] is None
    # ... and why: the policy's cost table, pooled acceptance per position, goodput predicted/measured
    diag = rows[("specserve-ngram-3-adaptive", 3)]["adaptive"]
    assert set(diag["step_ms"]) == {"off", "1", "2", "3"} and all(ms > 0 for ms in diag["step_ms"].values())
    assert len(diag["pooled_acceptance"]["1"]) == 3 and diag["measured_goodput"] >= 0
    assert diag["batch"] == 3 and isinstance(diag["measured_step_ms"], dict)  # at the row's batch size
    assert all(0.25 <= ratio <= 2.0 for ratio in diag["calibration"].values())  # made / promised tokens
    assert rows[("specserve-ngram-3", 3)]["adaptive"] is None
    printed = capsys.readouterr().out
    assert "ms/step (draft/target)" in printed
    assert "adaptive specserve-ngram-3-adaptive b3: now" in printed
    assert "tok/s" in printed and "specserve-ngram-3" in printed
    if importlib.util.find_spec("matplotlib") is not None:
        assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_bench_repeats_in_rounds_over_the_systems(tiny_folder, tmp_path, monkeypatch):
    """With --repeats 2 every system runs once before any runs again (a slow spell of the machine
    falls on one repeat of several systems, not on both of one), and each row is its faster run."""
    import specserve.bench as bench

    order: list[tuple[int, float]] = []
    seconds = iter(range(100, 0, -1))  # each timed run faster than the one before

    def timed(llm, batches, new_tokens, temperature=0.0):
        order.append((id(llm), new_tokens))
        return float(next(seconds)), None, {}, None, None

    monkeypatch.setattr(bench, "_time_engine", timed)
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(tiny_folder), "--batch-sizes", "1", "--max-new-tokens", "4", "--device"]
    argv += ["cpu", "--spec", "ngram:3", "--repeats", "2", "--min-prompts", "1", "--out", str(out)]
    assert main([*argv, "--warmup-rounds", "0"]) == 0  # the warm-up rounds: their own test
    timed_runs = [engine for engine, tokens in order if tokens == 4]  # not the warm-up runs (WARMUP_TOKENS)
    assert len(timed_runs) == 4 and timed_runs[:2] == timed_runs[2:] and timed_runs[0] != timed_runs[1]
    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["specserve"]["seconds"] == 96.0 and rows["specserve-ngram-3"]["seconds"] == 95.0
    assert rows["specserve"]["repeat_seconds"] == [98.0, 96.0]  # every repeat, in the order run
    hosts = rows["specserve"]["repeat_host"]  # beside each repeat, what the host did meanwhile
    assert len(hosts) == 2 and hosts[0]["started_at"] <= hosts[1]["started_at"]
    assert all(h["cpu_seconds"] >= 0 and h["gc_seconds"] >= 0 and h["gc_full"] >= 0 for h in hosts)


def test_bench_rejects_a_configuration_given_twice(tiny_folder, tmp_path, capsys):
    argv = ["bench", "--model", str(tiny_folder), "--spec", "ngram:4", "--speculative", "ngram"]
    assert main([*argv, "--out", str(tmp_path / "b.json")]) == 2
    assert "specserve-ngram-4 is configured twice" in capsys.readouterr().err


def test_bench_generate_and_train_draft_need_no_http_stack():
    """The GPU machine has no fastapi, starlette, pydantic, ray or prometheus client: the CLI's parser,
    the offline bench and every draft-training module must import without them (only `specserve
    serve` needs them)."""
    blocked = ("fastapi", "starlette", "pydantic", "ray", "uvicorn", "prometheus_client")
    code = (
        "import builtins, sys\n"
        "real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        f"    if name.split('.')[0] in {blocked!r}:\n"
        "        raise ImportError('blocked ' + name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        "from specserve import cli, bench, llm, default_drafter\n"
        "from specserve.train import checkpoint, data, dataset, evaluate, trainer, unroll\n"
        "cli._parser().parse_args(['bench', 'offline', '--batch-sizes', '1'])\n"
        "cli._parser().parse_args(['train-draft', '--out', 'x', '--max-minutes', '1'])\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
