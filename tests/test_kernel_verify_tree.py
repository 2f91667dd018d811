"""The tree-walk kernel against its torch reference: random forests, a hand-made tree, bounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve_kernels.verify_tree import verify_tree, verify_tree_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_trees(seed: int, batch: int, max_rows: int, k: int, vocab: int):
    """Row blocks of random trees, laid out in shuffled order: each row's candidates are its
    children (rows) mixed with row-less candidates, distinct tokens per row."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, max_rows + 1, batch)
    order = rng.permutation(batch)
    starts = np.zeros(batch, dtype=np.int64)
    offset = 0
    for b in order:
        starts[b] = offset
        offset += sizes[b]
    tokens = np.full((offset, k), -1, dtype=np.int64)
    children = np.full((offset, k), -1, dtype=np.int64)
    depth_max = 1
    for b in range(batch):
        n = sizes[b]
        kids: list[list[int]] = [[] for _ in range(n)]
        depth = np.zeros(n, dtype=np.int64)
        open_rows = [0]  # rows with room for another child
        for r in range(1, n):
            parent = open_rows[int(rng.integers(len(open_rows)))]
            kids[parent].append(r)
            depth[r] = depth[parent] + 1
            open_rows = [p for p in open_rows if len(kids[p]) < k] + [r]
        depth_max = max(depth_max, int(depth.max()) + 1)
        for r in range(n):
            slots = list(kids[r]) + [-1] * int(rng.integers(0, k - len(kids[r]) + 1))
            rng.shuffle(slots)
            ids = rng.choice(vocab, size=len(slots), replace=False)
            tokens[starts[b] + r, : len(slots)] = ids
            children[starts[b] + r, : len(slots)] = slots
    accept = rng.random((offset, k))
    accept[rng.random((offset, k)) < 0.3] = 1.0  # often a sure win, so deep walks happen
    accept[rng.random((offset, k)) < 0.2] = 0.0
    u = rng.random((offset, k)).clip(1e-12)
    residual = rng.integers(0, vocab, offset)
    as_t = lambda a, dtype=torch.int64: torch.as_tensor(np.ascontiguousarray(a), dtype=dtype)  # noqa: E731
    return (
        as_t(accept, torch.float64),
        as_t(tokens),
        as_t(children),
        as_t(u, torch.float64),
        as_t(residual),
        as_t(starts),
        as_t(sizes),
        depth_max + 1,
    )


def _run(fn, args, **kw):
    *tensors, width = args
    tensors = [t.to(DEVICE) for t in tensors]
    return [t.cpu() for t in fn(*tensors, width, **kw)]


@pytest.mark.parametrize(("batch", "max_rows", "k"), [(1, 5, 2), (5, 17, 4), (16, 65, 8), (3, 9, 3)])
def test_random_trees_match_the_reference(batch, max_rows, k):
    lengths = set()
    for seed in range(3):
        args = random_trees(seed * 31 + batch, batch, max_rows, k, vocab=50)
        tokens, path, count = _run(verify_tree, args, vocab=50)
        ref = verify_tree_ref(*args[:-1], args[-1], vocab=50)
        assert torch.equal(tokens, ref[0]) and torch.equal(path, ref[1]) and torch.equal(count, ref[2])
        # Each request emits its path plus one token; each path row is a candidate of the one before.
        for b in range(batch):
            n = int(count[b])
            assert (tokens[b, : n + 1] >= 0).all() and (tokens[b, n + 1 :] == -1).all()
            assert (path[b, n:] == -1).all()
            lengths.add(n)
    assert len(lengths) >= 3 or max_rows < 9


def test_hand_made_tree():
    # Request 0 (rows 0..4): root candidates [7 -> row 2 (rejected), 8 -> row 1 (accepted)];
    # row 1: [9 (row-less, accepted)] -> emits 8, 9 with path [1]. Row 2 has candidate row 3, row 3 row 4.
    # Request 1 (rows 5..6): root candidate 4 -> row 1 rejected: emits its root row's residual 50.
    # Request 2 (row 7): the root alone: its residual (the bonus token) 70.
    k = 2
    tokens = torch.full((8, k), -1)
    children = torch.full((8, k), -1)
    accept = torch.zeros(8, k, dtype=torch.float64)
    tokens[0], children[0], accept[0] = torch.tensor([7, 8]), torch.tensor([2, 1]), torch.tensor([0.1, 0.9])
    tokens[1, 0], accept[1, 0] = 9, 1.0
    tokens[2, 0], children[2, 0], accept[2, 0] = 5, 3, 1.0
    tokens[3, 0], children[3, 0], accept[3, 0] = 6, 4, 1.0
    tokens[5, 0], children[5, 0], accept[5, 0] = 4, 1, 0.2
    u = torch.full((8, k), 0.5, dtype=torch.float64)
    residual = torch.arange(8) * 10
    starts, sizes = torch.tensor([0, 5, 7]), torch.tensor([5, 2, 1])
    args = (accept, tokens, children, u, residual, starts, sizes, 4)
    for fn in (verify_tree, verify_tree_ref):
        out, path, count = _run(fn, args)
        assert out.tolist() == [[8, 9, -1, -1], [50, -1, -1, -1], [70, -1, -1, -1]]
        assert path.tolist() == [[1, -1, -1, -1], [-1] * 4, [-1] * 4] and count.tolist() == [1, 0, 0]
    accept[0] = torch.tensor([0.9, 0.9])  # now 7 wins: rows 2, 3, 4 all the way down, then 40
    for fn in (verify_tree, verify_tree_ref):
        out, path, count = _run(fn, args)
        assert out[0].tolist() == [7, 5, 6, 40] and path[0].tolist() == [2, 3, 4, -1] and count[0] == 3


def test_launcher_checks_bounds_and_shapes():
    args = random_trees(0, 4, 9, 3, vocab=20)
    accept, tokens, children, u, residual, starts, sizes, width = args
    for fn in (verify_tree, verify_tree_ref):
        with pytest.raises(ValueError, match="width"):
            fn(accept, tokens, children, u, residual, starts, sizes, 1)
        with pytest.raises(ValueError, match="row_start"):
            fn(accept, tokens, children, u, residual, starts + 100, sizes, width)
        with pytest.raises(ValueError, match="u"):
            fn(accept, tokens, children, u.float(), residual, starts, sizes, width)
        bad = children.clone()
        bad[starts[0]] = torch.where(bad[starts[0]] >= 0, 10_000, bad[starts[0]])
        bad[starts[0], 0] = 10_000
        with pytest.raises(ValueError, match="children"):
            fn(accept, tokens, bad, u, residual, starts, sizes, width)
        bad_tokens = tokens.clone()
        bad_tokens[0, 0] = 20
        with pytest.raises(ValueError, match="tokens"):
            fn(accept, bad_tokens, children, u, residual, starts, sizes, width, vocab=20)
    # The largest engine shapes: up to 257 rows a request (topk 16, 256 draft tokens), 64 requests
    # (the interpreter walks 8 of them: it pays per program and step).
    big = random_trees(5, 64 if DEVICE == "cuda" else 8, 257, 16, vocab=1000)
    out = _run(verify_tree, big, vocab=1000)
    assert torch.equal(out[0], verify_tree_ref(*big[:-1], big[-1], vocab=1000)[0])
    full = random_trees(6, 64, 257, 16, vocab=1000)
    assert verify_tree_ref(*full[:-1], full[-1], vocab=1000)[2].shape == (64,)
