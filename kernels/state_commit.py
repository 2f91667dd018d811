"""Commit a hybrid model's recurrent state after verify: live slot dst[r] takes snapshot src[r].

During a verify step the Mamba-2 layers write the state after every draft token (for a tree, after
every node along its parent path) to snapshot rows; once acceptance is known, each request's last
accepted row is copied into its live slot, in every layer: the SSM state and the convolution window
alike. One program per (request, layer, block of elements) per tensor. Sources are snapshot rows
and destinations live slots (two different tensors), and destinations are distinct, so the copies
cannot race; `check_commits` states that, and both the launcher and the reference assert it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _copy_rows_kernel(
    live_ptr,
    snap_ptr,
    src_ptr,
    dst_ptr,
    live_layer_stride,
    live_slot_stride,
    snap_layer_stride,
    snap_row_stride,
    row_size,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < row_size
    src = tl.load(src_ptr + r)
    dst = tl.load(dst_ptr + r)
    values = tl.load(snap_ptr + layer * snap_layer_stride + src * snap_row_stride + cols, mask=ok)
    tl.store(live_ptr + layer * live_layer_stride + dst * live_slot_stride + cols, values, mask=ok)


def commit_states(
    live_ssm: torch.Tensor,
    live_conv: torch.Tensor,
    snap_ssm: torch.Tensor,
    snap_conv: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    check_bounds: bool = True,
) -> None:
    """In place: live_x[:, dst[r]] = snap_x[:, src[r]] for x in (ssm, conv); live [layers, slots, ...],
    snapshots [layers, rows, ...] of the same trailing shape and dtype."""
    _check(live_ssm, live_conv, snap_ssm, snap_conv, src, dst, check_bounds)
    if src.shape[0] == 0:
        return
    for live, snap in ((live_ssm, snap_ssm), (live_conv, snap_conv)):
        row_size = live[0, 0].numel()
        grid = (src.shape[0], live.shape[0], triton.cdiv(row_size, BLOCK))
        _copy_rows_kernel[grid](
            live,
            snap,
            src,
            dst,
            live.stride(0),
            live.stride(1),
            snap.stride(0),
            snap.stride(1),
            row_size,
            BLOCK=BLOCK,
        )


def commit_states_ref(
    live_ssm: torch.Tensor,
    live_conv: torch.Tensor,
    snap_ssm: torch.Tensor,
    snap_conv: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    check_bounds: bool = True,
) -> None:
    """Plain torch: the same copies by advanced indexing."""
    _check(live_ssm, live_conv, snap_ssm, snap_conv, src, dst, check_bounds)
    live_ssm[:, dst] = snap_ssm[:, src]
    live_conv[:, dst] = snap_conv[:, src]


def check_commits(src: Sequence[int], dst: Sequence[int], num_rows: int, num_slots: int) -> None:
    """Raise ValueError unless every source is a snapshot row, every destination a slot, and no slot
    is written twice."""
    if len(src) != len(dst):
        raise ValueError(f"src/dst: {len(src)} sources for {len(dst)} slots")
    if any(not 0 <= s < num_rows for s in src):
        raise ValueError(f"src: a snapshot row falls outside [0, {num_rows})")
    if any(not 0 <= d < num_slots for d in dst):
        raise ValueError(f"dst: a slot falls outside [0, {num_slots})")
    if len(set(dst)) != len(dst):
        raise ValueError("dst: a slot is written twice")


def _check(live_ssm, live_conv, snap_ssm, snap_conv, src, dst, check_bounds: bool) -> None:
    for name, live, snap in (("ssm", live_ssm, snap_ssm), ("conv", live_conv, snap_conv)):
        if live.dim() < 3 or live.shape[0] != snap.shape[0] or live.shape[2:] != snap.shape[2:]:
            raise ValueError(
                f"{name}: expected live [layers, slots, ...] and snapshots [layers, rows, ...] alike, "
                f"got {tuple(live.shape)} and {tuple(snap.shape)}"
            )
        if live.dtype != snap.dtype or live.device != snap.device:
            raise ValueError(f"{name}: live and snapshot tensors differ in dtype or device")
        if not (live[0, 0].is_contiguous() and snap[0, 0].is_contiguous()):
            raise ValueError(f"{name}: each slot's and snapshot's state must be contiguous")
        if live.stride(1) != live[0, 0].numel() or snap.stride(1) != snap[0, 0].numel():
            raise ValueError(f"{name}: slots and snapshots must be packed rows")
    for name, t in (("src", src), ("dst", dst)):
        if t.dim() != 1 or t.dtype != torch.int64 or t.device != live_ssm.device:
            raise ValueError(
                f"{name}: expected a 1-D int64 tensor on {live_ssm.device}, got {t.dtype} {tuple(t.shape)}"
            )
    if check_bounds:
        check_commits(src.tolist(), dst.tolist(), snap_ssm.shape[1], live_ssm.shape[1])
