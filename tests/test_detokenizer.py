"""Incremental detokenisation equals decoding the whole output; stop strings never leak to streams."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from specserve.engine.detokenizer import IncrementalDetokenizer, StopMatcher

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3:45pm, isn't it?",
    "emoji": "Party time 🎉🎉 — family: 👨‍👩‍👧‍👦, flags 🇫🇷🇯🇵, skin tone 👍🏽!",
    "cjk": "日本語のテキストと中文文本，还有한국어 텍스트。",
    "code": "def f(x):\n    if x:\n\t\treturn  x  +  1\n\n\n    return None  \n",
    "mixed": "  leading spaces, naïve café, ∑ᵢ xᵢ² ≤ 𝔼[X], \u00a0nbsp and \ufffd literal",
}
PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf: Path):
    from specserve.model.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_gguf)


def _stream(tokenizer, prompt_ids, output_ids, chunks, skip_special_tokens=True) -> tuple[list[str], str]:
    """Push ``output_ids`` in pieces of the given sizes; returns the pieces pushed out and the flush."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    pieces, at = [], 0
    for size in chunks:
        pieces.append(detok.push(output_ids[at : at + size]))
        at += size
    assert at == len(output_ids)
    tail = detok.flush()
    assert detok.text == "".join(pieces) + tail
    return pieces, tail


@pytest.mark.parametrize("name", list(TEXTS))
def test_token_by_token_equals_whole_decode(smollm2_tokenizer, name: str) -> None:
    tok = smollm2_tokenizer
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    ids = tok.encode(TEXTS[name], add_special_tokens=False)
    pieces, tail = _stream(tok, prompt_ids, ids, [1] * len(ids))
    assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=True) == TEXTS[name]
    # Incomplete characters are held back, never streamed as replacement characters.
    if name != "mixed":
        assert not any("\ufffd" in piece for piece in pieces)


def test_multibyte_characters_are_held_until_complete(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits this emoji, which is what makes the test meaningful
    pieces, tail = _stream(tok, [], ids, [1] * len(ids))
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🎉" and tail == ""


@pytest.mark.parametrize("check_stops", [False, True])
def test_each_token_s_text_starts_where_its_characters_do(smollm2_tokenizer, check_stops: bool) -> None:
    """`TextState.start_of` (completions' `text_offset`): counted from the decoded pieces, the
    offsets ran past the text for characters of several tokens (one each) and skipped special tokens."""
    from specserve.engine.text import TextState

    tok = smollm2_tokenizer
    text = "日本語 🎉 ok<|im_end|> 終"
    ids = tok.encode(text, add_special_tokens=False)
    state = TextState(tok, [], ["never-there"] if check_stops else [], True, offsets=True)
    for token_id in ids:
        state.push(token_id, check_stops=check_stops)
    state.finish()
    out = state.text
    assert out == tok.decode(ids, skip_special_tokens=True)
    starts = [state.start_of(i) for i in range(len(ids))]
    assert starts[0] == 0 and starts == sorted(starts) and starts[-1] < len(out)
    # each token's share of the text (from its start to the next one's) spells the text in order
    shares = [out[a:b] for a, b in zip(starts, [*starts[1:], len(out)], strict=True)]
    assert "".join(shares) == out
    assert len(set(starts)) < len(starts)  # the tokens of one character start together
    assert TextState(tok, [], [], True).start_of(0) is None  # kept only when asked (logprobs)


def test_chunked_pushes_and_empty_prompt(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    rng = random.Random(0)
    text = "".join(TEXTS.values())
    ids = tok.encode(text, add_special_tokens=False)
    for prompt in ([], tok.encode(PROMPT, add_special_tokens=False)):
        chunks = []
        while sum(chunks) < len(ids):
            chunks.append(min(rng.randint(0, 6), len(ids) - sum(chunks)))
        pieces, tail = _stream(tok, prompt, ids, chunks)
        assert "".join(pieces) + tail == text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_push_each_leaves_the_text_one_push_at_a_time_does(
    smollm2_tokenizer, skip_special_tokens: bool
) -> None:
    """`push_each` (a request's unread ids detokenised together: two decodes, not two an id) leaves
    after every call the text pushing its ids one at a time leaves: random ids split characters,
    make invalid bytes and carry special tokens; real text carries multi-token characters."""
    tok = smollm2_tokenizer
    rng = random.Random(7 + skip_special_tokens)
    specials = list(tok.all_special_ids)
    texts = [tok.encode("".join(TEXTS.values()), add_special_tokens=False)]
    for _ in range(30):
        texts.append(
            [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(40)]
        )
    for trial, ids in enumerate(texts):
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 8))]
        one = IncrementalDetokenizer(tok, prompt, skip_special_tokens)
        each = IncrementalDetokenizer(tok, prompt, skip_special_tokens)
        at = 0
        while at < len(ids):
            size = rng.randint(0, 12)
            for token_id in ids[at : at + size]:
                one.push([token_id])
            each.push_each(ids[at : at + size])
            at += size
            assert each.text == one.text, trial
        assert each.text + each.flush() == one.text + one.flush(), trial


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_equal_whole_decode(smollm2_tokenizer, skip_special_tokens: bool) -> None:
    tok = smollm2_tokenizer
    rng = random.Random(1234 + skip_special_tokens)
    specials = list(tok.all_special_ids)
    for trial in range(40):
        # Random byte-level tokens make invalid and split UTF-8 sequences; sprinkle special tokens in.
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(40)]
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 8))]
        chunks = [1] * len(ids) if trial % 2 else [4] * 10
        pieces, tail = _stream(tok, prompt, ids, chunks, skip_special_tokens)
        assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip_special_tokens), trial


def test_special_tokens_in_output(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("Hi there!<|im_end|>\n<|im_start|>user\nMore", add_special_tokens=False)
    for skip in (True, False):
        pieces, tail = _stream(tok, [], ids, [1] * len(ids), skip)
        assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)
    assert "<|im_end|>" in tok.decode(ids, skip_special_tokens=False)


def test_window_stays_small(smollm2_tokenizer) -> None:
    """O(1) per token: each decode covers a few recent ids, not the whole output."""
    tok = smollm2_tokenizer
    lengths: list[int] = []

    class Counting:
        def decode(self, ids, **kwargs):
            lengths.append(len(ids))
            return tok.decode(ids, **kwargs)

    ids = tok.encode(TEXTS["english"] * 20 + TEXTS["cjk"] * 5, add_special_tokens=False)
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    pieces, tail = _stream(Counting(), prompt_ids, ids, [1] * len(ids))
    assert "".join(pieces) + tail == tok.decode(ids)
    assert len(ids) > 300 and max(lengths) <= 10


# ---- stop strings -----------------------------------------------------------------------------


def test_stop_found_across_token_boundaries() -> None:
    matcher = StopMatcher(["STOP"])
    text = ""
    hits = []
    for piece in ["Hello S", "T", "O", "P and more"]:
        start, text = len(text), text + piece
        hits.append(matcher.find(text, start))
    assert hits == [None, None, None, (6, "STOP")]


def test_earliest_of_several_stops() -> None:
    matcher = StopMatcher(["world", "lo", "\n\n"])
    assert matcher.find("hello world\n\n") == (3, "lo")
    assert matcher.find("say: world\n\nlo") == (5, "world")
    assert matcher.find("nothing here") is None


def test_overlapping_stops() -> None:
    matcher = StopMatcher(["abc", "bcd", "ab"])
    # "ab" and "abc" start at the same index: the longer, which was being completed, is reported.
    assert matcher.find("xxabcd") == (2, "abc")
    assert matcher.find("xxabd") == (2, "ab")
    assert matcher.find("xbcd") == (1, "bcd")
    assert StopMatcher(["aa"]).find("aaaa", start=3) == (2, "aa")


def test_find_only_reports_stops_reaching_the_new_text() -> None:
    matcher = StopMatcher(["end", "x"])
    text = "the end of it, then more"
    assert matcher.find(text, start=7) is None  # "end" finished before index 7: already handled
    assert matcher.find(text, start=6) == (4, "end")
    assert matcher.find(text + "x", start=len(text)) == (len(text), "x")


def test_safe_len_holds_back_partial_matches() -> None:
    matcher = StopMatcher(["</answer>", "\n\nUser:"])
    assert matcher.safe_len("The answer is 4</ans") == len("The answer is 4")
    assert matcher.safe_len("The answer is 4<") == len("The answer is 4")
    assert matcher.safe_len("Done.\n\nUs") == len("Done.")
    assert matcher.safe_len("Done.\n") == len("Done.")
    assert matcher.safe_len("a < b") == len("a < b")  # "<" mid-text is not a trailing prefix
    assert matcher.safe_len("") == 0
    assert StopMatcher(["aab"]).safe_len("xaaa") == len("xa")


def test_streaming_never_shows_stop_text() -> None:
    matcher = StopMatcher(["<stop>"])
    text, shown = "", ""
    for piece in ["ok ", "<", "st", "op", "> hidden"]:
        start, text = len(text), text + piece
        hit = matcher.find(text, start)
        if hit is not None:
            shown = text[: hit[0]]
            break
        shown = text[: matcher.safe_len(text)]
        assert "<" not in shown
    assert shown == "ok "


def test_empty_stop_list() -> None:
    matcher = StopMatcher([])
    assert matcher.find("anything at all") is None
    assert matcher.safe_len("anything") == len("anything")
    assert StopMatcher([""]).find("abc") is None  # an empty stop string would stop everything


def test_prompt_ending_mid_character(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("ok 🎉🎉 done", add_special_tokens=False)
    for cut in range(1, len(ids)):
        # The prompt's last bytes are the start of a character the output completes (or not).
        pieces, tail = _stream(tok, ids[:cut], ids[cut:], [1] * (len(ids) - cut))
        assert "".join(pieces) + tail == tok.decode(ids[cut:]), cut
