"""Accepted-path compaction of the KV cache: copy slots `src[m]` to `dst[m]` in every layer.

After a tree verify the accepted nodes' K/V sit at the slots of their tree rows (context indices
start + i_1 < start + i_2 < ...); the next step expects them at start + 1, start + 2, ... . Moves are
grouped into segments (one per request), done in order within a segment: a destination may be the
source of an *earlier* move of its segment (i_j = k for some j < k), never of a later one, so one
program per (segment, layer) walking its moves in order reads every source before anything
overwrites it, with no scratch copy. Segments touch disjoint slots, so they run in parallel.
`check_moves` states those conditions; the launcher and the reference assert them.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def _move_kv_kernel(
    k_ptr,
    v_ptr,
    src_ptr,
    dst_ptr,
    seg_ptr,
    layer_stride,
    slot_stride,
    row_size,
    BLOCK: tl.constexpr,
):
    seg = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    first = tl.load(seg_ptr + seg)
    last = tl.load(seg_ptr + seg + 1)
    base = layer * layer_stride
    for m in range(first, last):
        src = base + tl.load(src_ptr + m) * slot_stride
        dst = base + tl.load(dst_ptr + m) * slot_stride
        # The same thread loads and stores each column, so a later store never passes an earlier load.
        for start in range(0, row_size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < row_size
            tl.store(k_ptr + dst + cols, tl.load(k_ptr + src + cols, mask=ok), mask=ok)
            tl.store(v_ptr + dst + cols, tl.load(v_ptr + src + cols, mask=ok), mask=ok)


def move_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    segments: torch.Tensor,
    *,
    check_bounds: bool = True,
) -> None:
    """In place: for every layer, slot dst[m] of k and v [layers, slots, kv_heads, head_dim] takes
    slot src[m]'s contents, moves in order within each segment segments[s] .. segments[s + 1]."""
    _check(k, v, src, dst, segments, check_bounds)
    num_segments = segments.shape[0] - 1
    if num_segments == 0 or src.shape[0] == 0:
        return
    row_size = k.shape[2] * k.shape[3]
    block = min(triton.next_power_of_2(row_size), 1024)
    _move_kv_kernel[(num_segments, k.shape[0])](
        k, v, src, dst, segments, k.stride(0), k.stride(1), row_size, BLOCK=block
    )


def move_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    segments: torch.Tensor,
    *,
    check_bounds: bool = True,
) -> None:
    """Plain torch: every source gathered first, then scattered (the same result as moving in order
    when no move reads a slot an earlier move wrote, which `check_moves` guarantees)."""
    _check(k, v, src, dst, segments, check_bounds)
    k[:, dst] = k[:, src].clone()
    v[:, dst] = v[:, src].clone()


def check_moves(src: np.ndarray, dst: np.ndarray, segments: np.ndarray, num_slots: int) -> None:
    """Raise ValueError unless the moves are in bounds and race-free: segments cover 0..M in
    order; every slot in [0, num_slots); destinations distinct; a destination that is also a source
    only of an earlier move of its own segment; no slot shared by two segments."""
    src, dst, segments = (np.asarray(a, dtype=np.int64) for a in (src, dst, segments))
    moves = src.shape[0]
    if src.shape != (moves,) or dst.shape != (moves,) or segments.ndim != 1 or segments.shape[0] < 1:
        raise ValueError(f"src/dst: expected [M] each and segments [S + 1], got {src.shape}, {dst.shape}")
    if segments[0] != 0 or segments[-1] != moves or (np.diff(segments) < 0).any():
        raise ValueError(f"segments: must rise from 0 to the number of moves {moves}")
    for name, slots in (("src", src), ("dst", dst)):
        if moves and (slots.min() < 0 or slots.max() >= num_slots):
            raise ValueError(f"{name}: a slot falls outside [0, {num_slots})")
    if np.unique(dst).shape[0] != moves:
        raise ValueError("dst: a slot is written twice")
    owner = np.repeat(np.arange(segments.shape[0] - 1), np.diff(segments))
    order = np.arange(moves)
    src_at = {int(s): (int(o), int(i)) for s, o, i in zip(src, owner, order, strict=True)}
    for slot, seg, i in zip(dst.tolist(), owner.tolist(), order.tolist(), strict=True):
        read = src_at.get(slot)
        if read is not None and (read[0] != seg or read[1] >= i):
            raise ValueError(f"dst: slot {slot} is written before a move reads it (or by another segment)")
    first_segment: dict[int, int] = {}
    for seg, (a, b) in enumerate(zip(segments[:-1].tolist(), segments[1:].tolist(), strict=True)):
        for slot in set(src[a:b].tolist()) | set(dst[a:b].tolist()):
            if first_segment.setdefault(slot, seg) != seg:
                raise ValueError(f"segments: slot {slot} is touched by two segments")


def _check(k, v, src, dst, segments, check_bounds: bool) -> None:
    if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
        raise ValueError(
            f"k/v: expected two [layers, slots, kv_heads, head_dim] caches, got {k.shape}, {v.shape}"
        )
    if k.stride(3) != 1 or k.stride(2) != k.shape[3] or v.stride() != k.stride():
        raise ValueError("k/v: each slot's heads must be contiguous, with one layout for both")
    for name, t in (("src", src), ("dst", dst), ("segments", segments)):
        if t.dim() != 1 or t.dtype != torch.int64 or t.device != k.device:
            raise ValueError(
                f"{name}: expected a 1-D int64 tensor on {k.device}, got {t.dtype} {tuple(t.shape)}"
            )
    if src.shape != dst.shape:
        raise ValueError(f"src/dst: shapes differ, {tuple(src.shape)} and {tuple(dst.shape)}")
    if check_bounds:
        check_moves(src.cpu().numpy(), dst.cpu().numpy(), segments.cpu().numpy(), k.shape[1])
