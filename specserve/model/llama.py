"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a pluggable attention backend.

The model knows nothing about pages or batches: each layer hands its rotated q/k/v to
`AttentionContext.attend`, which owns the KV cache and the per-step batch layout.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from specserve.attention.backend import AttentionContext
from specserve.model.arch import ModelArch
from specserve.model.layers import RMSNorm, RotaryEmbedding, StackedLinear, SwiGLU


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = StackedLinear(
            arch.hidden_size,
            {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size},
            bias=arch.attention_bias,
        )
        self.split = (q_size, kv_size, kv_size)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, arch.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, ctx: AttentionContext
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        out = ctx.attend(self.layer, q, k, v)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = SwiGLU(arch.hidden_size, arch.intermediate_size)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, ctx: AttentionContext
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward() returns final-normed hidden states [T, hidden]; compute_logits() maps chosen rows to fp32 logits."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch)
        self.rope = RotaryEmbedding(arch)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the checkpoint ties them (re-done after `to_empty`)."""
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, self.rope, ctx)
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in (q/k/v and gate/up into their stacked matmuls), casting to each
        parameter's dtype; every parameter row must be covered exactly once."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = dict.fromkeys(params, 0)
        with torch.no_grad():
            for name, tensor in tensors.items():
                if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                    continue
                target, rows = self._destination(name, params)
                if target.shape[1:] != tensor.shape[1:] or target[rows].shape[0] != tensor.shape[0]:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not fit the model")
                target[rows].copy_(tensor.to(target.dtype))
                filled[self._param_name(name)] += tensor.shape[0]
        missing = [n for n, p in params.items() if filled[n] != p.shape[0]]
        if self.arch.tie_word_embeddings:
            missing = [n for n in missing if n != "lm_head.weight"]
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {missing[:5]}")

    def _param_name(self, name: str) -> str:
        for shard, stacked in _STACKED.items():
            if f".{shard}." in name:
                return name.replace(f".{shard}.", f".{stacked}.")
        return name

    def _destination(self, name: str, params: dict[str, nn.Parameter]) -> tuple[nn.Parameter, slice]:
        param_name = self._param_name(name)
        if param_name not in params:
            raise ValueError(f"checkpoint has a tensor the model does not: {name}")
        if param_name == name:
            return params[name], slice(None)
        module = self.get_submodule(param_name.rsplit(".", 1)[0])
        shard = next(s for s in _STACKED if f".{s}." in name)
        return params[param_name], module.shard_rows(shard)


# Checkpoint projection -> the stacked module that holds it.
_STACKED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
