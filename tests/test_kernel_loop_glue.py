"""The device loop's glue kernels (`kernels/loop_glue.py`) against their torch references, bit for bit.

Random histories over small vocabularies (matches everywhere, long repeats at the end), lengths 1
and 2 among longer ones, inactive rows and pad rows (length 1, limit 0), limits that cut a chain,
stop ids hit mid-chain; every output compared: drafts, valid, the verify input (ids, positions,
slots, seq lens), the histories, lengths, limits and records. Then several loop iterations chained,
with a stand-in forward that agrees with the drafts often. On the CPU the kernels run under the
Triton interpreter (conftest sets TRITON_INTERPRET=1 before triton is imported); the `gpu` variant
runs them natively at serving widths.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve_kernels.loop_glue import loop_accept, loop_accept_ref, loop_prepare, loop_prepare_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _state(rng: np.random.Generator, batch: int, num_steps: int, page_size: int, max_len: int, device):
    """hist [B, W] (junk past each row's length), lengths, limits, page table, stop ids [B, S]."""
    query = num_steps + 1
    width = max_len + query + int(rng.integers(0, 8))
    vocab = int(rng.integers(1, 7))
    hist = rng.integers(0, 7, (batch, width))
    lengths = np.ones(batch, dtype=np.int64)
    limits = np.zeros(batch, dtype=np.int64)
    for b in range(batch):
        kind = rng.random()
        size = int(rng.choice([1, 2, rng.integers(3, max_len - num_steps)]))
        tokens = rng.integers(0, vocab, size)
        if size > 8 and rng.random() < 0.5:  # end on a copy of an earlier stretch: a long match
            i = int(rng.integers(0, size - 4))
            stretch = tokens[i : i + int(rng.integers(1, 12))]
            size = min(size + len(stretch), max_len - num_steps)
            tokens = np.concatenate([tokens, stretch])[:size]
        hist[b, :size] = tokens
        lengths[b] = size
        if kind < 0.15:  # a pad row
            lengths[b], limits[b] = 1, 0
        elif kind < 0.3:  # done: limit reached or stopped
            limits[b] = int(rng.choice([0, size]))
        else:  # active; the limit sometimes inside this step's chain
            limits[b] = size + int(rng.integers(1, query + 3))
    pages = -(-width // page_size) + 1
    table = rng.permutation(np.arange(1, batch * pages + 1)).reshape(batch, pages)
    stops = np.full((batch, 8), -1, dtype=np.int64)
    for b in range(batch):
        n = int(rng.integers(0, 4))
        stops[b, :n] = rng.integers(0, vocab + 2, n)
    as_t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64, device=device)  # noqa: E731
    return [as_t(a) for a in (hist, lengths, limits, table, stops)]


def _buffers(rng: np.random.Generator, batch: int, num_steps: int, device):
    """Verify-bucket inputs as one packed head (ids, positions, slots, seq lens), full of junk."""
    tokens = batch * (num_steps + 1)
    head = torch.as_tensor(rng.integers(0, 1000, 3 * tokens + batch), device=device)
    return list(head.split([tokens] * 3 + [batch]))


def _clone(tensors):
    return [t.clone() for t in tensors]


def _target(
    rng: np.random.Generator, drafts: torch.Tensor, valid: torch.Tensor, stops: torch.Tensor, vocab: int
):
    """A stand-in argmax [B, k + 1]: the drafts up to a random rejection, random tokens after, and
    sometimes a stop id planted inside the chain."""
    batch, k = drafts.shape
    target = rng.integers(0, vocab, (batch, k + 1))
    d = drafts.cpu().numpy()
    for b in range(batch):
        agree = int(rng.integers(0, k + 1))
        target[b, :agree] = d[b, :agree]
        ids = [s for s in stops[b].tolist() if s >= 0]
        if ids and rng.random() < 0.5:
            target[b, int(rng.integers(0, k + 1))] = ids[int(rng.integers(len(ids)))]
    return torch.as_tensor(target, device=drafts.device)


def _compare(got, want, names):
    for name, g, w in zip(names, got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w), (name, g, w)


def _check_step(rng, state, buffers, num_steps, min_match, max_match, page_size):
    """One prepare + accept through both; returns the (equal) outputs for tallies."""
    hist, lengths, limits, table, stops = state
    kw = dict(num_steps=num_steps, min_match=min_match, max_match=max_match, page_size=page_size)
    ref_bufs, ker_bufs = _clone(buffers), _clone(buffers)
    ref = loop_prepare_ref(hist, lengths, limits, table, *ref_bufs, **kw)
    got = loop_prepare(hist, lengths, limits, table, *ker_bufs, **kw)
    _compare(
        [*got, *ker_bufs], [*ref, *ref_bufs], ["drafts", "valid", "ids", "positions", "slots", "seq_lens"]
    )
    drafts, valid = ref
    target = _target(rng, drafts, valid, stops, int(hist.max()) + 1)
    batch = hist.shape[0]
    records = torch.full((batch, num_steps + 3), -5, dtype=torch.int64, device=hist.device)
    ref_state = _clone([hist, lengths, limits, records])
    ker_state = _clone([hist, lengths, limits, records])
    loop_accept_ref(target, drafts, valid, ref_state[0], ref_state[1], ref_state[2], stops, ref_state[3])
    loop_accept(target, drafts, valid, ker_state[0], ker_state[1], ker_state[2], stops, ker_state[3])
    _compare(ker_state, ref_state, ["hist", "lengths", "limits", "records"])
    return valid, ref_state, lengths, limits


@pytest.mark.parametrize(
    ("num_steps", "min_match", "max_match", "page_size", "batch", "max_len"),
    [
        (0, 1, 1, 4, 7, 60),  # plain decoding: no drafts
        (1, 1, 1, 1, 5, 40),
        (4, 1, 4, 4, 9, 120),
        (5, 2, 3, 16, 16, 300),
        (7, 3, 5, 1, 4, 80),
        (3, 1, 8, 2, 3, 2100),
    ],
)
def test_random_steps_match_the_reference(num_steps, min_match, max_match, page_size, batch, max_len):
    rng = np.random.default_rng(num_steps * 1000 + max_match * 10 + batch)
    seen = set()
    for _ in range(6):
        state = _state(rng, batch, num_steps, page_size, max_len, DEVICE)
        buffers = _buffers(rng, batch, num_steps, DEVICE)
        valid, (_, new_len, new_limit, records), lengths, limits = _check_step(
            rng, state, buffers, num_steps, min_match, max_match, page_size
        )
        taken = records[:, num_steps + 1]
        room = (limits - lengths).clamp(min=0)
        seen |= {"draft" for v in valid.any(dim=1).tolist() if v}
        seen |= {
            "stopped" for s, lim in zip(new_limit.tolist(), limits.tolist(), strict=True) if lim and not s
        }
        seen |= {"cut" for t, r in zip(taken.tolist(), room.tolist(), strict=True) if 0 < r == t <= num_steps}
        seen |= {"accepted" for t in taken.tolist() if t > 1}
        seen |= {"idle" for t in taken.tolist() if t == 0}
        assert torch.equal(new_len, lengths + taken)
        assert bool((taken <= num_steps + 1).all())
    if num_steps == 0:
        assert {"stopped", "idle"} <= seen and not seen & {"draft", "accepted"}
        return
    assert {"draft", "stopped", "accepted", "idle"} <= seen
    if num_steps > 1:
        assert "cut" in seen


def _chained(device, batch: int, num_steps: int, max_len: int, iterations: int, seed: int):
    """Loop iterations chained on both paths: after each, the histories, lengths and limits agree;
    the stand-in forward takes the next input token (the draft) with probability 0.8."""
    rng = np.random.default_rng(seed)
    page_size, min_match, max_match = 4, 1, 4
    hist, lengths, limits, table, stops = _state(rng, batch, num_steps, page_size, max_len, device)
    limits = torch.where(
        limits > lengths, torch.minimum(lengths + 40, torch.full_like(limits, max_len - 1)), limits
    )
    # Row 0 runs every iteration: active, far from its limit, no stop ids.
    lengths[0] = min(int(lengths[0]), max_len // 2)
    limits[0], stops[0] = lengths[0] + 40, -1
    ref = [hist.clone(), lengths.clone(), limits.clone()]
    ker = [hist.clone(), lengths.clone(), limits.clone()]
    query = num_steps + 1
    kw = dict(num_steps=num_steps, min_match=min_match, max_match=max_match, page_size=page_size)
    taken_total = 0
    for _ in range(iterations):
        ref_bufs, ker_bufs = _buffers(rng, batch, num_steps, device), _buffers(rng, batch, num_steps, device)
        r = loop_prepare_ref(ref[0], ref[1], ref[2], table, *ref_bufs, **kw)
        g = loop_prepare(ker[0], ker[1], ker[2], table, *ker_bufs, **kw)
        _compare(
            [*g, *ker_bufs], [*r, *ref_bufs], ["drafts", "valid", "ids", "positions", "slots", "seq_lens"]
        )
        ids = ref_bufs[0].view(batch, query)
        follow = torch.as_tensor(rng.random((batch, query)) < 0.8, device=device)
        noise = torch.as_tensor(rng.integers(0, 6, (batch, query)), device=device)
        target = torch.where(follow, torch.roll(ids, -1, dims=1), noise).contiguous()
        records = [torch.zeros(batch, query + 2, dtype=torch.int64, device=device) for _ in range(2)]
        loop_accept_ref(target, *r, *ref, stops, records[0])
        loop_accept(target, *g, *ker, stops, records[1])
        _compare([*ker, records[1]], [*ref, records[0]], ["hist", "lengths", "limits", "records"])
        taken_total += int(records[0][:, query].sum())
    # Row 0 takes a token each iteration; drafts accepted (or other rows) add more.
    assert taken_total > iterations if num_steps else taken_total >= iterations


@pytest.mark.parametrize("num_steps", [0, 4])
def test_chained_iterations_match_the_reference(num_steps):
    _chained(DEVICE, batch=6, num_steps=num_steps, max_len=200, iterations=12, seed=3)


@pytest.mark.parametrize(("num_steps", "page_size", "batch"), [(1, 1, 3), (4, 4, 9), (6, 16, 5)])
def test_given_drafts_match_the_reference(num_steps, page_size, batch):
    """A head's drafts handed in (`given`): no lookup, every draft valid, the same verify input."""
    rng = np.random.default_rng(num_steps * 7 + batch)
    hist, lengths, limits, table, _ = _state(rng, batch, num_steps, page_size, 90, DEVICE)
    given = torch.as_tensor(rng.integers(0, 500, (batch, num_steps)), device=DEVICE)
    kw = dict(num_steps=num_steps, min_match=1, max_match=3, page_size=page_size, given=given)
    ref_bufs = _buffers(rng, batch, num_steps, DEVICE)
    ker_bufs = _clone(ref_bufs)
    ref = loop_prepare_ref(hist, lengths, limits, table, *ref_bufs, **kw)
    got = loop_prepare(hist, lengths, limits, table, *ker_bufs, **kw)
    _compare(
        [*got, *ker_bufs], [*ref, *ref_bufs], ["drafts", "valid", "ids", "positions", "slots", "seq_lens"]
    )
    assert torch.equal(got[0], given) and bool(got[1].all())
    ids = ker_bufs[0].view(batch, num_steps + 1)
    assert torch.equal(ids[:, 1:], given)
    assert torch.equal(ids[:, 0], hist.gather(1, (lengths - 1)[:, None]).squeeze(1))
    with pytest.raises(ValueError, match="given"):
        loop_prepare(hist, lengths, limits, table, *ker_bufs, **{**kw, "given": given[:, :-1].contiguous()})


def test_single_token_rows_and_no_match():
    hist = torch.tensor([[5, 0, 0, 0, 0, 0], [1, 2, 3, 0, 0, 0], [4, 4, 0, 0, 0, 0]], device=DEVICE)
    lengths, limits = torch.tensor([1, 3, 2], device=DEVICE), torch.tensor([9, 9, 0], device=DEVICE)
    table = torch.tensor([[7], [8], [9]], device=DEVICE)
    bufs = _buffers(np.random.default_rng(0), 3, 2, DEVICE)
    drafts, valid = loop_prepare(
        hist, lengths, limits, table, *bufs, num_steps=2, min_match=1, max_match=4, page_size=8
    )
    assert valid.tolist() == [[False, False], [False, False], [True, False]]
    assert drafts[2, 0].item() == 4
    ids, positions, slots, seq_lens = (t.cpu().view(3, -1) for t in bufs)
    assert ids[:, 0].tolist() == [5, 3, 4]
    assert positions.tolist() == [[0, 1, 2], [2, 3, 4], [0, 1, 2]]
    assert slots.tolist() == [[56, 57, 58], [66, 67, 68], [0, 0, 0]]
    assert seq_lens.flatten().tolist() == [3, 5, 3]


def test_launchers_check_shapes():
    rng = np.random.default_rng(1)
    hist, lengths, limits, table, stops = _state(rng, 3, 2, 4, 30, DEVICE)
    bufs = _buffers(rng, 3, 2, DEVICE)
    kw = dict(num_steps=2, min_match=1, max_match=3, page_size=4)
    with pytest.raises(ValueError, match="ids"):
        loop_prepare(hist, lengths, limits, table, bufs[0][:-1], *bufs[1:], **kw)
    with pytest.raises(ValueError, match="lengths"):
        loop_prepare(hist, lengths.int(), limits, table, *bufs, **kw)
    drafts, valid = loop_prepare(hist, lengths, limits, table, *bufs, **kw)
    target = torch.zeros(3, 3, dtype=torch.int64, device=DEVICE)
    records = torch.zeros(3, 5, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="valid"):
        loop_accept(target, drafts, valid.long(), hist, lengths, limits, stops, records)
    with pytest.raises(ValueError, match="records"):
        loop_accept(target, drafts, valid, hist, lengths, limits, stops, records[:, :4])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_gpu_serving_widths(batch):
    """Natively on CUDA at serving widths (a 9k-token context buffer, rows up to 8.5k tokens)."""
    rng = np.random.default_rng(batch)
    for num_steps, max_match in ((0, 1), (5, 4), (8, 8)):
        state = _state(rng, batch, num_steps, 16, 8600, "cuda")
        buffers = _buffers(rng, batch, num_steps, "cuda")
        _check_step(rng, state, buffers, num_steps, 1, max_match, 16)
    for num_steps in (0, 5):
        _chained("cuda", batch=batch, num_steps=num_steps, max_len=4000, iterations=20, seed=batch)
