"""Fused residual add + RMSNorm against the add and the model's RMSNorm module: fp32 and bf16,
SmolLM2's width (576, not a power of two) and a small one, with and without a residual."""

from __future__ import annotations

import pytest
import torch

from specserve.model.layers import RMSNorm
from specserve_kernels.rms_norm import add_rms_norm, add_rms_norm_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rows", "size"), [(1, 576), (7, 64)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_matches_add_and_rms_norm_module(rows, size, dtype, with_residual):
    g = torch.Generator().manual_seed(rows * size)
    x = (torch.randn(rows, size, generator=g) * 3).to(DEVICE, dtype)
    residual = (torch.randn(rows, size, generator=g) * 3).to(DEVICE, dtype) if with_residual else None
    norm = RMSNorm(size, eps=1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(size, generator=g))
    out, stream = add_rms_norm(x, residual, norm.weight, norm.eps)
    ref_out, ref_stream = add_rms_norm_ref(x, residual, norm.weight, norm.eps)
    expected_stream = x + residual if with_residual else x
    torch.testing.assert_close(ref_stream, expected_stream, rtol=0, atol=0)
    torch.testing.assert_close(ref_out, norm(expected_stream), rtol=0, atol=0)
    # The add rounds exactly as torch's on a GPU; Triton's interpreter truncates fp32 -> bf16 instead.
    exact = dtype == torch.float32 or DEVICE == "cuda"
    torch.testing.assert_close(stream, ref_stream, rtol=0 if exact else 2**-7, atol=0)
    assert out.dtype == ref_out.dtype
    # fp32: summation order only; bf16: a bf16 step or so (the interpreter's truncating casts, up to three).
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3 * 2**-7, atol=1e-2)
    torch.testing.assert_close(out.float(), ref_out.float(), **tol)


def test_strided_input_and_shape_errors():
    x = torch.randn(4, 128, device=DEVICE)[:, ::2]  # a strided view
    residual = torch.randn(4, 64, device=DEVICE)
    weight = torch.randn(64, device=DEVICE)
    out, stream = add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_stream = add_rms_norm_ref(x, residual, weight, 1e-6)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stream, ref_stream)
    with pytest.raises(ValueError, match="x"):
        add_rms_norm(x, residual, weight[:3], 1e-6)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, residual[:2], weight, 1e-6)
