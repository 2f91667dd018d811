"""Each row's top k logits, their ids and the row's log-sum-exp, in two launches (logprobs, draft trees).

`torch.topk` over a 49k-entry vocabulary is a radix select of four kernels or more, and a
log-softmax or log-sum-exp beside it one more pass: at batch 1 a head's tree search spent ~220 of
its ~900 µs there (docs/benchmarks.md, twenty-ninth session), and a logprob request's records in
the device loop some of their ten launches an iteration. Here each row's vocabulary is cut into
slices, one program each: an online max and sum of exponentials over the slice, then k passes that
each take the slice's next entry in (value descending, id ascending) order. A second launch per
row merges the slices' sums into the log-sum-exp and their candidates into the row's top k, in the
same order. So ties go to the lower id, where `torch.topk` leaves their order open.

Callers subtract the log-sum-exp from the values for logprobs (each column its logit less the row's
log-sum-exp: `specserve/engine/logprobs.py`). The torch reference takes `torch.topk` and
`torch.logsumexp`; on rows without ties at the k-th value they agree to the id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve_kernels import use_triton
from specserve_kernels.argmax import logit_rows

# Vocabulary entries a first-launch program reads, in blocks of BLOCK.
SLICE = 4096
BLOCK = 1024
MAX_K = 32  # larger k: the torch reference


@triton.jit
def _next_after(x, ids, valid, prev_v, prev_i, none):
    """Among the `valid` entries (values `x`, ids `ids`), the first after (prev_v, prev_i) in
    (value descending, id ascending) order: its value and id (id `none` where there is none)."""
    after = valid & ((x < prev_v) | ((x == prev_v) & (ids > prev_i)))
    best_v = tl.max(tl.where(after, x, float("-inf")), axis=0)
    best_i = tl.min(tl.where(after & (x == best_v), ids, none), axis=0)
    return best_v, best_i


@triton.jit
def _slice_top_kernel(
    logits_ptr,
    m_ptr,
    s_ptr,
    val_ptr,
    idx_ptr,
    vocab,
    stride,
    slices,
    slice_len,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (row, slice): the slice's max and sum of exp(x - max), and its top K (value, id)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    first = part * slice_len
    end = tl.minimum(first + slice_len, vocab)
    base = logits_ptr + row * stride
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for start in range(first, end, BLOCK):
        ids = start + tl.arange(0, BLOCK).to(tl.int64)
        x = tl.load(base + ids, mask=ids < end, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a slice of -inf so far: no NaN
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = m_new
    out = row * slices + part
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, s)
    prev_v = tl.full((), float("inf"), tl.float32)
    prev_i = tl.full((), -1, tl.int64)
    for j in tl.static_range(K):
        best_v = tl.full((), float("-inf"), tl.float32)
        best_i = tl.full((), -1, tl.int64)
        for start in range(first, end, BLOCK):
            ids = start + tl.arange(0, BLOCK).to(tl.int64)
            x = tl.load(base + ids, mask=ids < end, other=float("-inf")).to(tl.float32)
            block_v, block_i = _next_after(x, ids, ids < end, prev_v, prev_i, vocab)
            better = (block_i < vocab) & ((best_i < 0) | (block_v > best_v))
            best_v = tl.where(better, block_v, best_v)
            best_i = tl.where(better, block_i, best_i)
        tl.store(val_ptr + out * K + j, best_v)
        tl.store(idx_ptr + out * K + j, best_i)
        prev_v, prev_i = best_v, best_i


@triton.jit
def _merge_kernel(
    m_ptr,
    s_ptr,
    val_ptr,
    idx_ptr,
    lse_ptr,
    top_ptr,
    ids_ptr,
    slices,
    vocab,
    k,
    K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Per row: the log-sum-exp over its slices, and its top k among the slices' candidates."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    n = slices * K
    inside = c < n
    s_ok = c < slices
    m = tl.load(m_ptr + row * slices + c, mask=s_ok, other=float("-inf"))
    s = tl.load(s_ptr + row * slices + c, mask=s_ok, other=0.0)
    top = tl.max(m, axis=0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.where(s_ok, s * tl.exp(m - shift), 0.0), axis=0)
    tl.store(lse_ptr + row, shift + tl.log(total))
    v = tl.load(val_ptr + row * n + c, mask=inside, other=float("-inf"))
    i = tl.load(idx_ptr + row * n + c, mask=inside, other=-1)
    valid = inside & (i >= 0)
    prev_v = tl.full((), float("inf"), tl.float32)
    prev_i = tl.full((), -1, tl.int64)
    for j in tl.static_range(K):
        best_v, best_i = _next_after(v, i, valid, prev_v, prev_i, vocab)
        tl.store(top_ptr + row * k + j, best_v, mask=j < k)
        tl.store(ids_ptr + row * k + j, best_i, mask=j < k)
        prev_v, prev_i = best_v, best_i


def top_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of `logits` [R, V] (fp32 or lower): its log-sum-exp [R] (fp32), its k
    largest logits [R, k] (fp32, descending, ties to the lower id) and their ids [R, k] (int64).
    k <= min(V, MAX_K). No host sync."""
    logits = logit_rows(logits)
    rows, vocab = _check(logits, k)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    top = torch.empty(rows, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(rows, k, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return lse, top, ids
    K = max(1, triton.next_power_of_2(k))
    slices = triton.cdiv(vocab, SLICE)
    slice_len = triton.cdiv(triton.cdiv(vocab, slices), BLOCK) * BLOCK
    slices = triton.cdiv(vocab, slice_len)
    m = torch.empty(rows * slices, dtype=torch.float32, device=logits.device)
    s = torch.empty_like(m)
    val = torch.empty(rows * slices * K, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows * slices * K, dtype=torch.int64, device=logits.device)
    _slice_top_kernel[(rows, slices)](
        logits, m, s, val, idx, vocab, logits.stride(0), slices, slice_len, K=K, BLOCK=BLOCK, num_warps=4
    )
    block_c = max(16, triton.next_power_of_2(slices * K))
    _merge_kernel[(rows,)](m, s, val, idx, lse, top, ids, slices, vocab, k, K=K, BLOCK_C=block_c, num_warps=4)
    return lse, top, ids


def top_logits_ref(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch: `torch.logsumexp`, and `torch.topk` of the fp32 logits (the order of ties open;
    any k up to V, 0 included)."""
    x = logits.float()
    top, ids = x.topk(k, dim=-1)
    return torch.logsumexp(x, dim=-1), top, ids


def _check(logits: torch.Tensor, k: int) -> tuple[int, int]:
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [R, V], got {tuple(logits.shape)}")
    if not 0 < k <= min(logits.shape[1], MAX_K):
        raise ValueError(f"k: expected 1..{min(logits.shape[1], MAX_K)}, got {k}")
    return logits.shape[0], logits.shape[1]


def row_top_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`top_logits` where the engine runs kernels (`use_triton`) and k fits it, else the reference:
    what the logprob records and the draft trees call, so every path of one device agrees."""
    if 0 < k <= min(MAX_K, logits.shape[-1]) and use_triton(logits.device):
        return top_logits(logits, k)
    return top_logits_ref(logits, k)
