"""Bamba: a hybrid decoder whose layers are Mamba-2 mixers except a few attention layers
(`attn_layer_indices`), each followed by a SwiGLU MLP. It loads the HF folder layout of
`BambaForCausalLM` (ibm-ai-platform/Bamba-9B and its transformers port; `docs/hybrid-models.md`).

The attention layers are the Llama ones (half of each head rotated) over the paged KV cache, indexed
by their place among the attention layers; the Mamba-2 layers read and write the request's slot in
the state pool through a `RecurrentContext` (`specserve/model/mamba2.py`). Plain modules only: no
fused backend paths, and tensor-parallel size 1.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.attention.backend import AttentionContext
from specserve.engine.state_pool import RecurrentContext
from specserve.model.arch import ModelArch
from specserve.model.layers import RMSNorm, RotaryEmbedding
from specserve.model.llama import Attention, CausalLM, SwiGLU, captured_streams
from specserve.model.mamba2 import Mamba2Mixer
from specserve.model.parallel import NO_TP, TPInfo


class BambaDecoderLayer(nn.Module):
    """Pre-norm mixer (attention with KV layer `kv_index`, or Mamba-2 with state layer
    `state_index`) and MLP blocks, named as the checkpoint names them."""

    def __init__(self, arch: ModelArch, kv_index: int | None, state_index: int | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if kv_index is not None:
            self.self_attn = Attention(arch, kv_index)
        else:
            self.mamba = Mamba2Mixer(arch, state_index)
        self.pre_ff_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.feed_forward = SwiGLU(arch.hidden_size, arch.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        ctx: AttentionContext,
        states: RecurrentContext,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if hasattr(self, "self_attn"):
            h = self.self_attn(h, positions, rope, ctx)
        else:
            h = self.mamba(h, states)
        x = x + h
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class BambaModel(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        attends, recurrent = arch.attention_layers or (), arch.mamba_layers
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            BambaDecoderLayer(
                arch,
                attends.index(i) if i in attends else None,
                recurrent.index(i) if i in recurrent else None,
            )
            for i in range(arch.num_layers)
        )
        self.final_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class BambaForCausalLM(CausalLM):
    """The `LlamaForCausalLM` interface (hidden states, logits of chosen rows, HF-named weights),
    with the step's `RecurrentContext` as one more forward input."""

    def __init__(self, arch: ModelArch, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        if tp.size > 1:
            raise ValueError(
                "tp_size: hybrid (Mamba-2) models run at tensor-parallel size 1; "
                "their recurrent layers are not sharded (docs/hybrid-models.md)"
            )
        if arch.mamba is None:
            raise ValueError("BambaForCausalLM needs a hybrid arch (arch.mamba)")
        self.arch, self.tp = arch, tp
        self.model = BambaModel(arch)
        self.rope = RotaryEmbedding(arch)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.tie_weights()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        states: RecurrentContext | None = None,
    ) -> torch.Tensor:
        return self.forward_features(input_ids, positions, ctx, states=states)[0]

    @torch.inference_mode()
    def forward_features(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        capture: tuple[int, ...] = (),
        states: RecurrentContext | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As `LlamaForCausalLM.forward_features`; `states` (required) is the step's recurrent
        layout and the state pool it updates."""
        if states is None:
            raise ValueError("a hybrid model's forward needs the step's recurrent state (RecurrentContext)")
        x = self.model.embed_tokens(input_ids)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions, self.rope, ctx, states)
            if i in capture:
                captured[i] = x
        hidden = self.model.final_layernorm(x)
        return hidden, captured_streams(captured, capture, len(self.model.layers))
