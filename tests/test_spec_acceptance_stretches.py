"""Acceptance that comes in stretches (`AcceptanceTracker.per_token`, `harmonic_prefix`).

An n-gram lookup keeps finding a long match through a repeated stretch of text and keeps missing
outside one, so a k-chain's verifies sample the text unevenly: few in a good stretch, many in a
poor one. Rates counted per verify then promise shorter chains far fewer tokens than they make;
counted per token, with a chain's tokens a verify the harmonic mean over the starts, one chain's
verifies predict every other chain's."""

from __future__ import annotations

import random

import pytest

from specserve import LLM
from specserve.spec.acceptance import AcceptanceTracker, expected_prefix, harmonic_prefix

DEPTHS = (1, 2, 4, 8)


def _stretchy_text(seed: int, tokens: int = 40_000) -> list[int]:
    """Per token, the drafts a verify starting there gets accepted: through a repeated stretch
    (18-60 tokens) the match runs to the stretch's end; elsewhere (10-40 tokens) a draft is right
    one time in five, for one token."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < tokens:
        good = rng.randrange(18, 60)
        out += [good - i - 1 for i in range(good)]
        out += [1 if rng.random() < 0.2 else 0 for _ in range(rng.randrange(10, 40))]
    return out[:tokens]


def _replay(text: list[int], depth: int) -> list[tuple[int, int]]:
    """A `depth`-chain over the text: its verifies' (drafted, accepted), each starting where the
    one before left off."""
    verifies, at = [], 0
    while at < len(text):
        kept = min(text[at], depth)
        verifies.append((depth, kept))
        at += kept + 1
    return verifies


def _tokens_a_verify(verifies: list[tuple[int, int]]) -> float:
    return sum(kept + 1 for _, kept in verifies) / len(verifies)


def _tracker(per_token: bool) -> AcceptanceTracker:
    tracker = AcceptanceTracker(8, request_alpha=1e-7, pooled_alpha=1e-7, strength=1e-3)
    tracker.per_token = per_token
    return tracker


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("source", [2, 8])
def test_one_chain_s_verifies_predict_every_chain_counted_per_token(seed, source):
    text = _stretchy_text(seed)
    made = {d: _tokens_a_verify(_replay(text, d)) for d in DEPTHS}
    assert made[1] < made[2] < made[4] < made[8]
    per_verify, per_token = _tracker(False), _tracker(True)
    for tracker in (per_verify, per_token):
        tracker.observe_run(1, [("r", _replay(text, source))], batch=1)
    promised = per_token.prefix(per_token.pooled(1))
    for d in (d for d in DEPTHS if d <= source):
        assert promised[d] == pytest.approx(made[d], rel=0.05), (d, promised[d], made[d])
    assert promised[source] == pytest.approx(made[source], rel=1e-3)  # its own: exact
    # counted per verify, the 8-chain's rates promise the 1-chain far less than it makes
    if source == 8:
        classic = expected_prefix(per_verify.pooled(1))
        assert classic[8] == pytest.approx(made[8], rel=1e-3)
        assert classic[1] < 0.9 * made[1]


def test_verifies_one_by_one_and_in_a_run_count_alike():
    """`observe` per verify and a device-loop run's `observe_run` weigh a verify by its tokens alike."""
    verifies = [(4, 0), (4, 4), (4, 1), (4, 2), (4, 0)]
    one, run = _tracker(True), _tracker(True)
    for drafted, kept in verifies:
        one.observe("r", 1, drafted, kept)
    run.observe_run(1, [("r", verifies)], batch=1)
    assert run.rates("r", 1) == pytest.approx(one.rates("r", 1))
    assert run.pooled(1) == pytest.approx(one.pooled(1))
    assert one.rates("r", 1) != pytest.approx(_observed(_tracker(False), verifies).rates("r", 1))


def _observed(tracker: AcceptanceTracker, verifies) -> AcceptanceTracker:
    for drafted, kept in verifies:
        tracker.observe("r", 1, drafted, kept)
    return tracker


def test_harmonic_prefix():
    """A chain's tokens a verify from per-token rates: 1 + a for one draft (each start of a 1-chain
    whose draft is right covers 2 tokens); no drafts, 1; rates of 1, every draft kept."""
    assert harmonic_prefix([]) == [1.0]
    a = 2 * 0.3 / (1 + 0.3)  # a 1-chain accepting 0.3 of its verifies, per token
    assert harmonic_prefix([a]) == pytest.approx([1.0, 1.3])
    assert harmonic_prefix([1.0, 1.0, 1.0]) == pytest.approx([1.0, 2.0, 3.0, 4.0])
    assert harmonic_prefix([0.0, 0.9]) == pytest.approx([1.0, 1.0, 1.0])


def test_n_gram_engines_count_per_token_and_head_engines_per_verify(small_vocab_target, tmp_path):
    from specserve.model.head_checkpoint import random_head, save_head

    common = dict(device="cpu", dtype="float32", max_total_tokens=2048)
    ngram = LLM(small_vocab_target, speculative={"method": "ngram", "adaptive": {"profile": False}}, **common)
    assert ngram.engine.adaptive.acceptance.per_token
    config, tensors = random_head("eagle3", small_vocab_target.arch, seed=1)
    head = {"method": "eagle3", "draft_model": str(save_head(tmp_path / "h", config, tensors))}
    llm = LLM(small_vocab_target, speculative={**head, "adaptive": {"profile": False}}, **common)
    assert not llm.engine.adaptive.acceptance.per_token
