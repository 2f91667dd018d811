"""RoPE + KV write in one launch against the model's RotaryEmbedding and a plain cache write.

Fresh random inputs: q/k/v as strided views of one projection output (as the model passes them),
llama3-scaled tables, repeated positions (tree drafts share them), scattered slots; fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from specserve.model.arch import ModelArch, RopeScaling
from specserve.model.layers import RotaryEmbedding
from specserve_kernels.rope_store import rope_kv_store, rope_kv_store_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rope(dim: int) -> RotaryEmbedding:
    arch = ModelArch(
        vocab_size=8,
        hidden_size=64,
        intermediate_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=dim,
        max_position=256,
        rope_scaling=RopeScaling(kind="llama3", factor=8.0, original_max_position=64),
    )
    return RotaryEmbedding(arch).to(DEVICE)


def _inputs(tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(DEVICE, dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    positions = torch.randint(0, 256, (tokens,), generator=g)
    positions[-2:] = positions[-3]  # tree siblings share a position
    slots = torch.randperm(4 * tokens, generator=g)[:tokens]
    shape = (4 * tokens, kv_heads, dim)
    return (
        q.view(tokens, heads, dim),
        k.view(tokens, kv_heads, dim),
        v.view(tokens, kv_heads, dim),
        torch.randn(shape, generator=g).to(DEVICE, dtype),
        torch.randn(shape, generator=g).to(DEVICE, dtype),
        slots.to(DEVICE),
        positions.to(DEVICE),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "dim"), [(5, 9, 3, 64), (12, 4, 2, 16), (3, 4, 4, 32)]
)
def test_matches_rotary_embedding_and_cache_write(tokens, heads, kv_heads, dim, dtype):
    q, k, v, k_cache, v_cache, slots, positions = _inputs(tokens, heads, kv_heads, dim, dtype, seed=dim)
    rope = _rope(dim)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref = rope_kv_store_ref(q, k, v, k_ref, v_ref, slots, positions, rope.cos, rope.sin)
    q_out = rope_kv_store(q, k, v, k_cache, v_cache, slots, positions, rope.cos, rope.sin)
    # The model's own module computes the same rotation.
    q_model, k_model = rope(positions, q, k)
    torch.testing.assert_close(q_ref, q_model, rtol=0, atol=0)
    torch.testing.assert_close(k_ref[slots], k_model, rtol=0, atol=0)
    # fp32: the same arithmetic (a fused multiply-add may move the last bit); bf16: one rounding step.
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(q_out.float(), q_ref.float(), **tol)
    torch.testing.assert_close(k_cache.float(), k_ref.float(), **tol)  # other slots untouched
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0)


def test_plain_kv_write_without_rope():
    q, k, v, k_cache, v_cache, slots, _ = _inputs(6, 4, 2, 16, torch.bfloat16, seed=1)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    assert rope_kv_store_ref(q, k, v, k_ref, v_ref, slots) is q
    assert rope_kv_store(q, k, v, k_cache, v_cache, slots) is q
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0)


def test_shape_errors_name_the_argument():
    q, k, v, k_cache, v_cache, slots, positions = _inputs(4, 4, 2, 16, torch.float32, seed=2)
    rope = _rope(16)
    with pytest.raises(ValueError, match="q/k/v"):
        rope_kv_store(q, k[:2], v, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="caches"):
        rope_kv_store(q, k, v, k_cache[:, :1], v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_kv_store(q, k, v, k_cache, v_cache, slots[:2])
    with pytest.raises(ValueError, match="cos/sin"):
        rope_kv_store(q, k, v, k_cache, v_cache, slots, positions, rope.cos[:, :4], rope.sin[:, :4])
