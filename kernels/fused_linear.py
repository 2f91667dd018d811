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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
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
):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    if NORM:  # the row's rms first: K is one hidden row, cheap to read twice
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
            xk = xk.to(tl.float32)
            squares += tl.sum(xk * xk, axis=1)
        rstd = tl.rsqrt(squares / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xk = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            normed = (xk.to(tl.float32) * rstd[:, None]).to(xk.dtype).to(tl.float32)
            scale = tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            xk = (normed * scale[None, :]).to(xk.dtype)
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


@dataclass(frozen=True)
class Blocks:
    m: int
    n: int
    k: int
    warps: int


def blocks_for(rows: int, out_features: int, in_features: int) -> Blocks:
    """Tile sizes by shape: at a few rows the matmul is a read of W, so narrow column tiles give it
    more programs (more SMs pulling weights); more rows share each weight tile instead."""
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
) -> torch.Tensor:
    """x [T, K], weight [N, K] (`nn.Linear`'s layout) → [T, N]: `norm` = (weight, eps) applies
    RMSNorm to x first; `gated` treats weight as stacked gate/up rows [2N', K] and returns
    silu(gate) * up [T, N']; `residual` [T, N] is added last. A new tensor; inputs untouched."""
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
    b = blocks_for(rows, n, k)
    grid = (triton.cdiv(n, b.n), triton.cdiv(rows, b.m))
    _fused_linear_kernel[grid](
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
        NORM=norm is not None,
        GATED=gated,
        RESIDUAL=residual is not None,
        BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 or x.device.type != "cuda" else "tf32",
        UPCAST=x.device.type != "cuda",
        BLOCK_M=b.m,
        BLOCK_N=b.n,
        BLOCK_K=min(b.k, max(16, triton.next_power_of_2(k))),
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
