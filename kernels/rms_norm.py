"""Residual add fused with RMSNorm: one pass over each row instead of an add, a cast, a norm and a scale.

Pre-norm decoders alternate `residual = x + residual; h = norm(residual)`. This reads x and the
residual once, writes the new residual (rounded to the input dtype, exactly as the separate add
does) and the normed row: normalised in fp32, rounded to the input dtype, then scaled by the weight
in the weight's and input's common dtype, as `specserve.model.layers.RMSNorm` computes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < size
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / size + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def _check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(
            f"x: expected [T, {weight.shape[0]}] for a weight of {tuple(weight.shape)}, got {tuple(x.shape)}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual: expected {x.dtype} {tuple(x.shape)}, got {residual.dtype} {tuple(residual.shape)}"
        )


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, N] (residual None: x alone is the stream), weight [N] →
    (weight * rms_norm(x + residual), x + residual); new tensors, the inputs untouched."""
    _check(x, residual, weight)
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    rows, size = x.shape
    out = torch.empty((rows, size), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    new_residual = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x
    if rows:
        block = triton.next_power_of_2(size)
        _add_rms_norm_kernel[(rows,)](
            x,
            residual if residual is not None else x,
            weight if weight.stride(0) == 1 else weight.contiguous(),
            out,
            new_residual,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            new_residual.stride(0),
            size,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(8, max(1, block // 256)),
        )
    return out, new_residual


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: the add, then RMSNorm exactly as the model's module computes it."""
    _check(x, residual, weight)
    stream = x if residual is None else x + residual
    normed = torch.nn.functional.rms_norm(stream.float(), (stream.shape[-1],), eps=eps)
    return weight * normed.to(stream.dtype), stream
