"""SwiGLU's activation: silu(gate) * up over the gate/up projection's output, in one pass.

The stacked projection writes [T, 2I] (gate columns, then up columns); the eager path splits it and
runs silu and a multiply, two launches and an intermediate. This reads each row once and writes
[T, I], rounding exactly where torch does: silu in fp32 rounded to the input dtype, then the product
in fp32 rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


def _check(gate_up: torch.Tensor) -> None:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up: expected [T, 2 * intermediate], got {tuple(gate_up.shape)}")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] → silu(gate_up[:, :I]) * gate_up[:, I:] as a new [T, I] tensor."""
    _check(gate_up)
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    rows, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, size), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(size))
        grid = (rows, triton.cdiv(size, block))
        _silu_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), size, BLOCK=block, num_warps=4)
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Plain torch, as `specserve.model.llama.SwiGLU` computes it."""
    _check(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
