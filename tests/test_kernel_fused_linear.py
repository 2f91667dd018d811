"""Fused linear layers (RMSNorm before; bias, SwiGLU or residual after) against the modules in turn:
fp32 and bf16, every fusion, row counts across the tile-size tiers and widths that leave partial tiles;
both forms, the tile form (tl.dot) at every row count and the GEMV form at the 1-4 rows it serves
(and beyond, several row groups), with one K chunk or several."""

from __future__ import annotations

import functools
import itertools
import os
import subprocess
import sys

import pytest
import torch

from specserve_kernels.fused_linear import (
    Blocks,
    QKVLayout,
    blocks_for,
    fused_linear,
    fused_linear_ref,
    gemv_blocks,
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
    "bias": {"bias": True},
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
    tile = blocks_for(rows, n, k, gemv_rows=0)
    out = fused_linear(x, weight, gated=gated, blocks=tile, **kwargs)
    ref = fused_linear_ref(x, weight, gated=gated, **kwargs)
    assert out.shape == ref.shape == (rows, n) and out.dtype == dtype
    _assert_close(out, ref)


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    if out.dtype == torch.float32:  # summation order only
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    else:  # up to six bf16 roundings in a row, which the interpreter truncates instead of rounding
        scale = ref.float().abs().max().item()
        atol = scale * (2**-4 if DEVICE == "cpu" else 2**-6)
        torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=atol)


# Every combination of the features: norm or not, bias or gated or neither (a gated layer has no
# bias), residual or not.
FEATURES = ("norm", "bias", "gated", "residual")
COMBOS = {
    "+".join(f for f, on in zip(FEATURES, flags, strict=True) if on) or "plain": dict(
        zip(FEATURES, flags, strict=True)
    )
    for flags in itertools.product((False, True), repeat=4)
    if not (flags[1] and flags[2])
}
# (n, k) per row count: odd widths (partial column blocks) and K not a power of two (a masked chunk).
GEMV_SHAPES = {1: (40, 72), 2: (37, 100), 3: (24, 64), 4: (33, 136)}


# fp32 at one row only: the interpreter's time per case is what CI pays for this matrix.
GEMV_ROW_DTYPES = [
    (1, torch.float32),
    (1, torch.bfloat16),
    (2, torch.bfloat16),
    (3, torch.bfloat16),
    (4, torch.bfloat16),
]


@pytest.mark.parametrize("combo", COMBOS, ids=list(COMBOS))
@pytest.mark.parametrize(("rows", "dtype"), GEMV_ROW_DTYPES, ids=lambda v: str(v).removeprefix("torch."))
def test_gemv_matches_the_modules_in_turn(rows, combo, dtype):
    """The GEMV form, as `fused_linear` picks it at 1-4 rows, every feature combination; the odd
    rows with K in several chunks and column blocks of 4 or 1 instead."""
    n, k = GEMV_SHAPES[rows]
    x, weight, kwargs, gated = _inputs(rows, n, k, dtype, COMBOS[combo], rows * n + k)
    blocks = blocks_for(rows, n, k, gemv_rows=4)
    assert blocks.gemv and blocks.k >= k
    if rows % 2:
        blocks = Blocks(blocks.m, 4 if rows == 1 else 1, 32, 1, gemv=True)
    out = fused_linear(x, weight, gated=gated, blocks=blocks, **kwargs)
    ref = fused_linear_ref(x, weight, gated=gated, **kwargs)
    assert out.shape == ref.shape == (rows, n) and out.dtype == dtype
    _assert_close(out, ref)


@pytest.mark.parametrize("fusion", ["norm_gated", "residual", "norm_bias"])
@pytest.mark.parametrize(("rows", "block_m"), [(7, 2), (5, 8), (20, 4)])
def test_gemv_row_groups(rows, block_m, fusion):
    """Past one program's rows the GEMV form tiles the rows too (each group reads W again)."""
    x, weight, kwargs, gated = _inputs(rows, 24, 48, torch.float32, FUSIONS[fusion], rows)
    out = fused_linear(x, weight, gated=gated, blocks=Blocks(block_m, 8, 64, 2, gemv=True), **kwargs)
    _assert_close(out, fused_linear_ref(x, weight, gated=gated, **kwargs))


# The all-rows GEMV form (verify widths, 5-16 rows): (rows, n, k, blocks) with the whole K in one
# chunk (the row norms from the chunk itself) and in several, row blocks past the rows and below.
ALL_ROWS_CASES = {
    "5-rows-one-chunk": (5, 37, 72, Blocks(8, 1, 128, 2, gemv=True, all_rows=True)),
    "8-rows-chunked": (8, 24, 100, Blocks(8, 4, 32, 1, gemv=True, all_rows=True)),
    "13-rows-two-groups": (13, 33, 64, Blocks(8, 2, 64, 1, gemv=True, all_rows=True)),
}


@pytest.mark.parametrize("combo", ["norm+gated", "norm+bias+residual", "residual", "plain"])
@pytest.mark.parametrize("case", ALL_ROWS_CASES, ids=list(ALL_ROWS_CASES))
def test_gemv_all_rows_matches_the_modules_in_turn(case, combo):
    rows, n, k, blocks = ALL_ROWS_CASES[case]
    x, weight, kwargs, gated = _inputs(rows, n, k, torch.bfloat16, COMBOS[combo], rows * n + k)
    out = fused_linear(x, weight, gated=gated, blocks=blocks, **kwargs)
    _assert_close(out, fused_linear_ref(x, weight, gated=gated, **kwargs))


def test_gemv_all_rows_by_default_past_four_rows():
    """The rule (no swept table): 5-16 rows in one all-rows block, the whole K in one chunk."""
    for rows in (5, 8, 9, 16):
        b = blocks_for(rows, 480, 576, gemv_rows=16)
        assert b.gemv and b.all_rows and rows <= b.m <= 16 and b.k >= 576
    assert not blocks_for(4, 480, 576, gemv_rows=16).all_rows


@pytest.mark.parametrize("gemv", [False, True], ids=["tile", "gemv"])
@pytest.mark.parametrize("fusion", ["norm_gated", "norm_bias", "residual"])
def test_reads_stay_in_bounds(fusion, gemv):
    """Every operand a view into a NaN-filled buffer (rows past T, weight rows past N, columns past
    K or N): any masked lane that still read would poison the output."""
    rows, n, k = 3, 21, 40
    x, weight, kwargs, gated = _inputs(rows, n, k, torch.float32, FUSIONS[fusion], 7)

    def padded(t: torch.Tensor) -> torch.Tensor:
        buf = torch.full((t.shape[0] + 3, t.shape[1] + 5), float("nan"), device=DEVICE)
        buf[: t.shape[0], : t.shape[1]] = t
        return buf[: t.shape[0], : t.shape[1]]

    x, weight = padded(x), padded(weight)
    if "residual" in kwargs:
        kwargs["residual"] = padded(kwargs["residual"])
    blocks = Blocks(4, 8, 16, 1, gemv=True) if gemv else blocks_for(rows, n, k, gemv_rows=0)
    out = fused_linear(x, weight, gated=gated, blocks=blocks, **kwargs)
    assert torch.isfinite(out).all()
    _assert_close(out, fused_linear_ref(x, weight, gated=gated, **kwargs))


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
    assert blocks_for(1, 576, 576, gemv_rows=0).m == 16 and blocks_for(64, 576, 576).m == 64
    assert blocks_for(1, 3072, 576, gemv_rows=0).n > blocks_for(1, 576, 576, gemv_rows=0).n


def test_gemv_form_up_to_gemv_rows():
    """1-4 rows take the GEMV form by default; SmolLM2-135M's matmuls get a program per few
    columns (over a hundred programs each) and the whole K in one chunk."""
    for rows in (1, 2, 3, 4):
        b = blocks_for(rows, 960, 576, gemv_rows=4)
        assert b.gemv and b.m >= rows and b.k >= 576
    assert not blocks_for(5, 960, 576, gemv_rows=4).gemv
    assert not blocks_for(1, 960, 576, gemv_rows=0).gemv
    for n, k in ((960, 576), (576, 576), (1536, 576), (576, 1536), (15 * 32, 576)):
        b = gemv_blocks(1, n, k)
        assert -(-n // b.n) >= 128 and b.k >= k and 1 <= b.warps <= 8


def test_gemv_rows_env_knob():
    """SPECSERVE_GEMV_ROWS=0 turns the GEMV form off without code edits (read at import)."""
    code = "from specserve_kernels.fused_linear import blocks_for; print(blocks_for(1, 576, 576).gemv)"
    env = {**os.environ, "SPECSERVE_GEMV_ROWS": "0"}
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fusion", ["norm", "norm_bias", "plain"])
@pytest.mark.parametrize(("rows", "heads", "kv_heads", "dim"), [(1, 9, 3, 64), (5, 4, 2, 8), (20, 3, 1, 32)])
def test_qkv_rope_store_matches_projection_rope_and_kv_write(rows, heads, kv_heads, dim, dtype, fusion):
    """The tile form, at every row count."""
    _check_qkv_case(rows, heads, kv_heads, dim, dtype, fusion, blocks_for(rows, dim, 48, gemv_rows=0))


QKV_GEMV_BLOCKS = {  # (column block, K chunk): one chunk, and several with a column block below HALF
    "default": None,
    "chunked": (2, 16),
    "wide": (16, 32),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fusion", ["norm_bias", "plain"])  # norm and bias each: the other tests
@pytest.mark.parametrize("blocks", QKV_GEMV_BLOCKS, ids=list(QKV_GEMV_BLOCKS))
@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "dim"), [(1, 3, 1, 16), (2, 4, 2, 8), (3, 3, 1, 12), (4, 2, 1, 32)]
)
def test_qkv_gemv_matches_projection_rope_and_kv_write(rows, heads, kv_heads, dim, blocks, dtype, fusion):
    """The GEMV form at 1-4 rows: a head split over several programs (rotation pairs a program:
    2 of HALF 4-32), or one program with masked pairs (16 of HALF 4 or 6)."""
    b = blocks_for(rows, (heads + 2 * kv_heads) * dim // 2, 48, gemv_rows=4)
    assert b.gemv
    if QKV_GEMV_BLOCKS[blocks] is not None:
        n, k = QKV_GEMV_BLOCKS[blocks]
        b = Blocks(b.m, n, k, 1, gemv=True)
    _check_qkv_case(rows, heads, kv_heads, dim, dtype, fusion, b)


def test_qkv_gemv_smollm2_heads():
    """SmolLM2-135M's heads (9 q, 3 kv, dim 64) at one row, as `qkv_rope_store` picks the blocks."""
    blocks = blocks_for(1, 15 * 32, 48)
    _check_qkv_case(
        1, 9, 3, 64, torch.bfloat16, "norm", blocks if blocks.gemv else gemv_blocks(1, 15 * 32, 48)
    )


@pytest.mark.parametrize("block_k", [16, 64], ids=["chunked", "one-chunk"])
def test_qkv_tile_form_splits_a_head_over_programs(block_k):
    """The tile form with 16 rotation pairs a program (a head of 64 over two programs), K in
    several chunks (the norm from a first pass over x) or one (the norm from the chunk)."""
    _check_qkv_case(5, 3, 1, 64, torch.bfloat16, "norm", Blocks(16, 16, block_k, 4))


def test_qkv_gemv_row_groups():
    """Past one program's rows the q/k/v GEMV tiles the rows too."""
    _check_qkv_case(7, 3, 1, 16, torch.float32, "norm_bias", Blocks(2, 4, 32, 1, gemv=True))


@pytest.mark.parametrize(
    "blocks",
    [Blocks(8, 8, 64, 2, gemv=True, all_rows=True), Blocks(4, 2, 16, 1, gemv=True, all_rows=True)],
    ids=["one-chunk", "chunked-two-groups"],
)
def test_qkv_gemv_all_rows(blocks):
    """The all-rows form of the q/k/v GEMV (verify widths), bf16 with the norm."""
    _check_qkv_case(6, 3, 1, 16, torch.bfloat16, "norm", blocks)


def _check_qkv_case(rows, heads, kv_heads, dim, dtype, fusion, blocks):
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
    for fn in (functools.partial(qkv_rope_store, blocks=blocks), qkv_rope_store_ref):
        k_cache, v_cache = before.clone()
        layout = QKVLayout(heads, kv_heads, k_cache, v_cache, slots, positions, angles.cos(), angles.sin())
        results.append((fn(x, weight, layout, **kwargs), k_cache, v_cache))
    (q, k_cache, v_cache), (q_ref, k_ref, v_ref) = results
    assert q.shape == (rows, heads, dim) and q.dtype == dtype
    for got, want in ((q, q_ref), (k_cache, k_ref), (v_cache, v_ref)):
        _assert_close(got, want)
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(k_cache[untouched], before[0][untouched])
    assert torch.equal(v_cache[untouched], before[1][untouched])
