"""The argmax of each row of logits, spread over the GPU: a split argmax (greedy drafts, greedy verifies).

`draft_top1` sweeps a row's vocabulary in one program, for the top-1 token and its probability
(what sampling drafts need). A greedy chain needs only the token, and one program per row leaves a
batch-1 draft step's 49k-entry sweep on one SM: 32 us of a ~130 us head step on an H100 (torch's
argmax over a verify's few rows: 12 us). Here each
row's vocabulary is cut into chunks, one program each (the chunk's max and its first index), and a
second launch picks, per row, the first chunk holding the row's max. Ties go to the lowest token id,
as `torch.argmax`; NaN-free rows assumed (draft logits are finite or -inf).

A head's greedy chain wants the draft mapped to target ids and stored in place (a column of its
drafts buffer; the loop extend's seeds, kept where a request took nothing): the second launch can
do that too (`out`, `table`, `keep`), so the map, the select and the copy cost no launches of their own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Vocabulary entries a first-launch program reads (49k-entry rows: 48 programs a row).
CHUNK = 1024


@triton.jit
def _chunk_max_kernel(logits_ptr, max_ptr, arg_ptr, vocab, stride, chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    tl.store(max_ptr + row * chunks + chunk, tl.max(x, axis=0))
    arg = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64) + chunk * BLOCK
    tl.store(arg_ptr + row * chunks + chunk, arg)


@triton.jit
def _pick_chunk_kernel(
    max_ptr,
    arg_ptr,
    out_ptr,
    table_ptr,
    keep_ptr,
    chunks,
    out_stride,
    BLOCK_C: tl.constexpr,
    HAS_TABLE: tl.constexpr,
    HAS_KEEP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    ok = c < chunks
    best = tl.load(max_ptr + row * chunks + c, mask=ok, other=float("-inf"))
    arg = tl.load(arg_ptr + row * chunks + c, mask=ok, other=0)
    top = tl.max(best, axis=0)
    # Chunks are in vocabulary order: the first holding the max holds its lowest index.
    first = tl.min(tl.where(ok & (best == top), c, BLOCK_C), axis=0)
    index = tl.sum(tl.where(c == first, arg, 0), axis=0)
    if HAS_TABLE:
        index = tl.load(table_ptr + index)
    if HAS_KEEP:
        tl.store(out_ptr + row * out_stride, index, mask=tl.load(keep_ptr + row) != 0)
    else:
        tl.store(out_ptr + row * out_stride, index)


def logit_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits` checked to be [B, V] with V > 0, with unit-stride rows (a copy only where needed)."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits: expected a non-empty [B, V] tensor, got shape {tuple(logits.shape)}")
    return logits if logits.stride(1) == 1 else logits.contiguous()


def row_argmax(
    logits: torch.Tensor,
    chunk: int = CHUNK,
    *,
    out: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, V] logits (any float dtype) → the argmax of each row [B] int64 (ties: lowest id), mapped
    through `table` [V] int64 when given; written to `out` [B] int64 (any stride) when given, only
    at rows where `keep` [B] bool is set (see `row_argmax_ref`). Returns `out`, or a new tensor."""
    logits = logit_rows(logits)
    rows, vocab = logits.shape
    _check_out(rows, logits.device, out, table, keep)
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        chunks = triton.cdiv(vocab, chunk)
        best = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
        arg = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
        _chunk_max_kernel[(rows, chunks)](logits, best, arg, vocab, logits.stride(0), chunks, BLOCK=chunk)
        block_c = max(2, triton.next_power_of_2(chunks))
        _pick_chunk_kernel[(rows,)](
            best,
            arg,
            out,
            out if table is None else table,
            out if keep is None else keep.view(torch.uint8),
            chunks,
            out.stride(0),
            BLOCK_C=block_c,
            HAS_TABLE=table is not None,
            HAS_KEEP=keep is not None,
            num_warps=1,
        )
    return out


def row_argmax_ref(
    logits: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch: argmax of each row, then `table[ids]`; into `out` where `keep` (else kept)."""
    _check_out(logits.shape[0], logits.device, out, table, keep)
    ids = logits.argmax(dim=-1)
    if table is not None:
        ids = table[ids]
    if out is None:
        return ids
    out.copy_(ids if keep is None else torch.where(keep, ids, out))
    return out


def _check_out(
    rows: int,
    device: torch.device,
    out: torch.Tensor | None,
    table: torch.Tensor | None,
    keep: torch.Tensor | None,
) -> None:
    for name, t, dtype in (
        ("out", out, torch.int64),
        ("table", table, torch.int64),
        ("keep", keep, torch.bool),
    ):
        if t is not None and (t.dim() != 1 or t.dtype != dtype or t.device != device):
            raise ValueError(
                f"{name}: expected a 1-d {dtype} tensor on {device}, got {t.dtype} {list(t.shape)}"
            )
    for name, t in (("out", out), ("keep", keep)):
        if t is not None and t.shape[0] != rows:
            raise ValueError(f"{name}: expected {rows} entries (one a row), got {t.shape[0]}")
    if keep is not None and out is None:
        raise ValueError("keep: needs `out` (the values kept where it is unset)")
