"""A decoder's linear layers with their neighbours fused in: RMSNorm before, SwiGLU or the residual add after.

At small batch a decoder layer is bound by kernel launches, not by the weights it reads: a norm,
a matmul, an activation and a residual add are four launches where one would do. Carrying the
residual stream as one tensor, each layer needs four:

    qkv    = fused_linear(stream, W_qkv, norm=(ln1, eps))            # RMSNorm → q/k/v
    stream = fused_linear(attn,   W_o,   residual=stream)            # o_proj + residual
    act    = fused_linear(stream, W_gu,  norm=(ln2, eps), gated=True)  # RMSNorm → gate/up → silu(g)*u
    stream = fused_linear(act,    W_d,   residual=stream)            # down_proj + residual

Rounding follows the unfused modules step by step: the normed row is rounded to the input dtype
before the weight multiplies it and again after, the matmul (plus bias) is rounded once, silu(gate)
is rounded before it multiplies up, and the residual add is rounded once, so the fused layer
computes what `RMSNorm`, `nn.Linear`, `silu_mul` and `x + residual` compute in turn, up to the
matmul's summation order.

Two forms of each kernel. The tile form (`tl.dot`, BLOCK_M rows at once) serves steps of many rows.
At a few rows (decode at batch 1-4, `GEMV_ROWS`) a matmul is a read of W with next to no arithmetic,
and 16-row tl.dot tiles spread that read over too few programs (36-60 for SmolLM2-135M on 132 SMs):
the GEMV form gives each program a few output columns, reads their weight rows over the whole K
(one or two big chunks) and multiplies every row of the step with them before moving on, so W is
read once and hundreds of programs pull it at once. Both forms share the prologue (RMSNorm and its roundings) and the epilogue (bias, SwiGLU,
residual; RoPE and the KV write), so they round alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specserve_kernels.gemv_sizes import tuned_sizes
from specserve_kernels.rope_store import rope_kv_store_ref


@triton.jit
def _row_rstd(x_rows, row_ok, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / rms of each row (K is one hidden row: cheap to read twice)."""
    squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
        squares += tl.sum(xk * xk, axis=1)
    return tl.rsqrt(squares / K + eps)


@triton.jit
def _round_normed(xk, rstd, scale):
    """RMSNorm's two roundings: the normed value to the input dtype, then its product with the weight."""
    normed = (xk.to(tl.float32) * rstd).to(xk.dtype).to(tl.float32)
    return (normed * scale.to(tl.float32)).to(xk.dtype)


@triton.jit
def _input_tile(
    x_rows, ks, row_ok, k_ok, K, eps, rstd, norm_ptr, NORM: tl.constexpr, ONE_CHUNK: tl.constexpr
):
    """Columns `ks` of the rows, RMS-normed when NORM (with rstd, or, when the chunk is the whole row,
    with each row's own norm from the chunk: no second read of x), rounded as RMSNorm rounds."""
    xk = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    if NORM:
        if ONE_CHUNK:
            xf = xk.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / K + eps)
        scale = tl.load(norm_ptr + ks, mask=k_ok, other=0.0)
        xk = _round_normed(xk, rstd[:, None], scale[None, :])
    return xk


@triton.jit
def _input_row(
    x_row, ks, k_end, K, eps, rstd, idx, m: tl.constexpr, scale, NORM: tl.constexpr, ONE_CHUNK: tl.constexpr
):
    """The GEMV form's `_input_tile`: columns `ks` < `k_end` of row m, in fp32 (`k_end` 0 for a row
    past the step's last: it reads nothing). RMS-normed with rstd[m], or, when the chunk is the whole
    row, with the row's own norm: no second read of x before the weights can be multiplied."""
    xk = tl.load(x_row + ks, mask=ks < k_end, other=0.0)
    if NORM:
        if ONE_CHUNK:
            xf = xk.to(tl.float32)
            r = tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
        else:
            r = _pick(rstd, idx, m)
        xk = _round_normed(xk, r, scale)
    return xk.to(tl.float32)


@triton.jit
def _dot_rows(x, w):
    """[M, K] x [N, K] -> [M, N]: fp32 products summed over K (no tl.dot: M is a few rows)."""
    return tl.sum(x[:, None, :] * w[None, :, :], axis=2)


@triton.jit
def _pick(values, idx, m: tl.constexpr):
    """values[m] of a short vector, as a scalar (registers cannot be indexed)."""
    return tl.sum(tl.where(idx == m, values, 0.0), axis=0)


@triton.jit
def _add_row(acc, idx, m: tl.constexpr, w, xm):
    """acc[m, :] += w @ xm: one row's dot products with the program's weight rows (fp32 products of
    the inputs' values, exact for bf16 and fp16, summed in fp32 as tl.dot sums)."""
    return tl.where((idx == m)[:, None], acc + tl.sum(w * xm[None, :], axis=1)[None, :], acc)


@triton.jit
def _gemv_chunk(
    acc,
    acc2,
    w,
    w2,
    x_ptr,
    x_rows,
    ks,
    k_ok,
    row_ok,
    row0,
    M,
    K,
    eps,
    rstd,
    stride_xm,
    norm_ptr,
    NORM: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    ALL_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BOTH: tl.constexpr,
):
    """One K chunk of the GEMV form: acc += x @ w.T (and acc2 += x @ w2.T when BOTH: the up half of a
    gated weight, or a head's second rotation half), x the rows' columns `ks`, normed as `_input_tile`
    norms. Every row at once (ALL_ROWS: one [rows, n, k] product, one reduction) or a row at a time."""
    if ALL_ROWS:
        xs = _input_tile(x_rows, ks, row_ok, k_ok, K, eps, rstd, norm_ptr, NORM, ONE_CHUNK).to(tl.float32)
        acc += _dot_rows(xs, w)
        if BOTH:
            acc2 += _dot_rows(xs, w2)
    else:
        scale = 0.0
        if NORM:
            scale = tl.load(norm_ptr + ks, mask=k_ok, other=0.0)
        idx = tl.arange(0, BLOCK_M)
        x_first = x_ptr + row0.to(tl.int64) * stride_xm
        for m in tl.static_range(BLOCK_M):
            k_end = tl.where(row0 + m < M, K, 0)
            xm = _input_row(x_first + m * stride_xm, ks, k_end, K, eps, rstd, idx, m, scale, NORM, ONE_CHUNK)
            acc = _add_row(acc, idx, m, w, xm)
            if BOTH:
                acc2 = _add_row(acc2, idx, m, w2, xm)
    return acc, acc2


@triton.jit
def _linear_epilogue(
    acc,
    acc_up,
    rows,
    cols,
    row_ok,
    col_ok,
    bias_ptr,
    res_ptr,
    out_ptr,
    stride_rm,
    stride_om,
    GATED: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BIAS: tl.constexpr,
):
    """Bias, SwiGLU and the residual add on fp32 sums [rows, cols], rounded as the modules round."""
    if BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ty = out_ptr.dtype.element_ty
    out = acc.to(out_ty).to(tl.float32)
    if GATED:
        act = (out / (1.0 + tl.exp(-out))).to(out_ty).to(tl.float32)
        out = (act * acc_up.to(out_ty).to(tl.float32)).to(out_ty).to(tl.float32)
    out_mask = row_ok[:, None] & col_ok[None, :]
    if RESIDUAL:
        res = tl.load(
            res_ptr + rows.to(tl.int64)[:, None] * stride_rm + cols[None, :], mask=out_mask, other=0.0
        )
        out = out + res.to(tl.float32)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], out.to(out_ty), mask=out_mask)


@triton.jit(do_not_specialize=["M"])  # the step's token count: no compile per size class
def _fused_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    norm_ptr,
    res_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_rm,
    stride_om,
    eps,
    NORM: tl.constexpr,
    GATED: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM and not ONE_CHUNK:
        rstd = _row_rstd(x_rows, row_ok, K, eps, BLOCK_M, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xk = _input_tile(x_rows, ks, row_ok, k_ok, K, eps, rstd, norm_ptr, NORM, ONE_CHUNK)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wk = tl.load(w_cols + ks[:, None], mask=w_mask, other=0.0)
        if UPCAST:  # the interpreter's tl.dot mishandles bf16; fp32 products of bf16 values are exact
            xk, wk = xk.to(tl.float32), wk.to(tl.float32)
        acc += tl.dot(xk, wk, input_precision=PRECISION)
        if GATED:  # the up half of the stacked weight: rows N.. of W
            wu = tl.load(w_cols + N * stride_wn + ks[:, None], mask=w_mask, other=0.0)
            if UPCAST:
                wu = wu.to(tl.float32)
            acc_up += tl.dot(xk, wu, input_precision=PRECISION)
    _linear_epilogue(
        acc,
        acc_up,
        rows,
        cols,
        row_ok,
        col_ok,
        bias_ptr,
        res_ptr,
        out_ptr,
        stride_rm,
        stride_om,
        GATED,
        RESIDUAL,
        BIAS,
    )


@triton.jit(do_not_specialize=["M"])
def _fused_gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    norm_ptr,
    res_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_rm,
    stride_om,
    eps,
    NORM: tl.constexpr,
    GATED: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    ALL_ROWS: tl.constexpr,
):
    """The GEMV form of `_fused_linear_kernel`: weight rows `cols` [BLOCK_N, BLOCK_K] are loaded once
    per K chunk and the BLOCK_M rows multiply them, in turn or all at once (`_gemv_chunk`; no tl.dot:
    a 16-row tile at a few real rows would waste the tensor cores and, worse, the programs)."""
    idx = tl.arange(0, BLOCK_M)
    row0 = tl.program_id(1) * BLOCK_M
    rows = row0 + idx
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM and not ONE_CHUNK:  # each program norms the rows again: a hidden row is a few KB, in L2
        rstd = _row_rstd(x_ptr + rows.to(tl.int64)[:, None] * stride_xm, row_ok, K, eps, BLOCK_M, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w_mask = col_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0).to(tl.float32)
        w_up = w
        if GATED:  # the up half of the stacked weight: rows N.. of W
            w_up = tl.load(w_rows + N * stride_wn + ks[None, :], mask=w_mask, other=0.0).to(tl.float32)
        acc, acc_up = _gemv_chunk(
            acc, acc_up, w, w_up, x_ptr, x_rows, ks, k_ok, row_ok, row0, M, K, eps, rstd, stride_xm,
            norm_ptr, NORM, ONE_CHUNK, ALL_ROWS, BLOCK_M, GATED,
        )  # fmt: skip
    _linear_epilogue(
        acc,
        acc_up,
        rows,
        cols,
        row_ok,
        col_ok,
        bias_ptr,
        res_ptr,
        out_ptr,
        stride_rm,
        stride_om,
        GATED,
        RESIDUAL,
        BIAS,
    )


# Steps of at most this many rows take the GEMV form. SPECSERVE_GEMV_ROWS sets it (0: never), so a
# GPU run can time both forms from one copy of the code.
GEMV_ROWS = int(os.environ.get("SPECSERVE_GEMV_ROWS", "4"))
# Programs a GEMV aims for: a guess of about two per H100 SM, so that every SM has weight reads in
# flight at once; scripts/bench_gemv.py sweeps the block sizes this picks.
GEMV_PROGRAMS = 256
# Rows the GEMV form multiplies one at a time (each its own reduction); more rows go all at once.
ROW_AT_A_TIME = 4


@dataclass(frozen=True)
class Blocks:
    m: int  # rows per program
    n: int  # output columns per program (q/k/v: rotation pairs, two weight rows each)
    k: int  # reduction chunk; capped at the next power of two of K
    warps: int
    gemv: bool = False  # the GEMV form (no tl.dot) rather than the tile form
    # GEMV form only: multiply the chunk's weights with every row at once (a [m, n, k] product summed
    # over k) rather than a row at a time: one reduction a chunk, not one per row.
    all_rows: bool = False


def gemv_blocks(rows: int, out_features: int, in_features: int) -> Blocks:
    """The GEMV form's sizes by rule: the whole K in one chunk up to 2048 (one round trip to memory per program, not a chain of
    them). Up to `ROW_AT_A_TIME` rows, a row at a time: the narrowest column block that still leaves
    about `GEMV_PROGRAMS` programs, and warps enough for about 32 weights a thread. Past that, every
    row at once, one output column a program, warps enough for about 64 products a thread (the
    [rows, 1, K] product lives in registers)."""
    k = min(triton.next_power_of_2(max(in_features, 16)), 2048)
    if rows > ROW_AT_A_TIME:
        m = min(triton.next_power_of_2(rows), 16)
        return Blocks(m, 1, k, max(1, min(8, m * k // 2048)), gemv=True, all_rows=True)
    n = 16
    while n > 2 and triton.cdiv(out_features, n) < GEMV_PROGRAMS:
        n //= 2
    return Blocks(min(triton.next_power_of_2(rows), 8), n, k, max(1, min(8, n * k // 1024)), gemv=True)


def blocks_for(rows: int, out_features: int, in_features: int, gemv_rows: int | None = None) -> Blocks:
    """Tile sizes by shape: a GPU sweep's fastest (`gemv_sizes`) where it timed the shape at a like
    row count, else by rule. At a few rows the matmul is a read of W, so narrow column tiles give it
    more programs (more SMs pulling weights); more rows share each weight tile instead. Up to
    `gemv_rows` rows (default `GEMV_ROWS`) the GEMV form. An explicit `gemv_rows` asks for the rule
    alone (tests, sweeps)."""
    if gemv_rows is None and (tuned := tuned_sizes(rows, out_features, in_features)) is not None:
        return Blocks(**tuned)
    if rows <= (GEMV_ROWS if gemv_rows is None else gemv_rows):
        return gemv_blocks(rows, out_features, in_features)
    if rows <= 16:
        return Blocks(16, 32 if out_features >= 2048 else 16, 128, 4)
    if rows <= 32:
        return Blocks(32, 32, 64, 4)
    return Blocks(64, 64, 64, 4)


def _check(x, weight, bias, norm, residual, gated) -> int:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x: expected [T, {weight.shape[-1]}] for a weight of {tuple(weight.shape)}, got {tuple(x.shape)}"
        )
    if gated and weight.shape[0] % 2:
        raise ValueError(f"weight: a gated layer stacks gate and up rows, got {weight.shape[0]} rows")
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias: expected [{weight.shape[0]}], got {tuple(bias.shape)}")
    if gated and bias is not None:
        raise ValueError("bias: not supported on a gated layer")
    if norm is not None and norm[0].shape != (x.shape[1],):
        raise ValueError(f"norm: expected a [{x.shape[1]}] weight, got {tuple(norm[0].shape)}")
    if residual is not None and residual.shape != (x.shape[0], n):
        raise ValueError(f"residual: expected [{x.shape[0]}, {n}], got {tuple(residual.shape)}")
    return n


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    *,
    blocks: Blocks | None = None,
) -> torch.Tensor:
    """x [T, K], weight [N, K] (`nn.Linear`'s layout) → [T, N]: `norm` = (weight, eps) applies
    RMSNorm to x first; `gated` treats weight as stacked gate/up rows [2N', K] and returns
    silu(gate) * up [T, N']; `residual` [T, N] is added last. A new tensor; inputs untouched.
    `blocks` overrides `blocks_for`'s choice (tests and sweeps)."""
    n = _check(x, weight, bias, norm, residual, gated)
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    rows, k = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    if rows == 0 or n == 0:
        return out
    b = blocks if blocks is not None else blocks_for(rows, n, k)
    grid = (triton.cdiv(n, b.n), triton.cdiv(rows, b.m))
    args = (
        x,
        weight,
        bias if bias is not None else weight,
        norm[0].contiguous() if norm is not None else weight,
        residual if residual is not None else x,
        out,
        rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        norm[1] if norm is not None else 0.0,
    )
    flags = {
        "NORM": norm is not None,
        "GATED": gated,
        "RESIDUAL": residual is not None,
        "BIAS": bias is not None,
    }
    block_k = min(b.k, max(16, triton.next_power_of_2(k)))
    if b.gemv:
        _fused_gemv_kernel[grid](
            *args,
            **flags,
            BLOCK_M=b.m,
            BLOCK_N=b.n,
            BLOCK_K=block_k,
            ONE_CHUNK=block_k >= k,
            ALL_ROWS=b.all_rows,
            num_warps=b.warps,
        )
        return out
    _fused_linear_kernel[grid](
        *args,
        **flags,
        PRECISION="ieee" if x.dtype == torch.float32 or x.device.type != "cuda" else "tf32",
        UPCAST=x.device.type != "cuda",
        BLOCK_M=b.m,
        BLOCK_N=b.n,
        BLOCK_K=block_k,
        ONE_CHUNK=block_k >= k,
        num_warps=b.warps,
    )
    return out


def fused_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """Plain torch: the model's own modules in turn (RMSNorm, linear, silu * up, residual add)."""
    _check(x, weight, bias, norm, residual, gated)
    if norm is not None:
        normed = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=norm[1])
        x = norm[0] * normed.to(x.dtype)
    out = torch.nn.functional.linear(x, weight, bias)
    if gated:
        gate, up = out.chunk(2, dim=-1)
        out = torch.nn.functional.silu(gate) * up
    return out if residual is None else out + residual


@triton.jit
def _qkv_epilogue(
    lo,
    hi,
    head,
    rows,
    row_ok,
    i,
    i_ok,
    bias_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    num_heads,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    stride_cos,
    HALF: tl.constexpr,
    BIAS: tl.constexpr,
):
    """Bias, the projection's rounding, RoPE on q and k heads and the stores of columns `i` and
    `i` + HALF of one head: fp32 sums lo/hi [rows, i] (`lo` the head's first half)."""
    if BIAS:
        lo += tl.load(bias_ptr + head * 2 * HALF + i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
        hi += tl.load(bias_ptr + head * 2 * HALF + HALF + i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    out_ty = q_out_ptr.dtype.element_ty
    lo = lo.to(out_ty).to(tl.float32)  # the projection's output, rounded as the linear layer's
    hi = hi.to(out_ty).to(tl.float32)
    mask = row_ok[:, None] & i_ok[None, :]
    if head < num_heads + num_kv_heads:  # q or k: rotate
        pos = tl.load(positions_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        cos = tl.load(cos_ptr + pos[:, None] * stride_cos + i[None, :], mask=mask, other=0.0)
        sin = tl.load(sin_ptr + pos[:, None] * stride_cos + i[None, :], mask=mask, other=0.0)
        lo, hi = lo * cos - hi * sin, hi * cos + lo * sin
    if head < num_heads:
        dst = q_out_ptr + rows.to(tl.int64)[:, None] * stride_qt + head * stride_qh + i[None, :]
    else:
        slot = tl.load(slots_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        if head < num_heads + num_kv_heads:
            dst = k_cache_ptr + slot[:, None] * stride_kcs + (head - num_heads) * stride_kch + i[None, :]
        else:
            kv_head = head - num_heads - num_kv_heads
            dst = v_cache_ptr + slot[:, None] * stride_vcs + kv_head * stride_vch + i[None, :]
    tl.store(dst, lo.to(out_ty), mask=mask)
    tl.store(dst + HALF, hi.to(out_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _qkv_rope_store_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    norm_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    M,
    K,
    num_heads,
    num_kv_heads,
    stride_xm,
    stride_wn,
    stride_qt,
    stride_qh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    stride_cos,
    eps,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
    BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
):
    head = tl.program_id(0)  # q heads, then k heads, then v heads: rows head * 2 HALF.. of W
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    i = tl.program_id(2) * BLOCK_HALF + tl.arange(0, BLOCK_HALF)  # this program's rotation pairs
    row_ok, i_ok = rows < M, i < HALF
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM and not ONE_CHUNK:
        rstd = _row_rstd(x_rows, row_ok, K, eps, BLOCK_M, BLOCK_K)
    lo = tl.zeros([BLOCK_M, BLOCK_HALF], dtype=tl.float32)  # the head's first half, then its second
    hi = tl.zeros([BLOCK_M, BLOCK_HALF], dtype=tl.float32)
    w_lo = w_ptr + (head * 2 * HALF + i).to(tl.int64)[None, :] * stride_wn
    w_hi = w_lo + HALF * stride_wn
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xk = _input_tile(x_rows, ks, row_ok, k_ok, K, eps, rstd, norm_ptr, NORM, ONE_CHUNK)
        w_mask = k_ok[:, None] & i_ok[None, :]
        wl = tl.load(w_lo + ks[:, None], mask=w_mask, other=0.0)
        wh = tl.load(w_hi + ks[:, None], mask=w_mask, other=0.0)
        if UPCAST:  # the interpreter's tl.dot mishandles bf16; fp32 products of bf16 values are exact
            xk, wl, wh = xk.to(tl.float32), wl.to(tl.float32), wh.to(tl.float32)
        lo += tl.dot(xk, wl, input_precision=PRECISION)
        hi += tl.dot(xk, wh, input_precision=PRECISION)
    _qkv_epilogue(
        lo,
        hi,
        head,
        rows,
        row_ok,
        i,
        i_ok,
        bias_ptr,
        q_out_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slots_ptr,
        positions_ptr,
        cos_ptr,
        sin_ptr,
        num_heads,
        num_kv_heads,
        stride_qt,
        stride_qh,
        stride_kcs,
        stride_kch,
        stride_vcs,
        stride_vch,
        stride_cos,
        HALF,
        BIAS,
    )


@triton.jit(do_not_specialize=["M"])
def _qkv_gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    norm_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    M,
    K,
    num_heads,
    num_kv_heads,
    stride_xm,
    stride_wn,
    stride_qt,
    stride_qh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    stride_cos,
    eps,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
    BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    ALL_ROWS: tl.constexpr,
):
    """The GEMV form of `_qkv_rope_store_kernel`: a program owns BLOCK_N rotation pairs (i, i + HALF)
    of one head, so RoPE needs nothing from another program, and a head spreads over several."""
    head = tl.program_id(0)
    i = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    idx = tl.arange(0, BLOCK_M)
    row0 = tl.program_id(2) * BLOCK_M
    rows = row0 + idx
    row_ok, i_ok = rows < M, i < HALF
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM and not ONE_CHUNK:
        rstd = _row_rstd(x_ptr + rows.to(tl.int64)[:, None] * stride_xm, row_ok, K, eps, BLOCK_M, BLOCK_K)
    lo = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    hi = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_lo = w_ptr + (head * 2 * HALF + i).to(tl.int64)[:, None] * stride_wn
    w_hi = w_lo + HALF * stride_wn
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w_mask = i_ok[:, None] & k_ok[None, :]
        wl = tl.load(w_lo + ks[None, :], mask=w_mask, other=0.0).to(tl.float32)
        wh = tl.load(w_hi + ks[None, :], mask=w_mask, other=0.0).to(tl.float32)
        lo, hi = _gemv_chunk(
            lo, hi, wl, wh, x_ptr, x_rows, ks, k_ok, row_ok, row0, M, K, eps, rstd, stride_xm,
            norm_ptr, NORM, ONE_CHUNK, ALL_ROWS, BLOCK_M, True,
        )  # fmt: skip
    _qkv_epilogue(
        lo,
        hi,
        head,
        rows,
        row_ok,
        i,
        i_ok,
        bias_ptr,
        q_out_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slots_ptr,
        positions_ptr,
        cos_ptr,
        sin_ptr,
        num_heads,
        num_kv_heads,
        stride_qt,
        stride_qh,
        stride_kcs,
        stride_kch,
        stride_vcs,
        stride_vch,
        stride_cos,
        HALF,
        BIAS,
    )


@dataclass(frozen=True)
class QKVLayout:
    """Where a fused q/k/v projection's outputs go: q heads come back, k/v land in the cache."""

    num_heads: int
    num_kv_heads: int
    k_cache: torch.Tensor  # [slots, KvH, D]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    cos: torch.Tensor  # [max_position, D / 2] fp32
    sin: torch.Tensor


def _check_qkv(x: torch.Tensor, weight: torch.Tensor, qkv: QKVLayout) -> int:
    heads = qkv.num_heads + 2 * qkv.num_kv_heads
    dim = qkv.k_cache.shape[-1]
    if weight.shape[0] != heads * dim or dim % 2 or qkv.cos.shape[-1] * 2 != dim:
        raise ValueError(
            f"weight: expected [{heads} heads * {dim}, K] with even head_dim, got {tuple(weight.shape)}"
        )
    if qkv.k_cache.shape[1] != qkv.num_kv_heads or qkv.v_cache.shape != qkv.k_cache.shape:
        raise ValueError(
            f"caches: expected [slots, {qkv.num_kv_heads}, {dim}], got {tuple(qkv.k_cache.shape)}"
        )
    if qkv.slot_mapping.shape != (x.shape[0],) or qkv.positions.shape != (x.shape[0],):
        raise ValueError(f"slot_mapping/positions: expected [{x.shape[0]}]")
    if qkv.k_cache.dtype != x.dtype:
        raise ValueError(f"dtypes differ: x {x.dtype}, cache {qkv.k_cache.dtype}")
    return dim


def qkv_rope_store(
    x: torch.Tensor,
    weight: torch.Tensor,
    qkv: QKVLayout,
    bias: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    *,
    blocks: Blocks | None = None,
) -> torch.Tensor:
    """RMSNorm (optional) → the stacked q/k/v projection → RoPE on q and k → k and v written to
    their cache slots, in one launch. Returns the rotated q [T, H, D]. `blocks` overrides
    `blocks_for`'s choice (its `n` counts rotation pairs a program: a head's pairs may be split over
    several programs, at least 16 a program in the tile form)."""
    _check(x, weight, bias, norm, None, False)
    dim = _check_qkv(x, weight, qkv)
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    q_out = torch.empty((rows, qkv.num_heads, dim), dtype=x.dtype, device=x.device)
    if rows == 0:
        return q_out
    half, heads = dim // 2, qkv.num_heads + 2 * qkv.num_kv_heads
    b = blocks if blocks is not None else blocks_for(rows, heads * half, k)
    args = (
        x,
        weight if weight.stride(1) == 1 else weight.contiguous(),
        bias if bias is not None else weight,
        norm[0].contiguous() if norm is not None else weight,
        q_out,
        qkv.k_cache,
        qkv.v_cache,
        qkv.slot_mapping,
        qkv.positions,
        qkv.cos,
        qkv.sin,
        rows,
        k,
        qkv.num_heads,
        qkv.num_kv_heads,
        x.stride(0),
        weight.stride(0),
        q_out.stride(0),
        q_out.stride(1),
        qkv.k_cache.stride(0),
        qkv.k_cache.stride(1),
        qkv.v_cache.stride(0),
        qkv.v_cache.stride(1),
        qkv.cos.stride(0),
        norm[1] if norm is not None else 0.0,
    )
    block_k = min(b.k, max(16, triton.next_power_of_2(k)))
    if b.gemv:
        block_n = min(b.n, triton.next_power_of_2(half))
        grid = (heads, triton.cdiv(half, block_n), triton.cdiv(rows, b.m))
        _qkv_gemv_kernel[grid](
            *args,
            HALF=half,
            NORM=norm is not None,
            BIAS=bias is not None,
            BLOCK_M=b.m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            ONE_CHUNK=block_k >= k,
            ALL_ROWS=b.all_rows,
            num_warps=b.warps,
        )
        return q_out
    block_half = max(16, min(b.n, triton.next_power_of_2(half)))  # tl.dot wants 16 columns or more
    _qkv_rope_store_kernel[(heads, triton.cdiv(rows, b.m), triton.cdiv(half, block_half))](
        *args,
        HALF=half,
        NORM=norm is not None,
        BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 or x.device.type != "cuda" else "tf32",
        UPCAST=x.device.type != "cuda",
        BLOCK_M=b.m,
        BLOCK_HALF=block_half,
        BLOCK_K=block_k,
        ONE_CHUNK=block_k >= k,
        num_warps=b.warps,
    )
    return q_out


def qkv_rope_store_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    qkv: QKVLayout,
    bias: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Plain torch: the norm and projection (`fused_linear_ref`), then RoPE and the KV write
    (`rope_kv_store_ref`)."""
    dim = _check_qkv(x, weight, qkv)
    out = fused_linear_ref(x, weight, bias=bias, norm=norm)
    q, k, v = out.split([qkv.num_heads * dim, qkv.num_kv_heads * dim, qkv.num_kv_heads * dim], dim=-1)
    tokens = x.shape[0]
    return rope_kv_store_ref(
        q.reshape(tokens, qkv.num_heads, dim),
        k.reshape(tokens, qkv.num_kv_heads, dim),
        v.reshape(tokens, qkv.num_kv_heads, dim),
        qkv.k_cache,
        qkv.v_cache,
        qkv.slot_mapping,
        qkv.positions,
        qkv.cos,
        qkv.sin,
    )
