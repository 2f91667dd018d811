"""The KV-move (accepted-path compaction) kernel against its torch reference, and its bounds checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve_kernels.kv_move import check_moves, move_kv, move_kv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def path_moves(seed: int, batch: int, page_size: int, max_nodes: int, num_pages: int):
    """Moves as the engine makes them: per request a random accepted path i_1 < i_2 < ... among its
    tree rows start + 1 .. start + n, each node moving to start + k, on the request's own pages."""
    rng = np.random.default_rng(seed)
    pages = rng.permutation(np.arange(1, num_pages))  # page 0 is the dummy page
    src, dst, segments, used = [], [], [0], 0
    for b in range(batch):
        start = int(rng.integers(0, 40))
        n = int(rng.integers(2, max_nodes + 1))
        need = -(-(start + n + 1) // page_size)
        own, used = pages[used : used + need], used + need
        slots = [int(own[p // page_size]) * page_size + p % page_size for p in range(start + n + 1)]
        depth = int(rng.integers(0, min(n, 8) + 1))
        path = np.sort(rng.choice(np.arange(1, n + 1), size=depth, replace=False))
        if b == 0 and (path == np.arange(1, depth + 1)).all():  # at least one request really moves
            path = np.array([n])
        moved = [(slots[start + int(i)], slots[start + k]) for k, i in enumerate(path, start=1) if i != k]
        if moved:
            src += [s for s, _ in moved]
            dst += [d for _, d in moved]
            segments.append(len(src))
    return [np.asarray(a, dtype=np.int64) for a in (src, dst, segments)]


def _caches(seed: int, layers: int, slots: int, heads: int, dim: int, dtype):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, slots, heads, dim, generator=g).to(dtype)
    v = torch.randn(layers, slots, heads, dim, generator=g).to(dtype)
    return k.to(DEVICE), v.to(DEVICE)


@pytest.mark.parametrize(
    ("batch", "page_size", "max_nodes", "heads", "dim", "dtype"),
    [(1, 1, 4, 2, 8, torch.float32), (5, 16, 16, 2, 16, torch.float32), (16, 1, 64, 3, 64, torch.bfloat16)],
)
def test_random_paths_match_the_reference(batch, page_size, max_nodes, heads, dim, dtype):
    num_pages = batch * (-(-(41 + max_nodes) // page_size) + 1) + 1
    for seed in range(2):
        src, dst, segments = path_moves(seed, batch, page_size, max_nodes, num_pages)
        assert len(src) > 0
        k, v = _caches(seed, 3, num_pages * page_size, heads, dim, dtype)
        expected_k, expected_v = k.clone(), v.clone()
        # In-order moves, one at a time: what both must equal.
        for s, d in zip(src, dst, strict=True):
            expected_k[:, d] = expected_k[:, s]
            expected_v[:, d] = expected_v[:, s]
        tensors = [torch.as_tensor(a, device=DEVICE) for a in (src, dst, segments)]
        ref_k, ref_v = k.clone(), v.clone()
        move_kv_ref(ref_k, ref_v, *tensors)
        move_kv(k, v, *tensors)
        assert torch.equal(k, expected_k) and torch.equal(v, expected_v)
        assert torch.equal(ref_k, expected_k) and torch.equal(ref_v, expected_v)


def test_bounds_and_races_are_refused():
    k, v = _caches(0, 2, 32, 2, 4, torch.float32)
    ok = [np.array([5, 7]), np.array([4, 5]), np.array([0, 2])]  # 5 -> 4, then 7 -> 5 (5 read first)
    check_moves(*ok, num_slots=32)
    bad = {
        "outside": ([np.array([40]), np.array([1]), np.array([0, 1])], "src"),
        "negative": ([np.array([3]), np.array([-1]), np.array([0, 1])], "dst"),
        "write twice": ([np.array([3, 4]), np.array([1, 1]), np.array([0, 2])], "dst"),
        "write before read": ([np.array([7, 5]), np.array([5, 4]), np.array([0, 2])], "dst"),
        "two segments": ([np.array([5, 9]), np.array([4, 5]), np.array([0, 1, 2])], "segments|dst"),
        "short segments": ([np.array([5, 7]), np.array([4, 5]), np.array([0, 1])], "segments"),
    }
    for name, (arrays, match) in bad.items():
        with pytest.raises(ValueError, match=match):
            check_moves(*arrays, num_slots=32)
        tensors = [torch.as_tensor(a, device=DEVICE) for a in arrays]
        for fn in (move_kv, move_kv_ref):
            with pytest.raises(ValueError, match=match):
                fn(k, v, *tensors)
        assert name
    with pytest.raises(ValueError, match="src"):
        move_kv(
            k,
            v,
            torch.tensor([1], dtype=torch.int32, device=DEVICE),
            *[torch.as_tensor(a, device=DEVICE) for a in ok[1:]],
        )
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    before = k.clone()
    move_kv(k, v, empty, empty, torch.zeros(1, dtype=torch.int64, device=DEVICE))
    assert torch.equal(k, before)
