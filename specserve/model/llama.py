"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a pluggable attention backend.

The model knows nothing about pages or batches: each layer hands its rotated q/k/v to
`AttentionContext.attend`, which owns the KV cache and the per-step batch layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from specserve.attention.backend import AttentionContext
from specserve.model.arch import ModelArch
from specserve.model.layers import RMSNorm, RotaryEmbedding
from specserve.model.parallel import (
    NO_TP,
    TPInfo,
    embedding,
    gate_up_projection,
    head_shard,
    lm_head,
    partition_rows,
    qkv_projection,
    row_projection,
)
from specserve.model.weights import load_stacked_weights


class Attention(nn.Module):
    """`layer` indexes the KV cache; `in_features` is wider than hidden in EAGLE-3's draft layer.
    Under TP it holds this rank's KV groups (`num_heads` / `num_kv_heads` count local heads)."""

    def __init__(
        self, arch: ModelArch, layer: int, in_features: int | None = None, tp: TPInfo = NO_TP
    ) -> None:
        super().__init__()
        self.layer = layer
        heads = head_shard(arch.num_heads, arch.num_kv_heads, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = len(heads.q), len(heads.kv), arch.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = qkv_projection(in_features or arch.hidden_size, arch, heads, tp)
        self.split = (q_size, kv_size, kv_size)
        q_columns = arch.num_heads * arch.head_dim
        self.o_proj = row_projection(heads.q_rows(arch.head_dim), q_columns, arch.hidden_size, tp)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, ctx: AttentionContext
    ) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv_proj(x), positions, rope, ctx))

    def attend(
        self, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, ctx: AttentionContext
    ) -> torch.Tensor:
        """The projected q/k/v [T, q + 2 kv] → attention output [T, heads * head_dim] (before o_proj)."""
        tokens = qkv.shape[0]
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if ctx.fuses_rotary and rope.full:
            out = ctx.attend_rotary(self.layer, q, k, v, positions, rope)
        else:
            q, k = rope(positions, q, k)
            out = ctx.attend(self.layer, q, k, v)
        return out.reshape(tokens, self.num_heads * self.head_dim)

    def attend_stream(
        self,
        stream: torch.Tensor,
        norm: tuple[torch.Tensor, float] | None,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """RMSNorm (`norm`) → q/k/v → attention [T, heads * head_dim], in fused kernels: the
        context's whole norm-projection-RoPE-KV-write launch when it has one (`attend_qkv`)."""
        w, bias = self.qkv_proj.weight, self.qkv_proj.bias
        if ctx.fuses_qkv:
            out = ctx.attend_qkv(self.layer, stream, w, bias, norm, self.num_heads, positions, rope)
            return out.reshape(stream.shape[0], self.num_heads * self.head_dim)
        return self.attend(ctx.fused_linear(stream, w, bias=bias, norm=norm), positions, rope, ctx)


class SwiGLU(nn.Module):
    """Under TP: this rank's intermediate rows of gate/up, and the matching columns of down_proj."""

    def __init__(self, hidden: int, intermediate: int, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        rows = partition_rows(intermediate, tp.size, tp.rank, "intermediate")
        self.gate_up_proj = gate_up_projection(hidden, intermediate, rows, tp)
        self.down_proj = row_projection(rows, intermediate, hidden, tp)

    def forward(
        self, x: torch.Tensor, silu_mul: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """`silu_mul`: a fused activation over the stacked gate/up output (a backend's kernel)."""
        gate_up = self.gate_up_proj(x)
        if silu_mul is not None:
            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; EAGLE-1 heads drop the first layer's input norm."""

    def __init__(self, arch: ModelArch, layer: int, input_norm: bool = True, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps) if input_norm else nn.Identity()
        self.self_attn = Attention(arch, layer, tp=tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = SwiGLU(arch.hidden_size, arch.intermediate_size, tp)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, ctx: AttentionContext
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer over the stream x + residual (residual None: x alone, at the first layer),
        each add fused with the norm after it (`ctx.add_rms_norm`); returns (MLP output, residual):
        their sum is what `forward` returns."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        h, residual = ctx.add_rms_norm(x, residual, norm1.weight, norm1.eps)
        x = self.self_attn(h, positions, rope, ctx)
        h, residual = ctx.add_rms_norm(x, residual, norm2.weight, norm2.eps)
        return self.mlp(h, ctx.silu_mul), residual

    def forward_stream(
        self, stream: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, ctx: AttentionContext
    ) -> torch.Tensor:
        """The same layer in four fused matmuls (`ctx.fused_linear`; the first also applies RoPE and
        writes the KV cache where the context fuses that, `ctx.attend_qkv`), each norm folded into
        the matmul after it and each residual add into the one before: stream in, stream out. TP
        size 1 only (a row-parallel matmul's all-reduce must come before its residual add)."""
        linear, attn, mlp = ctx.fused_linear, self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        first_norm = (norm1.weight, norm1.eps) if isinstance(norm1, RMSNorm) else None
        out = attn.attend_stream(stream, first_norm, positions, rope, ctx)
        stream = linear(out, attn.o_proj.weight, residual=stream)
        act = linear(stream, mlp.gate_up_proj.weight, norm=(norm2.weight, norm2.eps), gated=True)
        return linear(act, mlp.down_proj.weight, residual=stream)


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        self.embed_tokens = embedding(arch.vocab_size, arch.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, tp=tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


def captured_streams(
    captured: dict[int, torch.Tensor], capture: tuple[int, ...], num_layers: int
) -> torch.Tensor | None:
    """The residual streams of layers `capture`, concatenated [T, len(capture) * H] (None: none asked)."""
    if not capture:
        return None
    if len(captured) != len(set(capture)):
        raise ValueError(f"capture: layer ids {capture} outside the model's {num_layers} layers")
    return torch.cat([captured[i] for i in capture], dim=-1)


class CausalLM(nn.Module):
    """What every target model shares: `arch`, `model.embed_tokens`, an lm_head (tied to the
    embedding when the checkpoint ties them), fp32 logits of chosen rows, HF-named weights."""

    arch: ModelArch
    lm_head: nn.Linear

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the checkpoint ties them (re-done after `to_empty`)."""
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in (q/k/v and gate/up into their stacked matmuls)."""
        if self.arch.tie_word_embeddings:
            tensors = {n: t for n, t in tensors.items() if n != "lm_head.weight"}
        optional = ("lm_head.weight",) if self.arch.tie_word_embeddings else ()
        load_stacked_weights(self, tensors, optional)


class LlamaForCausalLM(CausalLM):
    """forward() returns final-normed hidden states [T, hidden]; compute_logits() maps chosen rows to fp32 logits.

    Under TP (`tp.size > 1`) each rank holds its shard; every rank must run the same forward and
    compute_logits calls in the same order (they issue collectives), and all get the full results."""

    def __init__(self, arch: ModelArch, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        self.arch, self.tp = arch, tp
        self.model = LlamaModel(arch, tp)
        self.rope = RotaryEmbedding(arch)
        self.lm_head = lm_head(arch.hidden_size, arch.vocab_size, tp)
        self.tie_weights()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        return self.forward_features(input_ids, positions, ctx)[0]

    @torch.inference_mode()
    def forward_features(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final-normed hidden states [T, H], and the residual stream after each layer in `capture`
        concatenated [T, len(capture) * H] (what EAGLE-3 heads fuse), or None."""
        x = self.model.embed_tokens(input_ids)
        captured: dict[int, torch.Tensor] = {}
        if ctx.add_rms_norm is None:
            for i, layer in enumerate(self.model.layers):
                x = layer(x, positions, self.rope, ctx)
                if i in capture:
                    captured[i] = x
            hidden = self.model.norm(x)
        elif ctx.fused_linear is not None and self.tp.size == 1:  # one stream, norms and adds in the matmuls
            for i, layer in enumerate(self.model.layers):
                x = layer.forward_stream(x, positions, self.rope, ctx)
                if i in capture:
                    captured[i] = x
            hidden, _ = ctx.add_rms_norm(x, None, self.model.norm.weight, self.model.norm.eps)
        else:  # the stream travels as (x, residual), each add fused into the norm after it
            residual = None
            for i, layer in enumerate(self.model.layers):
                x, residual = layer.forward_fused(x, residual, positions, self.rope, ctx)
                if i in capture:
                    captured[i] = x + residual
            hidden, _ = ctx.add_rms_norm(x, residual, self.model.norm.weight, self.model.norm.eps)
        return hidden, captured_streams(captured, capture, len(self.model.layers))
