"""Fused SwiGLU activation against silu(gate) * up: fp32 and bf16, SmolLM2's width (1536) and odd ones."""

from __future__ import annotations

import pytest
import torch

from specserve_kernels.silu_mul import silu_mul, silu_mul_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rows", "size"), [(1, 1536), (5, 100), (3, 2500)])
def test_matches_silu_times_up(rows, size, dtype):
    g = torch.Generator().manual_seed(rows + size)
    gate_up = (torch.randn(rows, 2 * size, generator=g) * 4).to(DEVICE, dtype)
    out = silu_mul(gate_up)
    ref = silu_mul_ref(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul_ref(gate_up.float()), gate * torch.sigmoid(gate) * up)
    assert out.shape == ref.shape and out.dtype == dtype
    # fp32: exp's last bits; bf16: one rounding step (the interpreter truncates instead of rounding).
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 * 2**-7, atol=1e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


def test_strided_input_and_shape_errors():
    gate_up = torch.randn(4, 256, device=DEVICE)[:, ::2]
    torch.testing.assert_close(silu_mul(gate_up), silu_mul_ref(gate_up), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="gate_up"):
        silu_mul(torch.randn(4, 7, device=DEVICE))
    assert silu_mul(torch.randn(0, 8, device=DEVICE)).shape == (0, 4)
