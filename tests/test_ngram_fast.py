"""The n-gram drafter against the windowed search it replaced (`ngram_reference.py`), bit for bit:
the same chains and the same `DraftTree`s (every field) over many random sequences with a small
vocabulary (matches everywhere, long and overlapping ones), every match range, depth, topk and
node count; and through `draft` / `draft_tree`, the requests' token mirrors kept in step with
appends, a dropped placeholder and a list replaced or cut."""

from __future__ import annotations

import numpy as np
import pytest
from ngram_reference import RefNgramDrafter

from specserve.engine.request import FUTURE_TOKEN, Request
from specserve.spec.ngram import PYTHON_CANDIDATES, NgramDrafter
from specserve.types import SamplingParams


def _same_tree(a, b) -> None:
    assert (a is None) == (b is None)
    if a is None:
        return
    assert a.tokens == b.tokens
    assert all(type(t) is int for t in a.tokens)
    np.testing.assert_array_equal(a.parents, b.parents)
    np.testing.assert_array_equal(a.cand_tokens, b.cand_tokens)
    np.testing.assert_array_equal(a.cand_rows, b.cand_rows)
    assert a.q is None and b.q is None


def _sequence(rng: np.random.Generator) -> list[int]:
    """Random tokens, some with repeated stretches (long matches), lengths 0 to 400."""
    vocab = int(rng.integers(1, 7))
    tokens = rng.integers(0, vocab, int(rng.integers(0, 400))).tolist()
    if tokens and rng.random() < 0.5:  # copy an earlier stretch to the end
        i = int(rng.integers(len(tokens)))
        tokens += tokens[i : i + int(rng.integers(1, 12))]
    return tokens


@pytest.mark.parametrize("python_candidates", [0, PYTHON_CANDIDATES, 10**9])
def test_ngram_matches_the_reference_bit_for_bit(python_candidates):
    """`python_candidates`: a chain's candidates extended by array code only, as in production
    (Python up to a few), or in Python only."""
    rng = np.random.default_rng(python_candidates % 1000)
    for _ in range(700):
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 5))
        new, ref = NgramDrafter(lo, hi), RefNgramDrafter(lo, hi)
        new.python_candidates = python_candidates
        tokens = _sequence(rng)
        budget = int(rng.integers(0, 10))
        assert new.propose(tokens, budget) == ref.propose(tokens, budget)
        depth, topk = int(rng.integers(0, 8)), int(rng.integers(1, 9))
        nodes = int(rng.integers(1, 70))
        _same_tree(new.propose_tree(tokens, depth, topk, nodes), ref.propose_tree(tokens, depth, topk, nodes))


def test_ngram_draft_reads_the_mirror_and_never_a_placeholder():
    rng = np.random.default_rng(1)
    new, ref = NgramDrafter(1, 4), RefNgramDrafter(1, 4)
    reqs = [Request(f"r{i}", rng.integers(0, 4, 20).tolist(), SamplingParams(), seed=0) for i in range(3)]
    for step in range(120):
        for req in reqs:
            if step % 17 == 5:  # overlap: a placeholder, then the sampled token in its place
                req.token_ids.append(FUTURE_TOKEN)
                req.num_pending = 1
                new.draft([req], [4])
                assert req.draft == []
                req.drop_pending()
            if step % 29 == 11 and req is reqs[1]:  # a new list object
                req.token_ids = list(req.token_ids)
            if step % 31 == 13 and req is reqs[2]:  # cut and regrown in place, unannounced
                last = req.token_ids.pop()
                req.token_ids.append((last + 1) % 4)
            req.token_ids.extend(rng.integers(0, 4, int(rng.integers(1, 3))).tolist())
        new.draft(reqs, [5] * 3)
        assert [r.draft for r in reqs] == [ref.propose(r.token_ids, 5) for r in reqs]
        new.draft_tree(reqs, [4] * 3, 3, 10)
        for req in reqs:
            want = ref.propose_tree(req.token_ids, 4, 3, 10)
            _same_tree(req.draft_tree, want)
            assert req.draft == (list(want.tokens) if want else [])


def test_many_candidates_try_the_latest_first_and_fall_back_to_all():
    """Past PYTHON_CANDIDATES ends the latest few are tried first: a full match there (a cycle) is
    the answer; else (the full match is older than them) every candidate is, as the reference says."""
    ref = RefNgramDrafter(1, 4)
    cycle = [7, 8, 9] * 200 + [7, 8]
    # The last token (5) recurs 100 times, each after 1 2 3 but for the latest 20 (after 0 0 0):
    # the full match of the suffix 1 2 3 5 is older than the latest candidates.
    older = [1, 2, 3, 5, 6] * 80 + [0, 0, 0, 5, 6] * 20 + [1, 2, 3, 5]
    for tokens in (cycle, older):
        drafter = NgramDrafter(1, 4)
        assert len([t for t in tokens[:-1] if t == tokens[-1]]) > PYTHON_CANDIDATES
        assert drafter.propose(tokens, 5) == ref.propose(tokens, 5)
    assert NgramDrafter(1, 4).propose(older, 5) == [6, 0, 0, 0, 5]  # after the last 1 2 3 5
