"""`sharegpt-turns` (specserve/train/turns.py): every human turn of a ShareGPT-like file as a chat
prompt with the conversation before it, the fit rule, dedupe, a seeded order, prompts files that carry
conversations, and the data phase resuming by prompt index over them. SmolLM2's real tokenizer and
chat template; the `train-draft` test runs the tiny random target."""

from __future__ import annotations

import json

import pytest

from specserve.bench_data import prompts_file_texts, select_texts, write_prompts
from specserve.cli import main
from specserve.model.tokenizer import chat_prompt_ids, chat_prompts_ids, load_tokenizer
from specserve.train.data import load_samples, prompt_texts
from specserve.train.turns import (
    candidate_windows,
    read_prompts_file,
    sharegpt_turn_exchanges,
    sharegpt_turns,
    turn_prompts,
)


@pytest.fixture(scope="module")
def tok(smollm2_gguf):
    return load_tokenizer(smollm2_gguf)


def _conv(*turns: tuple[str, str | None]) -> dict:
    return {
        "id": "x",
        "conversations": [{"from": f, "value": v} if v is not None else {"from": f} for f, v in turns],
    }


def _msgs(*pairs: tuple[str, str]) -> list[dict]:
    return [{"role": r, "content": c} for r, c in pairs]


THREE = _conv(
    ("human", " What is 1? "),
    ("gpt", " A1. "),
    ("human", "What is 2?"),
    ("gpt", "A2."),
    ("human", "What is 3?"),
)


def _windows(conversation: dict, max_chars: int = 2000) -> list[tuple[list[tuple[str, str]], str | None]]:
    return list(candidate_windows(conversation, max_chars))


def test_every_human_turn_is_a_prompt_with_the_conversation_before_it(tok):
    """Human turns are user messages, gpt turns assistant messages with ShareGPT's text (stripped);
    each prompt ends at its human turn, and its answer is the gpt turn after it."""
    prompts = turn_prompts([THREE], tok, max_chars=2000, max_prompt_tokens=1024)
    assert [p.messages for p in prompts] == [
        (("user", "What is 1?"),),
        (("user", "What is 1?"), ("assistant", "A1."), ("user", "What is 2?")),
        (
            ("user", "What is 1?"),
            ("assistant", "A1."),
            ("user", "What is 2?"),
            ("assistant", "A2."),
            ("user", "What is 3?"),
        ),
    ]
    assert [p.answer for p in prompts] == ["A1.", "A2.", None]
    conversations = [p.as_messages() for p in prompts]
    ids = chat_prompts_ids(tok, conversations)  # in one batch: what the data phase uses
    assert ids == [chat_prompt_ids(tok, m) for m in conversations]
    text = tok.decode(ids[1])
    assert text.endswith(
        "<|im_start|>user\nWhat is 1?<|im_end|>\n<|im_start|>assistant\nA1.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_what_ends_a_context():
    """A system turn, an empty turn, two turns of one role in a row or a turn over max_chars ends the
    context; a context starts at a user turn; a too-short user turn is context but no prompt; the
    other assistant names count as gpt."""

    def user_prompts(conv: dict, max_chars: int) -> list[tuple[str, str, int]]:
        """(the window's first text, its last, its length) of each prompt."""
        return [(w[0][1], w[-1][1], len(w)) for w, _ in _windows(conv, max_chars)]

    conv = _conv(
        ("gpt", "orphan answer"),  # before any user turn: dropped
        ("human", "Q1 first"),
        ("chatgpt", "A1"),
        ("human", "ok"),  # too short to be a prompt, still context
        ("bard", "A2"),
        ("human", "Q3 after ok"),
        ("system", "be terse"),  # ends the context
        ("human", "Q4 fresh"),
        ("gpt", None),  # no text: ends the context
        ("human", "Q5 fresh"),
        ("human", "Q6 two in a row"),
        ("gpt", "x" * 50),  # over max_chars below: ends the context
        ("human", "Q7 fresh"),
    )
    assert user_prompts(conv, max_chars=40) == [
        ("Q1 first", "Q1 first", 1),
        ("Q1 first", "Q3 after ok", 5),
        ("Q4 fresh", "Q4 fresh", 1),
        ("Q5 fresh", "Q5 fresh", 1),
        ("Q6 two in a row", "Q6 two in a row", 1),
        ("Q7 fresh", "Q7 fresh", 1),
    ]
    long_question = _conv(("human", "Q" * 50), ("gpt", "A"), ("human", "next question"))
    assert [w for w, _ in _windows(long_question, max_chars=40)] == [[("user", "next question")]]


def test_the_context_is_the_most_recent_turns_that_fit(tok):
    """The oldest (user, assistant) pairs go first until the prompt fits max_prompt_tokens exactly
    (chat template included); a turn that does not fit alone gives no prompt."""

    def words(w: str, n: int) -> str:
        return " ".join([w] * n)

    conv = _conv(
        ("human", words("alpha", 60)),
        ("gpt", words("beta", 60)),
        ("human", words("gamma", 20)),
        ("gpt", words("delta", 20)),
        ("human", "And now?"),
        ("gpt", "Fine."),
        ("human", words("epsilon", 400)),
    )
    whole = [w for w, _ in _windows(conv)]
    full = len(chat_prompt_ids(tok, _msgs(*whole[2])))
    for limit in (full, full - 1, 100, 60, 40):
        prompts = turn_prompts([conv], tok, max_chars=4000, max_prompt_tokens=limit)
        for p in prompts:
            window = next(w for w in whole if w[-1] == p.messages[-1])
            assert p.messages == tuple(window[len(window) - len(p.messages) :])  # a suffix
            assert p.messages[0][0] == "user" and len(chat_prompt_ids(tok, p.as_messages())) <= limit
            if len(p.messages) < len(window):  # one pair more would not have fit
                longer = window[len(window) - len(p.messages) - 2 :]
                assert len(chat_prompt_ids(tok, _msgs(*longer))) > limit
        assert all(p.messages[-1][1] != words("epsilon", 400) for p in prompts)  # never fits alone
        if limit == full:
            assert prompts[2].messages == tuple(whole[2])
        if limit == full - 1:
            assert len(prompts[2].messages) == 3
    assert turn_prompts([conv], tok, max_chars=4000, max_prompt_tokens=30) == []


def _sharegpt_file(tmp_path):
    conversations = [THREE, THREE]  # a duplicate conversation: its prompts are kept once
    conversations.append(_conv(("human", "What is 1?"), ("gpt", "Another A1."), ("human", "Different Q2?")))
    conversations += [
        _conv(("human", f"Question {i}?"), ("gpt", f"Answer {i}."), ("human", f"Follow-up {i}?"))
        for i in range(12)
    ]
    path = tmp_path / "sharegpt.json"
    text = json.dumps(conversations)
    path.write_text(text[: text.rindex("Follow-up 11") + 5])  # cut mid-document, as the pinned file
    return path


def test_prompts_are_deduplicated_and_in_a_seeded_order(tok, tmp_path):
    path = _sharegpt_file(tmp_path)
    kw = dict(max_chars=2000, max_prompt_tokens=1024)
    turns = sharegpt_turns(path, tok, seed=0, **kw)
    keys = [t.messages for t in turns]
    assert len(keys) == len(set(keys)) == 3 + 1 + 11 * 2  # THREE once; the cut 12th conversation: none
    assert (("user", "What is 1?"),) in keys
    assert (("user", "What is 1?"), ("assistant", "Another A1."), ("user", "Different Q2?")) in keys
    assert keys == [t.messages for t in sharegpt_turns(path, tok, seed=0, **kw)]  # deterministic
    assert keys != [t.messages for t in sharegpt_turns(path, tok, seed=1, **kw)]
    assert sorted(keys) == sorted(t.messages for t in sharegpt_turns(path, tok, seed=1, **kw))
    pairs = sharegpt_turn_exchanges(path, tok, seed=0, **kw)
    # "What is 1?" answered "A1." and "Another A1.": both pairs kept; the duplicate conversation's are not.
    assert sorted(a for m, a in pairs if m == _msgs(("user", "What is 1?"))) == ["A1.", "Another A1."]
    assert len(pairs) == len({(json.dumps(m), a) for m, a in pairs}) == 2 + 1 + 11


def test_a_prompts_file_carries_conversations_in_order(tok, tmp_path, monkeypatch):
    """`--phase prompts` writes conversations as {"messages": [...]} lines; reading the file gives the
    same prompts at the same indices, and files of texts read as before (same filter, same indices)."""
    import specserve.assets

    monkeypatch.setattr(specserve.assets, "dataset_path", lambda name, **_: _sharegpt_file(tmp_path))
    prompts = prompt_texts("sharegpt-turns", seed=3, tokenizer=tok, max_prompt_tokens=1024)
    assert all(isinstance(p, list) and p[-1]["role"] == "user" for p in prompts)
    path = write_prompts([*prompts, "a plain question", "hi", "x" * 3000], tmp_path / "p.jsonl.gz")
    assert read_prompts_file(path, max_chars=2000) == [*prompts, "a plain question"]
    texts = write_prompts(["one question", "no", "y" * 3000, "two question"], tmp_path / "t.jsonl.gz")
    assert prompt_texts(str(texts)) == select_texts(prompts_file_texts(texts), shuffle=False, max_chars=2000)
    with pytest.raises(ValueError, match="needs the target's tokenizer"):
        prompt_texts("sharegpt-turns")
    with pytest.raises(ValueError, match="sharegpt-turns"):
        prompt_texts("no-such-set")


def test_train_draft_generates_and_resumes_over_turn_prompts(tiny_llama, tmp_path, monkeypatch, capsys):
    """The prompts phase writes `sharegpt-turns`; the data phase answers it in two sittings (the
    second resumes: answered indices are kept, not answered again); each sample is its prompt's
    chat-template ids then the answer, prompt index i being the i-th prompt of the file, which is the
    i-th of `--data sharegpt-turns` itself; a responses file of another prompt list is refused. The
    answers phase pairs the prompts with ShareGPT's text."""
    import specserve.assets

    source = _sharegpt_file(tmp_path)
    monkeypatch.setattr(specserve.assets, "dataset_path", lambda name, **_: source)
    out = tmp_path / "run"
    common = ["train-draft", "--target", str(tiny_llama.location.path), "--out", str(out), "--no-progress"]
    assert main([*common, "--phase", "prompts", "--data", "sharegpt-turns"]) == 0
    prompts_file = out / "prompts.jsonl.gz"
    prompts = read_prompts_file(prompts_file, max_chars=2000)
    tok = tiny_llama.tokenizer
    assert prompts == prompt_texts("sharegpt-turns", tokenizer=tok)
    data = [*common, "--phase", "data", "--data", str(prompts_file), "--max-new-tokens", "4"]
    assert main([*data, "--num-prompts", "5"]) == 0
    first = load_samples(out / "responses.npz")
    assert main([*data, "--num-prompts", "9"]) == 0
    samples = load_samples(out / "responses.npz")
    assert len(first) == 5 and len(samples) == 9 and len(set(samples.prompt_index.tolist())) == 9
    assert samples.prompt_index[:5].tolist() == first.prompt_index.tolist()
    assert all(samples.sample(i).tolist() == first.sample(i).tolist() for i in range(5))
    for i, index in enumerate(samples.prompt_index.tolist()):
        ids = chat_prompt_ids(tok, prompts[index])
        assert samples.sample(i)[: len(ids)].tolist() == ids and samples.prompt_lens[i] == len(ids)
    # The named data set is the file's list: its run resumes the file's answers; another seed is refused.
    turns = [*common, "--phase", "data", "--data", "sharegpt-turns", "--max-new-tokens", "4"]
    assert main([*turns, "--num-prompts", "10"]) == 0
    resumed = load_samples(out / "responses.npz")
    assert len(resumed) == 10 and all(
        resumed.sample(i).tolist() == samples.sample(i).tolist() for i in range(9)
    )
    assert main([*turns, "--num-prompts", "12", "--seed", "1"]) == 2
    assert "another prompt list" in capsys.readouterr().err
    assert len(load_samples(out / "responses.npz")) == 10
    assert main([*common, "--phase", "answers", "--data", "sharegpt-turns", "--max-new-tokens", "8"]) == 0
    answers = load_samples(out / "answers.npz")
    assert len(answers) == 14 and answers.meta["data"] == "sharegpt-turns"


def test_the_prompts_phase_leaves_out_what_sharded_runs_answered(tiny_llama, tmp_path, monkeypatch, capsys):
    """`--phase prompts --skip-answered R0,R1`: the prompts file less the prompts two `--shard W/2`
    data runs answered (index i of shard W being prompt W + 2i), in file order. Responses of another
    prompt list are refused by name."""
    import specserve.assets

    monkeypatch.setattr(specserve.assets, "dataset_path", lambda name, **_: _sharegpt_file(tmp_path))
    run, rest_dir = tmp_path / "run", tmp_path / "rest"
    common = ["train-draft", "--target", str(tiny_llama.location.path), "--no-progress"]
    assert main([*common, "--out", str(run), "--phase", "prompts", "--data", "sharegpt-turns"]) == 0
    prompts_file = str(run / "prompts.jsonl.gz")
    prompts = read_prompts_file(run / "prompts.jsonl.gz", max_chars=2000)
    data = [*common, "--out", str(run), "--phase", "data", "--data", prompts_file, "--max-new-tokens", "4"]
    for w, count in ((0, "3"), (1, "2")):
        assert (
            main([*data, "--shard", f"{w}/2", "--responses", str(run / f"r{w}.npz"), "--num-prompts", count])
            == 0
        )
    answered = {w + 2 * int(i) for w in (0, 1) for i in load_samples(run / f"r{w}.npz").prompt_index}
    assert len(answered) == 5
    rest_phase = [*common, "--out", str(rest_dir), "--phase", "prompts", "--data", prompts_file]
    assert main([*rest_phase, "--skip-answered", f"{run / 'r0.npz'},{run / 'r1.npz'}"]) == 0
    rest = read_prompts_file(rest_dir / "prompts.jsonl.gz", max_chars=2000)
    assert rest == [p for i, p in enumerate(prompts) if i not in answered] and len(rest) == len(prompts) - 5
    other = [*common, "--out", str(tmp_path / "other"), "--phase", "data", "--data", "sharegpt-turns"]
    assert main([*other, "--seed", "1", "--max-new-tokens", "4", "--num-prompts", "2"]) == 0
    capsys.readouterr()
    assert main([*rest_phase, "--skip-answered", str(tmp_path / "other" / "responses.npz")]) == 2
    assert "answers another prompt list" in capsys.readouterr().err
