"""Sampling's exponential race in one pass over the vocabulary, its noise hashed inline.

`specserve/engine/sampler.py` draws token v of a row with probability p_v as argmax_v p_v / E_v,
E_v = -log(u_v), u_v the counter-hashed uniform of (the row's key, v). In torch that is a [R, V]
int64 hash (a dozen elementwise launches, each a pass over R x V int64), a float64 log and divide,
then the argmax: at the 256 verify rows of a batch-64 chain over SmolLM2's 49k ids, about 2 ms of an
H200 iteration whose forward takes 3. Here each program hashes, scores and reduces a slice of a row
(`SPLITS` slices a row, so that a few rows still fill the GPU), and a second launch picks each row's
winner among its slices; the values are the torch statement's, operation for operation (the same
float64 log and divide), so kernel and reference draw the same tokens.

`drop` ([R] int64, -1: none) draws from p with that token removed, as `norm(max(p - onehot(d), 0))`
(a rejected deterministic draft's residual), and from p itself where nothing else has mass (a
residual rounding left empty, as `specserve.spec.verify.residual_draws` does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The hash's constants (`specserve/engine/sampler.py`: lowbias32 multipliers, the token id's salt).
MUL_A = 0x21F0AAAD
MUL_B = 0x735A2D97
SALT_TOKEN = 0x5BD1E995
MASK32 = 0xFFFFFFFF
# The same, as the compiler admits globals in a kernel.
_MUL_A, _MUL_B = tl.constexpr(MUL_A), tl.constexpr(MUL_B)
_SALT_TOKEN, _MASK32 = tl.constexpr(SALT_TOKEN), tl.constexpr(MASK32)
# Programs a row at most: enough to fill the GPU's multiprocessors at batch 1 to 16.
MAX_SPLITS = 32


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 15)


@triton.jit
def _race_slices_kernel(
    probs_ptr,
    keys_ptr,
    drop_ptr,
    best_ptr,
    arg_ptr,
    vocab,
    stride,
    chunk,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_DROP: tl.constexpr,
):
    """Program (row, slice): the best score and its id over ids [slice * chunk, + chunk), of the
    residual (the dropped id scored 0) and of p itself, at [row, slice, 0 / 1]."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    key = tl.load(keys_ptr + row)
    if HAS_DROP:
        drop = tl.load(drop_ptr + row)
    else:  # no row drops a token: nothing to read (no -1 tensor filled for it either)
        drop = tl.full((), -1, tl.int64)
    best_res = tl.full((), -1.0, tl.float64)
    best_all = tl.full((), -1.0, tl.float64)
    arg_res = tl.full((), 0, tl.int64)
    arg_all = tl.full((), 0, tl.int64)
    first = part * chunk
    end = tl.minimum(first + chunk, vocab)
    for start in range(first, end, BLOCK):
        ids = start + tl.arange(0, BLOCK).to(tl.int64)
        inside = ids < end
        p = tl.load(probs_ptr + row * stride + ids, mask=inside, other=0.0)
        h = _mix32(_mix32(key ^ _mix32(ids ^ _SALT_TOKEN)) ^ key)
        e = -tl.log((h.to(tl.float64) + 0.5) * (1.0 / 4294967296.0))
        score = tl.where(inside, p.to(tl.float64) / e, -1.0)
        # The dropped id keeps what max(p - 1, 0) leaves of it in float32 (nothing, unless rounding).
        dropped = tl.maximum(p - 1.0, 0.0).to(tl.float64) / e
        res = tl.where(inside & (ids == drop), dropped, score)
        block_all = tl.max(score, axis=0)
        block_res = tl.max(res, axis=0)
        # Strictly greater: an equal score in a later block keeps the earlier id (torch.argmax).
        arg_all = tl.where(
            block_all > best_all, tl.argmax(score, axis=0, tie_break_left=True) + start, arg_all
        )
        arg_res = tl.where(block_res > best_res, tl.argmax(res, axis=0, tie_break_left=True) + start, arg_res)
        best_all = tl.maximum(best_all, block_all)
        best_res = tl.maximum(best_res, block_res)
    out = (row * SPLITS + part) * 2
    tl.store(best_ptr + out, best_res)
    tl.store(best_ptr + out + 1, best_all)
    tl.store(arg_ptr + out, arg_res)
    tl.store(arg_ptr + out + 1, arg_all)


@triton.jit
def _race_pick_kernel(best_ptr, arg_ptr, out_ptr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Per row: the winner among its slices (ties to the earlier slice, whose ids are lower); the
    residual's where it has mass (a positive score), else p's."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    at = (row * SPLITS + s) * 2
    inside = s < SPLITS
    best_res = tl.load(best_ptr + at, mask=inside, other=-2.0)
    best_all = tl.load(best_ptr + at + 1, mask=inside, other=-2.0)
    win_res = tl.argmax(best_res, axis=0, tie_break_left=True)
    win_all = tl.argmax(best_all, axis=0, tie_break_left=True)
    arg_res = tl.load(arg_ptr + (row * SPLITS + win_res) * 2)
    arg_all = tl.load(arg_ptr + (row * SPLITS + win_all) * 2 + 1)
    tl.store(out_ptr + row, tl.where(tl.max(best_res, axis=0) > 0, arg_res, arg_all))


def race_draw(
    probs: torch.Tensor, keys: torch.Tensor, drop: torch.Tensor | None = None, block: int = 1024
) -> torch.Tensor:
    """probs [R, V] (float32, need not be normalised), keys [R] int64 (each row's noise key, below
    2**32), drop [R] int64 or None → [R] int64 draws (see `race_draw_ref`). No host sync."""
    rows, vocab = _check(probs, keys, drop)
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    if not rows:
        return out
    splits = max(1, min(MAX_SPLITS, 128 // rows, triton.cdiv(vocab, block)))
    chunk = triton.cdiv(triton.cdiv(vocab, splits), block) * block
    splits = triton.cdiv(vocab, chunk)
    best = torch.empty(rows * splits * 2, dtype=torch.float64, device=probs.device)
    args = torch.empty(rows * splits * 2, dtype=torch.int64, device=probs.device)
    _race_slices_kernel[(rows, splits)](
        probs,
        keys,
        keys if drop is None else drop,  # not read without a drop
        best,
        args,
        vocab,
        probs.stride(0),
        chunk,
        SPLITS=splits,
        BLOCK=block,
        HAS_DROP=drop is not None,
        num_warps=4,
    )
    _race_pick_kernel[(rows,)](best, args, out, SPLITS=splits, BLOCK_S=max(2, triton.next_power_of_2(splits)))
    return out


def race_draw_ref(probs: torch.Tensor, keys: torch.Tensor, drop: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch: argmax_v r_v / -log(u(key, v)) in float64, r = p, or with `drop`
    r = max(p - onehot(drop), 0) where that leaves mass (p itself where it does not; drop < 0: p)."""
    from specserve.engine.sampler import noise_from_key  # the noise's one statement

    rows, vocab = _check(probs, keys, drop)
    if drop is not None:
        present = drop >= 0
        one_hot = torch.zeros_like(probs).scatter_(
            1, drop.clamp_min(0)[:, None], present[:, None].to(probs.dtype)
        )
        residual = (probs - one_hot).clamp_min(0.0)
        probs = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs)
    return (probs.double() / -torch.log(noise_from_key(keys, vocab))).argmax(dim=-1)


def _check(probs: torch.Tensor, keys: torch.Tensor, drop: torch.Tensor | None) -> tuple[int, int]:
    if probs.dim() != 2 or probs.dtype != torch.float32 or probs.stride(1) != 1:
        raise ValueError(
            f"probs: expected a unit-stride float32 [R, V] tensor, got {probs.dtype} {tuple(probs.shape)}"
        )
    rows = probs.shape[0]
    for name, t in (("keys", keys), ("drop", drop)):
        if t is not None and (t.shape != (rows,) or t.dtype != torch.int64):
            raise ValueError(f"{name}: expected int64 [{rows}], got {t.dtype} {tuple(t.shape)}")
    return rows, probs.shape[1]
