"""RoPE on q and k and the KV-cache write of k and v, in one launch.

Each program takes one token: it reads the token's position and slot, rotates every query head and
every key head (rotate-half layout, as `specserve.model.layers.RotaryEmbedding`: the first and second
halves of a head are the (x1, x2) pairs; fp32 arithmetic on the model's fp32 cos/sin tables, rounded
to the input dtype once), writes the rotated q to a fresh tensor and the rotated k and the plain v to
their slot of the cache. Without RoPE (`cos` None) it is the plain KV write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kv_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    positions_ptr,
    slots_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    stride_cos,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    ROPE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    kh = tl.arange(0, BLOCK_KH)
    kv_ok = (kh < num_kv_heads)[:, None] & i_ok[None, :]
    cols = kh[:, None] * stride_kh + i[None, :]
    k1 = tl.load(k_ptr + t * stride_kt + cols, mask=kv_ok)
    k2 = tl.load(k_ptr + t * stride_kt + cols + HALF, mask=kv_ok)
    k_dst = k_cache_ptr + slot * stride_kcs + kh[:, None] * stride_kch + i[None, :]
    if ROPE:
        pos = tl.load(positions_ptr + t).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_cos + i, mask=i_ok)[None, :]
        sin = tl.load(sin_ptr + pos * stride_cos + i, mask=i_ok)[None, :]
        h = tl.arange(0, BLOCK_H)
        q_ok = (h < num_heads)[:, None] & i_ok[None, :]
        q_src = q_ptr + t * stride_qt + h[:, None] * stride_qh + i[None, :]
        q1 = tl.load(q_src, mask=q_ok).to(tl.float32)
        q2 = tl.load(q_src + HALF, mask=q_ok).to(tl.float32)
        q_dst = q_out_ptr + t * stride_ot + h[:, None] * stride_oh + i[None, :]
        out_ty = q_out_ptr.dtype.element_ty
        tl.store(q_dst, (q1 * cos - q2 * sin).to(out_ty), mask=q_ok)
        tl.store(q_dst + HALF, (q2 * cos + q1 * sin).to(out_ty), mask=q_ok)
        k1f, k2f = k1.to(tl.float32), k2.to(tl.float32)
        cache_ty = k_cache_ptr.dtype.element_ty
        tl.store(k_dst, (k1f * cos - k2f * sin).to(cache_ty), mask=kv_ok)
        tl.store(k_dst + HALF, (k2f * cos + k1f * sin).to(cache_ty), mask=kv_ok)
    else:
        tl.store(k_dst, k1, mask=kv_ok)
        tl.store(k_dst + HALF, k2, mask=kv_ok)
    v_cols = kh[:, None] * stride_vh + i[None, :]
    v_dst = v_cache_ptr + slot * stride_vcs + kh[:, None] * stride_vch + i[None, :]
    tl.store(v_dst, tl.load(v_ptr + t * stride_vt + v_cols, mask=kv_ok), mask=kv_ok)
    tl.store(v_dst + HALF, tl.load(v_ptr + t * stride_vt + v_cols + HALF, mask=kv_ok), mask=kv_ok)


def _check(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin) -> None:
    if (
        q.dim() != 3
        or k.dim() != 3
        or k.shape != v.shape
        or q.shape[0] != k.shape[0]
        or q.shape[2] != k.shape[2]
    ):
        raise ValueError(
            f"q/k/v: expected [T, H, D], [T, KvH, D], [T, KvH, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if k_cache.dim() != 3 or k_cache.shape[1:] != k.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches: expected [slots, {k.shape[1]}, {k.shape[2]}], got {tuple(k_cache.shape)}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype or q.dtype != k.dtype:
        raise ValueError(f"dtypes differ: q {q.dtype}, k/v {k.dtype}/{v.dtype}, cache {k_cache.dtype}")
    if k.shape[2] % 2:
        raise ValueError(f"head_dim must be even, got {k.shape[2]}")
    if slot_mapping.shape != (k.shape[0],) or (
        positions is not None and positions.shape != slot_mapping.shape
    ):
        raise ValueError(f"slot_mapping/positions: expected [{k.shape[0]}]")
    if cos is not None and (cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] * 2 != k.shape[2]):
        raise ValueError(f"cos/sin: expected [positions, {k.shape[2] // 2}] tables, got {tuple(cos.shape)}")
    if any(x.stride(-1) != 1 for x in (q, k, v, k_cache, v_cache)) or (
        cos is not None and cos.stride(1) != 1
    ):
        raise ValueError("q, k, v, the caches and cos/sin need a contiguous last dimension")


def rope_kv_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KvH, D] → rotated q [T, H, D] (a new tensor); rotated k and v land in
    k_cache/v_cache [slots, KvH, D] at `slot_mapping` [T]. `cos`/`sin` [max_position, D/2] fp32,
    indexed by `positions` [T]; with `cos` None nothing is rotated and q is returned as is."""
    _check(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin)
    rope = cos is not None
    tokens, heads, dim = q.shape
    q_out = torch.empty((tokens, heads, dim), dtype=q.dtype, device=q.device) if rope else q
    if tokens == 0:
        return q_out
    half = dim // 2
    table = cos if rope else k_cache  # never read without RoPE
    _rope_kv_store_kernel[(tokens,)](
        q,
        k,
        v,
        q_out,
        k_cache,
        v_cache,
        positions if rope else slot_mapping,
        slot_mapping,
        table,
        sin if rope else table,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        table.stride(0),
        heads,
        k.shape[1],
        HALF=half,
        BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_KH=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half),
        ROPE=rope,
        num_warps=1 if heads * dim <= 1024 else 4,
    )
    return q_out


def rope_kv_store_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch, as the model's RotaryEmbedding then the torch backend's KV write."""
    _check(q, k, v, k_cache, v_cache, slot_mapping, positions, cos, sin)
    if cos is not None:
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        q, k = _rotate(q, c, s), _rotate(k, c, s)
    k_cache[slot_mapping] = k
    v_cache[slot_mapping] = v
    return q


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
