"""The chain-acceptance kernel against its torch reference: random batches and hand-made chains."""

from __future__ import annotations

import pytest
import torch

from specserve_kernels.verify_chain import verify_chain, verify_chain_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(seed: int, batch: int, vocab: int, sampled: bool):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 8, (batch,), generator=g)
    order = torch.randperm(batch, generator=g)  # chains laid out in a shuffled order
    starts = torch.zeros(batch, dtype=torch.long)
    offset = 0
    for b in order.tolist():
        starts[b] = offset
        offset += int(counts[b]) + 1
    rows = offset
    draft = torch.randint(0, vocab, (rows,), generator=g)
    probs = torch.softmax(torch.randn(rows, vocab, generator=g), dim=-1)
    # Often concentrate p on the draft, so long accepted chains occur as well as rejections.
    peaked = torch.rand(rows, generator=g) < 0.7
    probs[peaked] = probs[peaked] * 0.1
    probs[peaked, draft[peaked]] += 0.9
    q = torch.softmax(torch.randn(rows, vocab, generator=g), dim=-1) if sampled else None
    u = torch.rand(rows, generator=g, dtype=torch.float64).clamp_min(1e-12)
    replacement = torch.randint(0, vocab, (rows,), generator=g)
    return probs, draft, starts, counts, u, replacement, q


def _run(fn, args, **kw):
    args = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    tokens, accepted = fn(*args, **kw)
    return tokens.cpu(), accepted.cpu()


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize(("batch", "vocab"), [(1, 11), (5, 1000), (33, 11)])
def test_random_batches_match_the_reference(batch, vocab, sampled):
    outcomes = set()
    for seed in range(3):
        args = _batch(seed * 100 + batch, batch, vocab, sampled)
        tokens, accepted = _run(verify_chain, args)
        ref_tokens, ref_accepted = verify_chain_ref(*args)
        assert torch.equal(tokens, ref_tokens) and torch.equal(accepted, ref_accepted)
        counts = args[3]
        outcomes |= {
            "full" if a == n else "partial"
            for a, n in zip(accepted.tolist(), counts.tolist(), strict=True)
            if n
        }
        outcomes |= {"none" for a, n in zip(accepted.tolist(), counts.tolist(), strict=True) if n and a == 0}
    if batch > 1:
        assert {"full", "partial", "none"} <= outcomes


def test_hand_made_chains():
    vocab = 4
    # Request 0: drafts [1, 2, 3], rows 0..3; row 1 rejects (p = 0), row 2 would pass.
    # Request 1: no drafts, row 4 (bonus only). Request 2: drafts [2, 0] all accepted, rows 5..7.
    # Request 3: draft [3] at p(d) = 0.25 < u: rejected as a deterministic draft, accepted when
    # q(d) = 0 (min(1, p/q) = 1). Rows 8..9.
    draft = torch.tensor([1, 2, 3, 0, 0, 2, 0, 0, 3, 0])
    probs = torch.full((10, vocab), 0.25)
    probs[1] = torch.tensor([0.5, 0.5, 0.0, 0.0])
    probs[0, 1] = 1.0
    probs[5, 2] = probs[6, 0] = 1.0
    q = torch.full((10, vocab), 0.25)
    q[8, 3] = 0.0
    u = torch.full((10,), 0.5, dtype=torch.float64)
    replacement = torch.arange(10) + 10
    starts, counts = torch.tensor([0, 4, 5, 8]), torch.tensor([3, 0, 2, 1])
    common = [[1, 11, -1, -1], [14, -1, -1, -1], [2, 0, 17, -1]]
    for q_arg, last in ((None, [18, -1, -1, -1]), (q, [3, 19, -1, -1])):
        args = (probs, draft, starts, counts, u, replacement, q_arg)
        tokens, accepted = _run(verify_chain, args)
        assert tokens.tolist() == [*common, last]
        assert accepted.tolist() == [1, 0, 2, 0 if q_arg is None else 1]
        assert torch.equal(tokens, verify_chain_ref(*args)[0])


def test_launcher_checks_shapes_and_bounds():
    probs, draft, starts, counts, u, replacement, _ = _batch(0, 4, 11, False)
    with pytest.raises(ValueError, match="u"):
        verify_chain(probs, draft, starts, counts, u.float(), replacement)
    with pytest.raises(ValueError, match="num_drafts"):
        verify_chain(probs, draft, starts, counts[:2], u, replacement)
    bad = draft.clone()
    bad[starts[counts > 0][0]] = 11
    with pytest.raises(ValueError, match="draft"):
        verify_chain(probs, bad, starts, counts, u, replacement)
    with pytest.raises(ValueError, match="row_start"):
        verify_chain(probs, draft, starts + probs.shape[0], counts, u, replacement)
    empty = torch.zeros(0, dtype=torch.long)
    tokens, accepted = verify_chain(probs, draft, empty, empty, u, replacement)
    assert tokens.shape == (0, 1) and accepted.shape == (0,)
