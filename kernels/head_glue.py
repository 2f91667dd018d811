"""A head's greedy-chain glue on the device: each chain step's input, and the loop extend's settle.

Inside a CUDA graph every kernel costs 1.5-2 us however little it does, and a head's chain step and
its device-loop extend each wrapped their forward in a dozen or more tiny torch ops (compares,
wheres, gathers, index arithmetic, copies): ~65 of a batch-1 loop iteration's ~250 launches on an
H100. Here each is one launch of one program per request:

- `chain_step_input` (`DraftGraphs.chain_forward`, step s over R rows a request: R = s for an MTP
  module new to the chain, else 1): the step's token ids (the seed and the drafts so far, from the
  drafts buffer, whose column 0 it writes with the seed), positions (after the request's newest
  extended position while the request still runs steps, else from 0), KV slots (its page table, or
  the dummy slot), context lengths, query starts, and the hidden rows the module reads (its own
  previous output, after a fresh step's first row: the previous module's tail);
- `extend_settle` (`HeadDeviceLoop._extend`, after the head's forward over every verify row): per
  request the row of its last taken token, that row's lm_head input gathered for the seed's logits,
  its output as the new tail, the new base position (kept, with the tail, where a request took
  nothing), and the steps the next chain runs. The seed itself comes out of the split argmax, which
  writes it in place, mapped to target ids, only where the request took tokens (`row_argmax`'s
  `out`, `table`, `keep`).

The references are the torch code `chain_forward` and `_extend` ran before; the kernels equal them
bit for bit (integer arithmetic and copies). No host sync: capturable in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class StepInput(NamedTuple):
    """A chain step's forward input: ids, positions, slots [B * R]; seq_lens [B]; query_start
    [B + 1]; hidden [B * R, H]."""

    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor
    hidden: torch.Tensor


@triton.jit
def _chain_step_input_kernel(
    seeds_ptr,
    steps_ptr,
    base_ptr,
    table_ptr,
    drafts_ptr,
    first_ptr,
    previous_ptr,
    ids_ptr,
    positions_ptr,
    slots_ptr,
    seq_lens_ptr,
    query_start_ptr,
    hidden_ptr,
    step,
    rows,
    previous_rows,
    hidden_size,
    dummy_slot,
    table_stride,
    drafts_stride_b,
    drafts_stride_j,
    first_stride,
    previous_stride_b,
    previous_stride_r,
    PAGE_SIZE: tl.constexpr,
    FRESH: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    in_rows = r < rows
    seed = tl.load(seeds_ptr + b)
    tl.store(drafts_ptr + b * drafts_stride_b, seed)  # draft 0 of the chain is the extend's seed
    # Row r is the chain's token at column step - R + r: the seed, or an earlier step's draft.
    col = step - rows + r
    later = in_rows & (col > 0)
    tok = tl.load(drafts_ptr + b * drafts_stride_b + col * drafts_stride_j, mask=later, other=0)
    tok = tl.where(col == 0, seed, tok)
    # A request past its own steps turns into a pad row: positions from 0, KV to the dummy slot.
    active = tl.load(steps_ptr + b) >= step
    first = tl.where(active, tl.load(base_ptr + b) + step - rows + 1, 0)
    pos = first + r
    page = tl.load(
        table_ptr + b * table_stride + pos // PAGE_SIZE, mask=tl.where(active, in_rows, False), other=0
    )
    slot = tl.where(active, page * PAGE_SIZE + pos % PAGE_SIZE, dummy_slot)
    out = b * rows + r
    tl.store(ids_ptr + out, tok, mask=in_rows)
    tl.store(positions_ptr + out, pos, mask=in_rows)
    tl.store(slots_ptr + out, slot, mask=in_rows)
    tl.store(seq_lens_ptr + b, first + rows)
    tl.store(query_start_ptr + b + 1, (b + 1) * rows)
    tl.store(query_start_ptr + b, 0, mask=b == 0)
    # Hidden row r: the module's previous output one position back (its last R rows), or, for a
    # fresh module's first row, the previous module's tail.
    h = tl.arange(0, BLOCK_H)
    for i in tl.static_range(BLOCK_R):
        if i < rows:
            src = previous_ptr + b * previous_stride_b + (previous_rows - rows + i) * previous_stride_r
            if FRESH and i == 0:
                src = first_ptr + b * first_stride
            dst = hidden_ptr + (b * rows + i) * hidden_size
            for start in range(0, hidden_size, BLOCK_H):
                ok = start + h < hidden_size
                tl.store(dst + start + h, tl.load(src + start + h, mask=ok), mask=ok)


@triton.jit
def _extend_settle_kernel(
    records_ptr,
    lengths_ptr,
    limits_ptr,
    steps_left_ptr,
    to_logits_ptr,
    out_ptr,
    selected_ptr,
    moved_ptr,
    tails_ptr,
    base_ptr,
    steps_ptr,
    query,
    hidden_size,
    logits_size,
    records_stride,
    to_logits_stride,
    out_stride,
    tails_stride,
    BLOCK_H: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    taken = tl.load(records_ptr + b * records_stride + query)
    moved = taken > 0
    row = b * query + tl.maximum(taken - 1, 0)  # the last taken token's verify row
    length = tl.load(lengths_ptr + b)
    tl.store(moved_ptr + b, moved.to(tl.uint8))
    base = tl.load(base_ptr + b)
    tl.store(base_ptr + b, tl.where(moved, length - 2, base))
    active = length < tl.load(limits_ptr + b)
    tl.store(steps_ptr + b, tl.where(active, tl.load(steps_left_ptr + b), 0))
    h = tl.arange(0, BLOCK_H)
    for start in range(0, logits_size, BLOCK_H):
        ok = start + h < logits_size
        x = tl.load(to_logits_ptr + row * to_logits_stride + start + h, mask=ok)
        tl.store(selected_ptr + b * logits_size + start + h, x, mask=ok)
    # A request that took nothing (done, or a pad row) keeps its tail.
    keep = tl.where(moved, hidden_size, 0)
    for start in range(0, hidden_size, BLOCK_H):
        ok = start + h < keep
        x = tl.load(out_ptr + row * out_stride + start + h, mask=ok)
        tl.store(tails_ptr + b * tails_stride + start + h, x, mask=ok)


def chain_step_input(
    seeds: torch.Tensor,
    steps: torch.Tensor,
    base: torch.Tensor,
    page_table: torch.Tensor,
    drafts: torch.Tensor,
    first: torch.Tensor | None,
    previous: torch.Tensor,
    *,
    step: int,
    rows: int,
    page_size: int,
    dummy_slot: int,
) -> StepInput:
    """Chain step `step`'s input over `rows` rows a request (see `chain_step_input_ref`); writes
    drafts[:, 0] = seeds. No host sync: capturable in a CUDA graph."""
    _check_step(seeds, steps, base, page_table, drafts, first, previous, step, rows)
    batch, hidden_size = seeds.shape[0], previous.shape[2]
    packed = torch.empty(3 * batch * rows + 2 * batch + 1, dtype=torch.int64, device=seeds.device)
    ids, positions, slots, seq_lens, query_start = packed.split([batch * rows] * 3 + [batch, batch + 1])
    hidden = torch.empty(batch * rows, hidden_size, dtype=previous.dtype, device=seeds.device)
    if batch:
        _chain_step_input_kernel[(batch,)](
            seeds,
            steps,
            base,
            page_table,
            drafts,
            previous if first is None else first,
            previous,
            ids,
            positions,
            slots,
            seq_lens,
            query_start,
            hidden,
            step,
            rows,
            previous.shape[1],
            hidden_size,
            dummy_slot,
            page_table.stride(0),
            drafts.stride(0),
            drafts.stride(1),
            0 if first is None else first.stride(0),
            previous.stride(0),
            previous.stride(1),
            PAGE_SIZE=page_size,
            FRESH=first is not None,
            BLOCK_R=max(2, triton.next_power_of_2(rows)),
            BLOCK_H=min(1024, max(16, triton.next_power_of_2(hidden_size))),
        )
    return StepInput(ids, positions, slots, seq_lens, query_start, hidden)


def chain_step_input_ref(
    seeds: torch.Tensor,
    steps: torch.Tensor,
    base: torch.Tensor,
    page_table: torch.Tensor,
    drafts: torch.Tensor,
    first: torch.Tensor | None,
    previous: torch.Tensor,
    *,
    step: int,
    rows: int,
    page_size: int,
    dummy_slot: int,
) -> StepInput:
    """Plain torch. Per request b of seeds [B] (the extend's first drafts), steps [B] (the chain
    steps it runs), base [B] (its newest extended position), page_table [B, P], drafts [B, S + 1]
    (any strides; column j: draft j, the seed at 0, written here), previous [B, R', H] (the module's
    last outputs: the tails at step 1) and first [B, H] (a fresh module's previous-module tail, else
    None): row r of the step takes the chain's token at column step - R + r, at position
    base + step - R + 1 + r (or r once the request is past its steps: a pad row, KV to
    `dummy_slot`), the hidden row previous[b, R' - R + r] (first[b] for a fresh step's row 0)."""
    _check_step(seeds, steps, base, page_table, drafts, first, previous, step, rows)
    drafts[:, 0].copy_(seeds)
    active = (steps >= step)[:, None]
    offsets = torch.arange(rows, device=seeds.device)
    pos = torch.where(active, base[:, None] + (step - rows + 1) + offsets, offsets)
    page = page_table.gather(1, pos // page_size)
    slots = torch.where(active, page * page_size + pos % page_size, dummy_slot)
    ids = drafts[:, step - rows : step]
    start = previous.shape[1] - rows
    if first is None:
        hidden = previous[:, start:]
    else:
        hidden = torch.cat([first[:, None], previous[:, start + 1 :]], dim=1)
    batch = seeds.shape[0]
    query_start = torch.arange(batch + 1, device=seeds.device) * rows
    return StepInput(
        ids.flatten(),
        pos.flatten(),
        slots.flatten(),
        pos[:, -1] + 1,
        query_start,
        hidden.flatten(0, 1).contiguous(),  # a strided slice of the tails or outputs
    )


def extend_settle(
    records: torch.Tensor,
    lengths: torch.Tensor,
    limits: torch.Tensor,
    steps_left: torch.Tensor,
    to_logits: torch.Tensor,
    out: torch.Tensor,
    tails: torch.Tensor,
    base: torch.Tensor,
    steps: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loop extend's bookkeeping (see `extend_settle_ref`): tails, base and steps in place;
    returns (the lm_head input of each request's last taken row [B, H'], moved [B] bool). No host
    sync: capturable in a CUDA graph."""
    _check_settle(records, lengths, limits, steps_left, to_logits, out, tails, base, steps)
    batch = records.shape[0]
    selected = torch.empty(batch, to_logits.shape[1], dtype=to_logits.dtype, device=to_logits.device)
    moved = torch.empty(batch, dtype=torch.bool, device=to_logits.device)
    if batch:
        widest = max(out.shape[1], to_logits.shape[1])
        _extend_settle_kernel[(batch,)](
            records,
            lengths,
            limits,
            steps_left,
            to_logits,
            out,
            selected,
            moved.view(torch.uint8),
            tails,
            base,
            steps,
            records.shape[1] - 2,
            out.shape[1],
            to_logits.shape[1],
            records.stride(0),
            to_logits.stride(0),
            out.stride(0),
            tails.stride(0),
            BLOCK_H=min(1024, max(16, triton.next_power_of_2(widest))),
        )
    return selected, moved


def extend_settle_ref(
    records: torch.Tensor,
    lengths: torch.Tensor,
    limits: torch.Tensor,
    steps_left: torch.Tensor,
    to_logits: torch.Tensor,
    out: torch.Tensor,
    tails: torch.Tensor,
    base: torch.Tensor,
    steps: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch. Per request b of records [B, q + 2] (`loop_accept`'s: q argmax tokens, taken,
    drafted), after the head's forward over its q verify rows (out, to_logits [B * q, *]): its last
    taken row is b * q + max(taken - 1, 0); where it took tokens, tails[b] (any row stride) = out at
    that row and base[b] = lengths[b] - 2 (its newest verified position - 1); steps[b] =
    steps_left[b] while lengths[b] < limits[b], else 0. Returns (to_logits at that row [B, H'],
    moved [B]: taken > 0)."""
    _check_settle(records, lengths, limits, steps_left, to_logits, out, tails, base, steps)
    q = records.shape[1] - 2
    taken = records[:, q]
    moved = taken > 0
    rows = torch.arange(records.shape[0], device=records.device) * q + (taken - 1).clamp(min=0)
    selected = to_logits.index_select(0, rows)
    tails.copy_(torch.where(moved[:, None], out.index_select(0, rows).to(tails.dtype), tails))
    base.copy_(torch.where(moved, lengths - 2, base))
    steps.copy_(torch.where(lengths < limits, steps_left, 0))
    return selected, moved


def _int64(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if t.dtype != torch.int64 or tuple(t.shape) != shape or t.device != device:
        raise ValueError(
            f"{name}: expected int64 {list(shape)} on {device}, got {t.dtype} {list(t.shape)} on {t.device}"
        )


def _rows(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
    """A float tensor of `shape` (None: any size there) with unit-stride last dimension."""
    ok = t.dim() == len(shape) and all(s is None or s == n for s, n in zip(shape, t.shape, strict=True))
    if not ok or not t.is_floating_point() or t.stride(-1) != 1 or (dtype is not None and t.dtype != dtype):
        raise ValueError(
            f"{name}: expected a float {list(shape)} tensor with unit-stride rows"
            f"{'' if dtype is None else f' of {dtype}'}, got {t.dtype} {list(t.shape)}"
        )


def _check_step(seeds, steps, base, page_table, drafts, first, previous, step, rows) -> None:
    """Shapes, dtypes and layouts (no value checks: those would sync, and the chain is captured)."""
    batch, device = seeds.shape[0], seeds.device
    if not 1 <= rows <= step:
        raise ValueError(f"step, rows: expected 1 <= rows <= step, got {step}, {rows}")
    for name, t in (("seeds", seeds), ("steps", steps), ("base", base)):
        _int64(name, t, (batch,), device)
    if page_table.dim() != 2 or page_table.shape[0] != batch or page_table.stride(1) != 1:
        raise ValueError(
            f"page_table: expected [{batch}, P] with unit-stride rows, got {list(page_table.shape)}"
        )
    _int64("page_table", page_table, tuple(page_table.shape), device)
    if drafts.dim() != 2 or drafts.shape[0] != batch or drafts.shape[1] <= step:
        raise ValueError(f"drafts: expected [{batch}, > {step}], got {list(drafts.shape)}")
    _int64("drafts", drafts, tuple(drafts.shape), device)
    _rows("previous", previous, (batch, None, None))
    if previous.shape[1] < rows - (first is not None) or previous.device != device:
        raise ValueError(
            f"previous: expected at least {rows} rows a request on {device}, got {list(previous.shape)}"
        )
    if first is not None:
        _rows("first", first, (batch, previous.shape[2]), previous.dtype)


def _check_settle(records, lengths, limits, steps_left, to_logits, out, tails, base, steps) -> None:
    batch, device = records.shape[0], records.device
    if records.dim() != 2 or records.shape[1] < 3 or records.stride(1) != 1:
        raise ValueError(f"records: expected [B, q + 2] with unit-stride rows, got {list(records.shape)}")
    _int64("records", records, tuple(records.shape), device)
    for name, t in (("lengths", lengths), ("limits", limits), ("steps_left", steps_left), ("base", base)):
        _int64(name, t, (batch,), device)
    _int64("steps", steps, (batch,), device)
    rows = batch * (records.shape[1] - 2)
    _rows("to_logits", to_logits, (rows, None))
    _rows("out", out, (rows, None))
    _rows("tails", tails, (batch, out.shape[1]))
