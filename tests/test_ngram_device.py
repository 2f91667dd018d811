"""The device n-gram lookup (`ngram_chain_drafts` in `kernels/loop_glue.py`, the reference of the
device loop's `loop_prepare` kernel, which runs here too) against `NgramDrafter.propose`, draft for
draft: many random sequences with small vocabularies (matches everywhere, long and overlapping
ones), every match range and draft length, a batch of rows of different lengths padded with junk."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.spec.ngram import NgramDrafter
from specserve_kernels.loop_glue import loop_prepare, ngram_chain_drafts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel: native, or the interpreter


def _sequence(rng: np.random.Generator) -> list[int]:
    """Random tokens (1 to 300), some ending with a copy of an earlier stretch (a long match)."""
    vocab = int(rng.integers(1, 7))
    tokens = rng.integers(0, vocab, int(rng.integers(1, 300))).tolist()
    if rng.random() < 0.5:
        i = int(rng.integers(len(tokens)))
        tokens += tokens[i : i + int(rng.integers(1, 12))]
    return tokens


@pytest.mark.parametrize("min_match,max_match", [(1, 1), (1, 4), (2, 3), (3, 5), (4, 4)])
@pytest.mark.parametrize("num_steps", [1, 4, 8])
def test_drafts_equal_host_lookup(min_match, max_match, num_steps):
    rng = np.random.default_rng(min_match * 100 + max_match * 10 + num_steps)
    host = NgramDrafter(min_match, max_match)
    for _ in range(12):
        seqs = [_sequence(rng) for _ in range(int(rng.integers(1, 9)))]
        width = max(len(s) for s in seqs) + int(rng.integers(0, 20))
        junk = rng.integers(0, 7, (len(seqs), width))  # past each row's tokens
        hist = torch.as_tensor(junk, dtype=torch.int64)
        for b, seq in enumerate(seqs):
            hist[b, : len(seq)] = torch.tensor(seq)
        lengths = torch.tensor([len(s) for s in seqs])
        drafts, valid = ngram_chain_drafts(hist, lengths, num_steps, min_match, max_match)
        for b, seq in enumerate(seqs):
            want = host.propose(seq, num_steps)
            got = drafts[b][valid[b]].tolist()
            assert got == want, (seq, b)
            assert valid[b].tolist() == [True] * len(want) + [False] * (num_steps - len(want))
        # The kernel (Triton interpreter on the CPU), every row inactive: its drafts alone matter here.
        batch, query = len(seqs), num_steps + 1
        inputs = torch.zeros(3 * batch * query + batch, dtype=torch.int64, device=DEVICE).split(
            [batch * query] * 3 + [batch]
        )
        table = torch.zeros(batch, 1, dtype=torch.int64, device=DEVICE)
        kw = dict(num_steps=num_steps, min_match=min_match, max_match=max_match, page_size=16)
        hist_d, lengths_d = hist.to(DEVICE), lengths.to(DEVICE)
        got = loop_prepare(hist_d, lengths_d, torch.zeros_like(lengths_d), table, *inputs, **kw)
        assert torch.equal(got[0].cpu(), drafts) and torch.equal(got[1].cpu(), valid)


def test_single_token_and_no_match():
    hist = torch.tensor([[5, 0, 0, 0], [1, 2, 3, 0]])
    drafts, valid = ngram_chain_drafts(hist, torch.tensor([1, 3]), 2, 1, 4)
    assert not valid.any()
