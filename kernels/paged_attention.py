"""Paged attention over the KV cache: varlen prefill, decode and verify in one kernel family.

The cache is one flat slot array per layer, `[slots, kv_heads, head_dim]`, addressed through a
page table (slot = page * page_size + offset; see specserve/engine/kv_cache.py). Request b's
context is entries 0..seq_len-1; its `query_len` new tokens (already written to the cache) are the
last ones. A new token sees the whole prefix, and among the new tokens itself and the earlier ones
(causal) or those its row of `custom_mask` allows (a draft tree).

One program takes one request, a block of its query tokens and one KV head, with the GROUP query
heads that share it packed into the rows of one tile: rows are (token, head) pairs, so each K/V
block is loaded once per KV head group, and a decode step (one token) still fills a tile with its
GROUP heads. Scores and the online softmax are fp32 (exp2 with the scale folded in). The key loop
stops at the request's causal horizon, so no slot past seq_len is ever read.

Split-K (flash decoding): when the batch gives too few programs to fill the GPU — decode and verify
at small batch sizes — each program also takes one of `splits` slices of the keys and writes an
unnormalised partial (acc, running max, running sum), and the last slice of a block to finish (an
atomic ticket) merges them, in the same launch: a second kernel cost 3.8-4.3 us a layer on an H100.
The slice count is a runtime argument, so a context that grows does not compile new kernel variants.
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple, Protocol

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


class PagedLayout(Protocol):
    """Where each request's new tokens and context live (`specserve.attention.backend.AttentionBatch`
    is one). Lengths are read on the device; the two maxima are host-side upper bounds that size
    the grid, never the key loop."""

    query_start: torch.Tensor  # [B + 1] cumulative new-token counts (int32/int64)
    seq_lens: torch.Tensor  # [B] context length, this step's tokens included
    page_table: torch.Tensor  # [B, pages] context page -> cache page
    page_size: int
    max_query_len: int
    max_seq_len: int
    custom_mask: torch.Tensor | None  # [B, >= Q, >= Q] bool among the new tokens; None = causal


# Every per-step integer is left unspecialised: Triton compiles a variant per (== 1, % 16 == 0, other)
# class of each specialised int, and the page-table width and mask strides change from step to step,
# so specialising them meant fresh compiles (a second or more each) deep into serving.
@triton.jit(do_not_specialize=["stride_pt", "stride_mb", "stride_mq", "num_tokens", "num_splits"])
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    counter_ptr,
    query_start_ptr,
    seq_lens_ptr,
    page_table_ptr,
    mask_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_mb,
    stride_mq,
    num_tokens,
    num_heads,
    num_splits,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    CUSTOM_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_Q  # this program's first query token, among the request's
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    q_begin = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_begin
    if first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len  # context entries before this step's tokens

    rows = tl.arange(0, BLOCK_M)
    tok = first + rows // GROUP  # query token of each row, among the request's new tokens
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    t = q_begin + tok  # flat token index
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:  # the interpreter's tl.dot mishandles bf16; fp32 products of bf16 values are exact
        q = q.to(tl.float32)

    # Keys this block may see: up to its last token's causal horizon (a tree may see any new token).
    if CUSTOM_MASK:
        kv_end = seq_len
    else:
        kv_end = prefix + tl.minimum(q_len, first + BLOCK_Q)
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(kv_end, lo + chunk)
    else:
        lo = kv_end * 0
        hi = kv_end

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = page_table_ptr + b * stride_pt
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        page = tl.load(table + j // PAGE_SIZE, mask=j_ok, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + j % PAGE_SIZE  # 64-bit: slot * stride may pass 2^31
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=kv_ok, other=0.0
        )
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if CUSTOM_MASK:
            new = j - prefix  # index among the new tokens (negative: the prefix, always visible)
            allowed = tl.load(
                mask_ptr + b * stride_mb + tok[:, None] * stride_mq + new[None, :],
                mask=row_ok[:, None] & ((new >= 0) & j_ok)[None, :],
                other=0,
            )
            visible = (new < 0)[None, :] | (allowed != 0)
        else:
            visible = j[None, :] <= (prefix + tok)[:, None]
        visible = visible & j_ok[None, :] & row_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Shift by a finite value: while a row has seen nothing, -inf - -inf would be NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - shift)
        p = tl.exp2(s - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=kv_ok, other=0.0
        )
        p = p.to(v.dtype)  # P @ V on the tensor cores in the cache dtype, accumulated in fp32
        if UPCAST:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    out_ok = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        part = (split * num_tokens + t) * num_heads + head  # [splits, tokens, heads] index
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=out_ok)
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        # The last slice of these rows to finish merges them all (no second launch): every thread's
        # stores are issued before the ticket is taken, and the ticket's release/acquire orders them
        # before the last program's reads, which bypass L1 (another layer's merge on this SM may
        # hold stale lines of the same workspace). It hands the counter back at zero.
        tl.debug_barrier()
        counter = (
            counter_ptr
            + (b * tl.num_programs(1) + tl.program_id(1)) * (tl.num_programs(2) // num_splits)
            + kv_head
        )
        ticket = tl.atomic_add(counter, 1, sem="acq_rel")
        if ticket == num_splits - 1:
            rows_of = t * num_heads + head
            acc, l_i = _merge_rows(
                part_o_ptr,
                part_m_ptr,
                part_l_ptr,
                rows_of,
                row_ok,
                d,
                out_ok,
                num_tokens,
                num_heads,
                num_splits,
                HEAD_DIM,
            )
            tl.atomic_xchg(counter, 0)
            _store_rows(out_ptr, t, head, d, stride_ot, stride_oh, acc, l_i, out_ok)
    else:
        _store_rows(out_ptr, t, head, d, stride_ot, stride_oh, acc, l_i, out_ok)


@triton.jit
def _merge_rows(
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    rows_of,
    row_ok,
    d,
    out_ok,
    num_tokens,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
):
    """Every slice's partial of these (token, head) rows, merged: unnormalised acc and its sum."""
    stride_split = num_tokens * num_heads
    m = tl.full(rows_of.shape, float("-inf"), tl.float32)
    for s in range(num_splits):
        m_s = tl.load(
            part_m_ptr + s * stride_split + rows_of, mask=row_ok, other=float("-inf"), cache_modifier=".cg"
        )
        m = tl.maximum(m, m_s)
    shift = tl.where(m == float("-inf"), 0.0, m)
    l_sum = tl.zeros(rows_of.shape, dtype=tl.float32)
    acc = tl.zeros([rows_of.shape[0], d.shape[0]], dtype=tl.float32)
    for s in range(num_splits):
        part = s * stride_split + rows_of
        w = tl.exp2(
            tl.load(part_m_ptr + part, mask=row_ok, other=float("-inf"), cache_modifier=".cg") - shift
        )
        l_sum += w * tl.load(part_l_ptr + part, mask=row_ok, other=0.0, cache_modifier=".cg")
        o = tl.load(
            part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=out_ok, other=0.0, cache_modifier=".cg"
        )
        acc += w[:, None] * o
    return acc, l_sum


@triton.jit
def _store_rows(out_ptr, t, head, d, stride_ot, stride_oh, acc, l_i, out_ok):
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row that sees nothing gives zeros
    tl.store(
        out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=out_ok,
    )


def _sm_count(device: torch.device) -> int:
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class Tiles(NamedTuple):
    rows: int  # BLOCK_M: (token, head) rows per program
    tokens: int  # BLOCK_Q: query tokens per program (rows // group)
    keys: int  # BLOCK_N: keys per loop step
    warps: int


def tiles(max_query_len: int, group: int) -> Tiles:
    """Tile shape for a batch: 16 rows (tl.dot's floor) hold a decode token's GROUP heads, verify
    and short chunks take 32 or 64, long prefills 128 rows on 8 warps."""
    rows = group * max_query_len
    block_m = next(m for m in (16, 32, 64, 128) if rows <= m or m == 128)
    block_m = max(block_m, triton.next_power_of_2(group))
    return Tiles(block_m, block_m // group, 64, 8 if block_m >= 128 else 4)


# At most this many key slices (SPECSERVE_MAX_SPLITS, so a GPU run can time the choice). Graphs fix
# the count for the longest context, so short contexts pay for empty slices and a wider merge: on an
# H100 the batch-1 decode replay took 1.19 ms with 32 slices, 0.99 with 8, 1.01 with 2 or 1.
MAX_SPLITS = int(os.environ.get("SPECSERVE_MAX_SPLITS", "8"))
# At least this many key slices on a GPU (SPECSERVE_MIN_SPLITS), however many programs the batch
# makes: a program walks its keys one tile after another, bound by latency, so even a batch that covers
# the SMs leaves them waiting. On the H200 (thirty-first session, plain decoding in the device loop,
# MT-Bench, 256 tokens) a batch-64 decode took 13.7 us a layer at one slice (192 programs on 132
# SMs) where the isolated replay over one-token contexts took 3.5; three slices made 46.6k tok/s
# against 42.6k; batch 16 already had three (16.9k; six or eight: 16.3k).
MIN_SPLITS = int(os.environ.get("SPECSERVE_MIN_SPLITS", "3"))


def num_splits(
    batch_size: int, max_query_len: int, max_seq_len: int, num_kv_heads: int, group: int, device: torch.device
) -> int:
    """Key slices per program: MIN_SPLITS where each request's query is one tile (decode, verify),
    or where the batch leaves SMs idle enough programs to cover them; each slice still >= 128 keys, at
    most MAX_SPLITS slices. The interpreter: one (splits only when asked for)."""
    if device.type != "cuda":
        return 1
    query_tiles = triton.cdiv(max_query_len, tiles(max_query_len, group).tokens)
    programs = batch_size * query_tiles * num_kv_heads
    floor = MIN_SPLITS if query_tiles == 1 else 1  # decode and verify; a prefill's tiles fill the SMs
    want = max(floor, triton.cdiv(_sm_count(device), programs))
    return max(1, min(want, triton.cdiv(max_seq_len, 128), MAX_SPLITS))


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # smaller buffers a captured graph may still use: never freed


def split_counters(count: int, device: torch.device) -> torch.Tensor:
    """`count` int32 tickets at zero, for the programs that take a split's slices to count their
    finishes. One buffer per device, grown when needed, shared by every launch: each launch hands its
    tickets back at zero, and launches on one stream run one after another. (Grown inside a CUDA-graph
    capture, the zeroing is captured too: that graph zeroes the tickets again as it starts, harmless.)"""
    found = _COUNTERS.get(device)
    if found is None or found.numel() < count:
        if found is not None:
            _OUTGROWN.append(found)
        found = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = found
    return found


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: PagedLayout,
    scale: float | None = None,
    splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [T, H, D] over one layer's cache k/v [slots, KvH, D] for the requests of
    `layout`; returns [T, H, D] in q's dtype (or fills `out`). `scale` defaults to 1/sqrt(D);
    `splits` forces the number of key slices (None: chosen from the batch shape). Rows of tokens
    past query_start[-1] are left unwritten.
    """
    query_start, seq_lens, page_table = layout.query_start, layout.seq_lens, layout.page_table
    max_query_len, custom_mask = layout.max_query_len, layout.custom_mask
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"q: expected [T, H, D] and caches [slots, KvH, D] of one shape, got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != dim or heads % kv_heads:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit a cache of {kv_heads} KV heads of size {k_cache.shape[2]}"
        )
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q/k/v dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    batch = seq_lens.shape[0]
    if query_start.shape != (batch + 1,) or page_table.dim() != 2 or page_table.shape[0] != batch:
        raise ValueError(
            f"query_start {tuple(query_start.shape)} / page_table {tuple(page_table.shape)} do not fit "
            f"{batch} requests"
        )
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last dimension")
    if custom_mask is not None and (
        custom_mask.dim() != 3
        or custom_mask.shape[0] != batch
        or min(custom_mask.shape[1:]) < max_query_len
        or custom_mask.dtype != torch.bool
    ):
        raise ValueError(
            f"custom_mask: expected bool [{batch}, {max_query_len}, {max_query_len}], got "
            f"{custom_mask.dtype} {tuple(custom_mask.shape)}"
        )
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out: expected {q.dtype} {tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}")
    if tokens == 0 or batch == 0 or max_query_len == 0:
        return out

    group = heads // kv_heads
    tile = tiles(max_query_len, group)
    if splits is None:
        splits = num_splits(batch, max_query_len, layout.max_seq_len, kv_heads, group, q.device)
    scale_log2 = (scale if scale is not None else 1.0 / math.sqrt(dim)) * LOG2E
    if custom_mask is not None:
        mask = custom_mask.view(torch.uint8)  # same bytes; a bool pointer is awkward in Triton
        if mask.stride(2) != 1:
            mask = mask.contiguous()
        mask_strides = (mask.stride(0), mask.stride(1))
    else:
        mask, mask_strides = seq_lens, (0, 0)  # never read
    grid = (batch, triton.cdiv(max_query_len, tile.tokens), kv_heads * splits)
    if splits > 1:
        part_o = torch.empty((splits, tokens, heads, dim), dtype=torch.float32, device=q.device)
        part_m = torch.empty((splits, tokens, heads), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        counters = split_counters(grid[0] * grid[1] * kv_heads, q.device)
    else:
        part_o = part_m = part_l = counters = out  # never touched
    block_d = max(16, triton.next_power_of_2(dim))
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        part_o,
        part_m,
        part_l,
        counters,
        query_start,
        seq_lens,
        page_table,
        mask,
        scale_log2,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        *mask_strides,
        tokens,
        heads,
        splits,
        PAGE_SIZE=layout.page_size,
        GROUP=group,
        HEAD_DIM=dim,
        BLOCK_D=block_d,
        BLOCK_M=tile.rows,
        BLOCK_Q=tile.tokens,
        BLOCK_N=tile.keys,
        SPLIT=splits > 1,
        CUSTOM_MASK=custom_mask is not None,
        PRECISION="ieee" if q.dtype == torch.float32 or q.device.type != "cuda" else "tf32",
        UPCAST=q.device.type != "cuda",
        num_warps=tile.warps,
    )
    return out


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: PagedLayout,
    scale: float | None = None,
    splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch, one request at a time: gather its context, mask, softmax in fp32 (fp64 stays fp64).

    Same arguments as `paged_attention` (`splits` is ignored); rows past query_start[-1] are zeros."""
    page_table, page_size, custom_mask = layout.page_table, layout.page_size, layout.custom_mask
    tokens, heads, dim = q.shape
    group = heads // k_cache.shape[1]
    scale = scale if scale is not None else 1.0 / math.sqrt(dim)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    result = torch.zeros(q.shape, dtype=compute, device=q.device)
    starts, lens = layout.query_start.tolist(), layout.seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        begin, end = starts[b], starts[b + 1]
        q_len = end - begin
        if q_len == 0:
            continue
        prefix = seq_len - q_len
        index = torch.arange(seq_len, device=q.device)
        slots = page_table[b, index // page_size] * page_size + index % page_size
        keys = k_cache[slots].to(compute).repeat_interleave(group, dim=1)  # [S, H, D]
        values = v_cache[slots].to(compute).repeat_interleave(group, dim=1)
        rows = torch.arange(q_len, device=q.device)
        if custom_mask is None:
            among_new = rows[None, :] <= rows[:, None]
        else:
            among_new = custom_mask[b, :q_len, :q_len]
        visible = torch.cat([torch.ones(q_len, prefix, dtype=torch.bool, device=q.device), among_new], dim=1)
        scores = torch.einsum("thd,shd->hts", q[begin:end].to(compute), keys) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing gives zeros
        result[begin:end] = torch.einsum("hts,shd->thd", weights, values)
    result = result.to(q.dtype)
    if out is not None:
        out.copy_(result)
        return out
    return result
