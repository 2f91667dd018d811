"""The device loop's glue around each verify forward: n-gram lookup + verify input, and greedy accept.

`specserve/engine/device_loop.py` runs greedy n-gram speculative steps back to back on the device.
Around each step's forward sit two pieces of bookkeeping per request: before it, the n-gram lookup
over the request's token history and the verify bucket's static inputs (ids, positions, KV slots,
seq lens); after it, the greedy accept test, the cut at a length limit or stop id, the append into
the history and the step's record. In torch these are ~270 launches of tiny ops (188 us of GPU time
a step at batch 1 on an H100, against a ~900 us forward); here they are two launches of one program
per request each:

- `loop_prepare`: the lookup of `NgramDrafter._propose` (the latest of the longest match of the
  sequence's suffix, of length min(max_match, len - 1) at most and min_match at least; the draft is
  what followed it, cut at the sequence's end), the row's history scanned in blocks with a running
  best (length * W + position), then the row's verify input written in place;
- `loop_accept`: after the forward's argmax (left to torch), the leading drafts equal to it, the
  taken count capped by the request's limit and cut after its first stop id, the append, the
  record [argmax row, taken, drafted], and the new length (limit 0 once stopped).

With k = 0 drafts the same two launches run plain greedy decoding (no lookup; the input is each
request's last token, the accept takes its argmax), the loop of engines without speculation.

The references are the torch code the loop ran before (`ngram_chain_drafts`: the lookup over whole
[B, W] rows at once, which `tests/test_ngram_device.py` checks against `NgramDrafter.propose` draft
for draft); the kernels equal them bit for bit on every output, including the draft ids of invalid
draft slots (whatever the row holds where the lookup points), which the forward reads but nothing
accepts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Positions of a history row one scan block covers (a power of 2; rows shorter than this take the
# smallest power of 2 covering the history's width).
SCAN_BLOCK = 1024


@triton.jit
def _ngram_row(
    row,
    last,
    width,
    j,
    in_query,
    MIN_MATCH: tl.constexpr,
    MAX_MATCH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row's lookup: its query row's tokens (the last token, then the draft) and which drafts
    are real."""
    token = tl.load(row + last)
    # Candidate ends p < last holding the last token; a match extends while position p - i repeats
    # the sequence's i-th token from the end. p - i < 0 reads as -1, which no token equals: with
    # p < len - 1 that caps a match at len - 1 tokens, and the static range at max_match.
    best = tl.full((), -1, tl.int64)
    offs = tl.arange(0, BLOCK)
    for start in range(0, last, BLOCK):
        pos = start + offs
        alive = pos < last
        alive = alive & (tl.load(row + pos, mask=alive, other=-1) == token)
        count = alive.to(tl.int64)
        for i in tl.static_range(1, MAX_MATCH):
            suffix = tl.load(row + tl.maximum(last - i, 0))
            ok = alive & (pos >= i)
            earlier = tl.load(row + pos - i, mask=ok, other=-1)
            alive = alive & (earlier == suffix)
            count += alive.to(tl.int64)
        # The latest of the longest: length first, position breaking ties.
        score = tl.where(count >= MIN_MATCH, count * width + pos, -1)
        best = tl.maximum(best, tl.max(score, axis=0))
    # No match: the lookup points at the row's last column (torch.remainder(-1, W)).
    end = tl.where(best >= 0, best % width, width - 1)
    # Query row j (>= 1) holds draft j - 1, the token at end + j; row 0 the sequence's last token.
    at = tl.where(j == 0, last, tl.minimum(end + j, width - 1))
    tok = tl.load(row + at, mask=in_query, other=0)
    # (A scalar condition goes through tl.where: the interpreter mistypes scalar & block as int32.)
    valid = tl.where(best >= 0, end + j <= last, False)
    return tok, valid


@triton.jit
def _loop_prepare_kernel(
    hist_ptr,
    lengths_ptr,
    limits_ptr,
    table_ptr,
    ids_ptr,
    positions_ptr,
    slots_ptr,
    seq_lens_ptr,
    drafts_ptr,
    valid_ptr,
    given_ptr,
    hist_stride,
    table_stride,
    width,
    NUM_STEPS: tl.constexpr,
    MIN_MATCH: tl.constexpr,
    MAX_MATCH: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    LOOKUP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row = hist_ptr + b * hist_stride
    length = tl.load(lengths_ptr + b)
    limit = tl.load(limits_ptr + b)
    last = length - 1
    j = tl.arange(0, BLOCK_Q)
    in_query = j < NUM_STEPS + 1
    is_draft = (j >= 1) & in_query
    if LOOKUP:
        tok, valid = _ngram_row(row, last, width, j, in_query, MIN_MATCH, MAX_MATCH, BLOCK)
    else:  # a drafter's chain, given: every draft is real
        given = tl.load(given_ptr + b * NUM_STEPS + j - 1, mask=is_draft, other=0)
        tok = tl.where(j == 0, tl.load(row + last), given)
        valid = is_draft
    tl.store(drafts_ptr + b * NUM_STEPS + j - 1, tok, mask=is_draft)
    tl.store(valid_ptr + b * NUM_STEPS + j - 1, valid.to(tl.uint8), mask=is_draft)
    # Active rows verify at len - 1 ... len - 1 + k over their pages; inactive ones (done, pads) at
    # 0 ... k over the dummy slot 0.
    active = length < limit
    first = tl.where(active, last, 0)
    pos = first + j
    page = tl.load(
        table_ptr + b * table_stride + pos // PAGE_SIZE, mask=tl.where(active, in_query, False), other=0
    )
    slot = tl.where(active, page * PAGE_SIZE + pos % PAGE_SIZE, 0)
    out = b * (NUM_STEPS + 1) + j
    tl.store(ids_ptr + out, tok, mask=in_query)
    tl.store(positions_ptr + out, pos, mask=in_query)
    tl.store(slots_ptr + out, slot, mask=in_query)
    tl.store(seq_lens_ptr + b, first + NUM_STEPS + 1)


@triton.jit
def _loop_accept_kernel(
    target_ptr,
    drafts_ptr,
    valid_ptr,
    hist_ptr,
    lengths_ptr,
    limits_ptr,
    stops_ptr,
    records_ptr,
    hist_stride,
    stops_stride,
    NUM_STEPS: tl.constexpr,
    NUM_STOPS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    query = NUM_STEPS + 1
    j = tl.arange(0, BLOCK_Q)
    in_query = j < query
    is_draft = j < NUM_STEPS
    target = tl.load(target_ptr + b * query + j, mask=in_query, other=-2)
    draft = tl.load(drafts_ptr + b * NUM_STEPS + j, mask=is_draft, other=-3)
    valid = tl.load(valid_ptr + b * NUM_STEPS + j, mask=is_draft, other=0) != 0
    length = tl.load(lengths_ptr + b)
    limit = tl.load(limits_ptr + b)
    # Accepted: the leading drafts equal to their row's argmax (invalid ones count as misses).
    miss = is_draft & ((draft != target) | (valid == 0))
    accepted = tl.min(tl.where(miss, j, NUM_STEPS), axis=0).to(tl.int64)
    room = tl.maximum(limit - length, 0)
    taken = tl.minimum(accepted + 1, room)
    # Cut after the first stop id among the taken tokens (stops are -1 padded; no argmax is < 0).
    s = tl.arange(0, BLOCK_S)
    stops = tl.load(stops_ptr + b * stops_stride + s, mask=s < NUM_STOPS, other=-1)
    is_stop = tl.max((target[:, None] == stops[None, :]).to(tl.int32), axis=1) > 0
    hit = is_stop & (j < taken)
    first_hit = tl.min(tl.where(hit, j, BLOCK_Q), axis=0).to(tl.int64)
    stopped = first_hit < BLOCK_Q
    taken = tl.where(stopped, first_hit + 1, taken)
    tl.store(hist_ptr + b * hist_stride + length + j, target, mask=j < taken)
    drafted = tl.minimum(tl.sum(valid.to(tl.int64), axis=0), tl.maximum(room - 1, 0))
    drafted = tl.where(room > 0, drafted, 0)
    record = records_ptr + b * (query + 2)
    tl.store(record + j, target, mask=in_query)
    tl.store(record + query, taken)
    tl.store(record + query + 1, drafted)
    tl.store(lengths_ptr + b, length + taken)
    tl.store(limits_ptr + b, tl.where(stopped, 0, limit))


def loop_prepare(
    hist: torch.Tensor,
    lengths: torch.Tensor,
    limits: torch.Tensor,
    page_table: torch.Tensor,
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_steps: int,
    min_match: int,
    max_match: int,
    page_size: int,
    given: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request b (rows of hist [B, W] int64, its tokens in the first lengths[b] >= 1 entries):
    the n-gram chain drafts (drafts [B, k] int64, valid [B, k] bool, as `ngram_chain_drafts`), or
    the `given` drafts [B, k] of another drafter (all valid, no lookup), and in place the verify
    input: ids, positions, slots ([B * (k + 1)]) and seq_lens [B] (see `loop_prepare_ref`). No host
    sync: capturable in a CUDA graph."""
    _check_prepare(hist, lengths, limits, page_table, ids, positions, slots, seq_lens, num_steps, max_match)
    _check_given(given, hist.shape[0], num_steps, hist.device)
    batch, width = hist.shape
    drafts, valid = _draft_buffers(batch, num_steps, hist.device)
    if batch:
        _loop_prepare_kernel[(batch,)](
            hist,
            lengths,
            limits,
            page_table,
            ids,
            positions,
            slots,
            seq_lens,
            drafts,
            valid.view(torch.uint8),
            drafts if given is None else given,
            hist.stride(0),
            page_table.stride(0),
            width,
            NUM_STEPS=num_steps,
            MIN_MATCH=min_match,
            MAX_MATCH=max_match,
            PAGE_SIZE=page_size,
            BLOCK=min(SCAN_BLOCK, max(16, triton.next_power_of_2(width))),
            BLOCK_Q=max(2, triton.next_power_of_2(num_steps + 1)),
            LOOKUP=given is None and num_steps > 0,
        )
    return drafts, valid


def loop_accept(
    target: torch.Tensor,
    drafts: torch.Tensor,
    valid: torch.Tensor,
    hist: torch.Tensor,
    lengths: torch.Tensor,
    limits: torch.Tensor,
    stops: torch.Tensor,
    records: torch.Tensor,
) -> None:
    """In place, per request: greedy chain acceptance of target [B, k + 1] (the verify rows' argmax)
    against drafts/valid, the append into hist, records [B, k + 3], lengths and limits (see
    `loop_accept_ref`). No host sync: capturable in a CUDA graph."""
    _check_accept(target, drafts, valid, hist, lengths, limits, stops, records)
    batch, query = target.shape
    if batch:
        _loop_accept_kernel[(batch,)](
            target,
            drafts,
            valid.view(torch.uint8),
            hist,
            lengths,
            limits,
            stops,
            records,
            hist.stride(0),
            stops.stride(0),
            NUM_STEPS=query - 1,
            NUM_STOPS=stops.shape[1],
            BLOCK_Q=max(2, triton.next_power_of_2(query)),
            BLOCK_S=max(2, triton.next_power_of_2(stops.shape[1])),
            num_warps=1,  # a few dozen values a row: one warp's shuffles reduce them
        )


def ngram_chain_drafts(
    hist: torch.Tensor, lengths: torch.Tensor, num_steps: int, min_match: int, max_match: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """hist [B, W] int64 (row b's tokens in its first lengths[b] entries, lengths >= 1, anything past
    them); returns (drafts [B, num_steps], valid [B, num_steps]): valid marks the draft tokens
    `NgramDrafter.propose(tokens, num_steps)` returns, a prefix of each row (none without a match).

    The lookup of `NgramDrafter._propose`: among earlier positions p (p < len - 1) holding the
    sequence's last token, the match length is how many of the sequence's last tokens the tokens up
    to p repeat (at most `max_match`, and at most len - 1); the latest of the longest wins if it
    reaches `min_match`, and the draft is what followed it, cut at the sequence's end. Every row is
    compared at once, `max_match` shifted equality tests of [B, W] int64s: no data-dependent shapes.
    """
    batch, width = hist.shape
    pos = torch.arange(width, device=hist.device)
    last = (lengths - 1).unsqueeze(1)  # [B, 1] index of the last token
    # Candidate ends: earlier positions holding the last token; each starts a match of length 1.
    alive = (hist == hist.gather(1, last)) & (pos < last)
    length = alive.to(torch.int64)
    top = torch.clamp(last, max=max_match)  # the host caps a match at min(max_match, len - 1)
    for i in range(1, max_match):
        # Position p - i against the sequence's i-th token from the end, while the match lasts.
        suffix = hist.gather(1, (last - i).clamp(min=0))
        shifted = torch.nn.functional.pad(hist[:, : width - i], (i, 0), value=-1)
        alive = alive & (shifted == suffix) & (i < top)
        length += alive
    # The latest of the longest: length first, position breaking ties.
    score = torch.where(length >= min_match, length * width + pos, -1)
    best = score.max(dim=1).values
    end = torch.remainder(best, width).unsqueeze(1)
    ahead = end + 1 + torch.arange(num_steps, device=hist.device)
    valid = (best >= 0).unsqueeze(1) & (ahead <= last)
    drafts = hist.gather(1, ahead.clamp(max=width - 1))
    return drafts, valid


def loop_prepare_ref(
    hist: torch.Tensor,
    lengths: torch.Tensor,
    limits: torch.Tensor,
    page_table: torch.Tensor,
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_steps: int,
    min_match: int,
    max_match: int,
    page_size: int,
    given: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch. The verify input: request b's query row is its last token and its k drafts (the
    n-gram lookup's, or `given`, all valid), at
    positions len - 1 ... len - 1 + k over the slots of its page table (active rows: len < limit),
    or at 0 ... k over the dummy slot 0 (inactive rows: done, or pads); seq_lens its first position
    + k + 1."""
    _check_prepare(hist, lengths, limits, page_table, ids, positions, slots, seq_lens, num_steps, max_match)
    _check_given(given, hist.shape[0], num_steps, hist.device)
    query = num_steps + 1
    if num_steps == 0:  # plain decoding: nothing to look up
        drafts, valid = _draft_buffers(hist.shape[0], 0, hist.device)
    elif given is None:
        drafts, valid = ngram_chain_drafts(hist, lengths, num_steps, min_match, max_match)
    else:
        drafts, valid = given.clone(), torch.ones_like(given, dtype=torch.bool)
    active = lengths < limits
    start = torch.where(active, lengths - 1, 0).unsqueeze(1)
    steps = torch.arange(query, device=hist.device)
    pos = start + steps
    last = hist.gather(1, (lengths - 1).unsqueeze(1))
    ids.view(-1, query).copy_(torch.cat([last, drafts], dim=1))
    positions.view(-1, query).copy_(pos)
    slot = page_table.gather(1, pos // page_size) * page_size + pos % page_size
    slots.view(-1, query).copy_(torch.where(active.unsqueeze(1), slot, 0))
    seq_lens.copy_(start.squeeze(1) + query)
    return drafts, valid


def loop_accept_ref(
    target: torch.Tensor,
    drafts: torch.Tensor,
    valid: torch.Tensor,
    hist: torch.Tensor,
    lengths: torch.Tensor,
    limits: torch.Tensor,
    stops: torch.Tensor,
    records: torch.Tensor,
) -> None:
    """Plain torch. Greedy chain acceptance of every row: the leading valid drafts equal to their
    row's argmax, plus the argmax of the first rejected row, at most limits[b] - lengths[b] tokens
    and cut after the first stop id (stops [B, S], -1 padded; the row then turns inactive: limit 0);
    the taken tokens appended to hist at lengths[b]; records [B, k + 3] = [argmax row, taken,
    drafts verified (those inside the room before the limit)]."""
    _check_accept(target, drafts, valid, hist, lengths, limits, stops, records)
    query = target.shape[1]
    steps = torch.arange(query, device=target.device)
    match = (drafts == target[:, : query - 1]) & valid
    taken = torch.cumprod(match.to(torch.int64), dim=1).sum(dim=1) + 1
    room = (limits - lengths).clamp(min=0)
    taken = torch.minimum(taken, room)
    within = steps.unsqueeze(0) < taken.unsqueeze(1)
    hit = (target.unsqueeze(2) == stops.unsqueeze(1)).any(dim=2) & within
    stopped = hit.any(dim=1)
    taken = torch.where(stopped, hit.to(torch.int64).argmax(dim=1) + 1, taken)
    within = steps.unsqueeze(0) < taken.unsqueeze(1)
    index = lengths.unsqueeze(1) + steps
    hist.scatter_(1, index, torch.where(within, target, hist.gather(1, index)))
    drafted = torch.minimum(valid.sum(dim=1), (room - 1).clamp(min=0))
    records.copy_(
        torch.cat([target, taken.unsqueeze(1), torch.where(room > 0, drafted, 0).unsqueeze(1)], dim=1)
    )
    lengths.add_(taken)
    limits.copy_(torch.where(stopped, 0, limits))


def _draft_buffers(batch: int, num_steps: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty drafts [B, k] int64 and valid [B, k] bool; with k = 0 (plain decoding) views of one
    column, so that the kernels' (fully masked) draft pointers are real allocations."""
    width = max(num_steps, 1)
    drafts = torch.empty(batch, width, dtype=torch.int64, device=device)[:, :num_steps]
    valid = torch.empty(batch, width, dtype=torch.bool, device=device)[:, :num_steps]
    return drafts, valid


def _int64(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if t.dtype != torch.int64 or tuple(t.shape) != shape or t.device != device:
        raise ValueError(
            f"{name}: expected int64 {list(shape)} on {device}, got {t.dtype} {list(t.shape)} on {t.device}"
        )


def _check_prepare(
    hist, lengths, limits, page_table, ids, positions, slots, seq_lens, num_steps, max_match
) -> None:
    """Shapes, dtypes and layouts (no value checks: those would sync, and the loop is captured)."""
    if hist.dim() != 2 or hist.stride(1) != 1:
        raise ValueError(f"hist: expected a [B, W] tensor with unit-stride rows, got {list(hist.shape)}")
    if num_steps < 0 or max_match < 1:
        raise ValueError(f"num_steps, max_match: expected >= 0 and >= 1, got {num_steps}, {max_match}")
    batch, device = hist.shape[0], hist.device
    _int64("hist", hist, tuple(hist.shape), device)
    for name, t in (("lengths", lengths), ("limits", limits), ("seq_lens", seq_lens)):
        _int64(name, t, (batch,), device)
    for name, t in (("ids", ids), ("positions", positions), ("slots", slots)):
        _int64(name, t, (batch * (num_steps + 1),), device)
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor (written in place)")
    if page_table.dim() != 2 or page_table.shape[0] != batch or page_table.stride(1) != 1:
        raise ValueError(
            f"page_table: expected [{batch}, P] with unit-stride rows, got {list(page_table.shape)}"
        )
    _int64("page_table", page_table, tuple(page_table.shape), device)


def _check_given(given: torch.Tensor | None, batch: int, num_steps: int, device: torch.device) -> None:
    if given is not None:
        _int64("given", given, (batch, num_steps), device)
        if not given.is_contiguous():
            raise ValueError("given: expected a contiguous tensor")


def _check_accept(target, drafts, valid, hist, lengths, limits, stops, records) -> None:
    if target.dim() != 2 or target.shape[1] < 1 or not target.is_contiguous():
        raise ValueError(
            f"target: expected a contiguous [B, k + 1] tensor (k >= 0), got {list(target.shape)}"
        )
    batch, query = target.shape
    device = target.device
    _int64("target", target, (batch, query), device)
    _int64("drafts", drafts, (batch, query - 1), device)
    if valid.dtype != torch.bool or tuple(valid.shape) != (batch, query - 1) or valid.device != device:
        raise ValueError(
            f"valid: expected bool [{batch}, {query - 1}], got {valid.dtype} {list(valid.shape)}"
        )
    if not (drafts.is_contiguous() and valid.is_contiguous() and records.is_contiguous()):
        raise ValueError("drafts, valid, records: expected contiguous tensors")
    if hist.dim() != 2 or hist.shape[0] != batch or hist.stride(1) != 1 or hist.shape[1] < query:
        raise ValueError(
            f"hist: expected [{batch}, W >= {query}] with unit-stride rows, got {list(hist.shape)}"
        )
    _int64("hist", hist, tuple(hist.shape), device)
    for name, t in (("lengths", lengths), ("limits", limits)):
        _int64(name, t, (batch,), device)
    if stops.dim() != 2 or stops.shape[0] != batch or stops.shape[1] < 1 or stops.stride(1) != 1:
        raise ValueError(f"stops: expected [{batch}, S >= 1] with unit-stride rows, got {list(stops.shape)}")
    _int64("stops", stops, tuple(stops.shape), device)
    _int64("records", records, (batch, query + 2), device)
