"""Fused linear layers (RMSNorm before; bias, SwiGLU or residual after) against the modules in turn:
fp32 and bf16, every fusion, row counts across the tile-size tiers and widths that leave partial tiles."""

from __future__ import annotations

import pytest
import torch

from specserve_kernels.fused_linear import (
    QKVLayout,
    blocks_for,
    fused_linear,
    fused_linear_ref,
    qkv_rope_store,
    qkv_rope_store_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FUSIONS = {
    "plain": {},
    "norm": {"norm": True},
    "norm_bias": {"norm": True, "bias": True},
    "norm_gated": {"norm": True, "gated": True},
    "residual": {"residual": True},
}


def _inputs(rows: int, n: int, k: int, dtype: torch.dtype, fusion: dict, seed: int):
    g = torch.Generator().manual_seed(seed)
    width = 2 * n if fusion.get("gated") else n
    x = torch.randn(rows, k, generator=g) * 3
    weight = torch.randn(width, k, generator=g) / k**0.5
    kwargs = {}
    if fusion.get("bias"):
        kwargs["bias"] = (torch.randn(width, generator=g)).to(DEVICE, dtype)
    if fusion.get("norm"):
        kwargs["norm"] = ((1 + torch.randn(k, generator=g) / 4).to(DEVICE, dtype), 1e-5)
    if fusion.get("residual"):
        kwargs["residual"] = (torch.randn(rows, n, generator=g) * 2).to(DEVICE, dtype)
    return x.to(DEVICE, dtype), weight.to(DEVICE, dtype), kwargs, fusion.get("gated", False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fusion", FUSIONS, ids=list(FUSIONS))
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 40, 72), (5, 96, 64), (20, 33, 100), (70, 72, 136)])
def test_matches_the_modules_in_turn(rows, n, k, dtype, fusion):
    x, weight, kwargs, gated = _inputs(rows, n, k, dtype, FUSIONS[fusion], rows * n + k)
    out = fused_linear(x, weight, gated=gated, **kwargs)
    ref = fused_linear_ref(x, weight, gated=gated, **kwargs)
    assert out.shape == ref.shape == (rows, n) and out.dtype == dtype
    if dtype == torch.float32:  # summation order only
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    else:  # up to six bf16 roundings in a row, which the interpreter truncates instead of rounding
        scale = ref.float().abs().max().item()
        atol = scale * (2**-4 if DEVICE == "cpu" else 2**-6)
        torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=atol)


def test_reference_is_the_modules_in_turn():
    """The reference itself against RMSNorm, nn.Linear, silu * up and the add written out."""
    g = torch.Generator().manual_seed(0)
    x, w, ln = torch.randn(3, 8, generator=g), torch.randn(10, 8, generator=g), torch.rand(8, generator=g)
    normed = ln * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    gate, up = (normed @ w.T).chunk(2, dim=-1)
    torch.testing.assert_close(
        fused_linear_ref(x, w, norm=(ln, 1e-6), gated=True), gate * torch.sigmoid(gate) * up
    )
    res = torch.randn(3, 10, generator=g)
    torch.testing.assert_close(fused_linear_ref(x, w, residual=res), x @ w.T + res)


def test_strided_inputs_empty_batch_and_shape_errors():
    x = torch.randn(6, 128, device=DEVICE)[:, ::2]
    w = torch.randn(24, 64, device=DEVICE)
    torch.testing.assert_close(fused_linear(x, w), fused_linear_ref(x, w), rtol=1e-4, atol=1e-4)
    assert fused_linear(torch.randn(0, 64, device=DEVICE), w).shape == (0, 24)
    with pytest.raises(ValueError, match="x: expected"):
        fused_linear(torch.randn(2, 63, device=DEVICE), w)
    with pytest.raises(ValueError, match="weight: a gated"):
        fused_linear(torch.randn(2, 64, device=DEVICE), torch.randn(23, 64, device=DEVICE), gated=True)
    with pytest.raises(ValueError, match="residual"):
        fused_linear(torch.randn(2, 64, device=DEVICE), w, residual=torch.randn(2, 23, device=DEVICE))
    with pytest.raises(ValueError, match="norm"):
        fused_linear(torch.randn(2, 64, device=DEVICE), w, norm=(torch.ones(3, device=DEVICE), 1e-5))


def test_tiles_grow_with_rows():
    assert blocks_for(1, 576, 576).m == 16 and blocks_for(64, 576, 576).m == 64
    assert blocks_for(1, 3072, 576).n > blocks_for(1, 576, 576).n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fusion", ["norm", "norm_bias", "plain"])
@pytest.mark.parametrize(("rows", "heads", "kv_heads", "dim"), [(1, 9, 3, 64), (5, 4, 2, 8), (20, 3, 1, 32)])
def test_qkv_rope_store_matches_projection_rope_and_kv_write(rows, heads, kv_heads, dim, dtype, fusion):
    """q comes back rotated, k (rotated) and v land in their slots; other slots stay untouched."""
    width = (heads + 2 * kv_heads) * dim
    x, weight, kwargs, _ = _inputs(rows, width, 48, dtype, FUSIONS[fusion], rows + dim)
    g = torch.Generator().manual_seed(dim)
    num_slots = 3 * rows + 4
    slots = torch.randperm(num_slots, generator=g)[:rows].to(DEVICE)
    positions = torch.randint(0, 100, (rows,), generator=g).to(DEVICE)
    angles = torch.outer(torch.arange(128.0), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim)).to(DEVICE)
    before = torch.randn(2, num_slots, kv_heads, dim, generator=g).to(DEVICE, dtype)
    results = []
    for fn in (qkv_rope_store, qkv_rope_store_ref):
        k_cache, v_cache = before.clone()
        layout = QKVLayout(heads, kv_heads, k_cache, v_cache, slots, positions, angles.cos(), angles.sin())
        results.append((fn(x, weight, layout, **kwargs), k_cache, v_cache))
    (q, k_cache, v_cache), (q_ref, k_ref, v_ref) = results
    assert q.shape == (rows, heads, dim) and q.dtype == dtype
    for got, want in ((q, q_ref), (k_cache, k_ref), (v_cache, v_ref)):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        else:
            atol = want.float().abs().max().item() * (2**-4 if DEVICE == "cpu" else 2**-6)
            torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=atol)
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(k_cache[untouched], before[0][untouched])
    assert torch.equal(v_cache[untouched], before[1][untouched])
