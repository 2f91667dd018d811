"""Draft heads that read the target's hidden states: EAGLE (1/2), EAGLE-3 and a chain of MTP layers.

A head is a list of *step modules* with one interface: draft-token embeddings, the hidden state
that goes with them, positions and an attention context in; the hidden state the next draft step
consumes, and the one the lm_head reads, out. Step s of a chain uses module min(s, k - 1), so an
EAGLE head (one module) is applied autoregressively and an MTP chain walks its k layers, each fed
the hidden state the previous step produced (invariant 5).

- EAGLE: fc([embedding; target hidden]) -> decoder layer(s) (the first without its input norm);
  the output goes straight to the target's lm_head.
- EAGLE-3: fc fuses three target layers' residual streams (only on the first step; later steps
  feed the head's own pre-norm output back); one decoder layer whose attention reads
  [input_norm(embedding); hidden_norm(hidden)], optionally followed by plain decoder layers over its
  residual stream (a deeper head: `num_hidden_layers` > 1); its own final norm and a
  reduced-vocabulary lm_head with a draft->target token map.
- MTP (DeepSeek-V3 style): eh_proj([enorm(embedding); hnorm(hidden)]) -> a decoder layer ->
  shared_head.norm -> shared_head.head (or the target's lm_head).

Embedding and lm_head are the target's unless the checkpoint carries its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specserve.attention.backend import AttentionContext
from specserve.model.arch import ModelArch
from specserve.model.layers import RMSNorm, RotaryEmbedding
from specserve.model.llama import Attention, DecoderLayer, SwiGLU
from specserve.model.parallel import TPShard

HEAD_METHODS = ("eagle", "eagle3", "mtp")


@dataclass(frozen=True)
class HeadSpec:
    """The shape of a draft head, read from its config.json and the names of its tensors."""

    method: str  # eagle | eagle3 | mtp
    arch: ModelArch  # decoder-layer shape; vocab_size is the target's
    num_modules: int = 1  # MTP: the chain length k
    layers_per_module: int = 1  # EAGLE and EAGLE-3 heads may stack several decoder layers
    draft_vocab_size: int | None = None  # EAGLE-3's reduced lm_head (None: the full vocabulary)
    aux_layers: tuple[int, ...] = ()  # EAGLE-3: target layers whose outputs the fc fuses
    fc_bias: bool = False
    own_embedding: bool = False
    own_lm_head: bool = False

    @property
    def num_attention_layers(self) -> int:
        return self.num_modules * self.layers_per_module

    @property
    def vocab_out(self) -> int:
        return self.draft_vocab_size or self.arch.vocab_size


class EagleModule(nn.Module):
    def __init__(self, spec: HeadSpec, first_layer: int) -> None:
        super().__init__()
        hidden = spec.arch.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=spec.fc_bias)
        self.layers = nn.ModuleList(
            DecoderLayer(spec.arch, first_layer + i, input_norm=i > 0) for i in range(spec.layers_per_module)
        )

    def forward(self, emb, hidden, positions, rope, ctx, from_target: bool):
        x = self.fc(torch.cat([emb, hidden], dim=-1))
        for layer in self.layers:
            x = layer(x, positions, rope, ctx)
        return x, x


class Eagle3Layer(nn.Module):
    """A decoder layer whose attention reads the normed embedding and normed hidden side by side."""

    def __init__(self, arch: ModelArch, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer, in_features=2 * arch.hidden_size)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = SwiGLU(arch.hidden_size, arch.intermediate_size)

    def forward(self, emb, hidden, positions, rope, ctx):
        if ctx.add_rms_norm is None:
            both = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
            x = hidden + self.self_attn(both, positions, rope, ctx)
            return x + self.mlp(self.post_attention_layernorm(x))
        if ctx.fused_linear is not None:
            return self._forward_fused(emb, hidden, positions, rope, ctx)
        # Above the fused-matmul row limit (a batch's extend), the norms still fold into the adds.
        norm_e, norm_h, norm_2 = self.input_layernorm, self.hidden_norm, self.post_attention_layernorm
        e, _ = ctx.add_rms_norm(emb, None, norm_e.weight, norm_e.eps)
        h, _ = ctx.add_rms_norm(hidden, None, norm_h.weight, norm_h.eps)
        out = self.self_attn(torch.cat([e, h], dim=-1), positions, rope, ctx)
        h, x = ctx.add_rms_norm(out, hidden, norm_2.weight, norm_2.eps)
        return x + self.mlp(h, ctx.silu_mul)

    def _forward_fused(self, emb, hidden, positions, rope, ctx):
        """The same layer in the context's fused kernels, as the target's `forward_stream` runs its
        layers (q/k/v with RoPE and the KV write in one launch, each residual add and the second
        norm folded into a matmul): at a draft step's few rows its launches are most of its cost."""
        norm_e, norm_h, norm_2 = self.input_layernorm, self.hidden_norm, self.post_attention_layernorm
        e, _ = ctx.add_rms_norm(emb, None, norm_e.weight, norm_e.eps)
        h, _ = ctx.add_rms_norm(hidden, None, norm_h.weight, norm_h.eps)
        out = self.self_attn.attend_stream(torch.cat([e, h], dim=-1), None, positions, rope, ctx)
        x = ctx.fused_linear(out, self.self_attn.o_proj.weight, residual=hidden)
        act = ctx.fused_linear(x, self.mlp.gate_up_proj.weight, norm=(norm_2.weight, norm_2.eps), gated=True)
        return ctx.fused_linear(act, self.mlp.down_proj.weight, residual=x)


class Eagle3Module(nn.Module):
    def __init__(self, spec: HeadSpec, target_hidden: int, first_layer: int) -> None:
        super().__init__()
        arch = spec.arch
        self.fc = nn.Linear(len(spec.aux_layers) * target_hidden, arch.hidden_size, bias=spec.fc_bias)
        self.midlayer = Eagle3Layer(arch, first_layer)
        # A deeper head's further layers (checkpoint names `layers.1.*` on: `midlayer` is layer 0).
        self.layers = nn.ModuleList(
            DecoderLayer(arch, first_layer + i) for i in range(1, spec.layers_per_module)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, emb, hidden, positions, rope, ctx, from_target: bool):
        fused = ctx.fused_linear is not None and ctx.add_rms_norm is not None
        if from_target:  # the fused target layers; later steps feed back the head's own output
            fc = self.fc
            hidden = ctx.fused_linear(hidden, fc.weight, bias=fc.bias) if fused else fc(hidden)
        x = self.midlayer(emb, hidden, positions, rope, ctx)
        for layer in self.layers:
            x = _layer(layer, x, positions, rope, ctx)
        if ctx.add_rms_norm is None:
            return x, self.norm(x)
        return x, ctx.add_rms_norm(x, None, self.norm.weight, self.norm.eps)[0]


def _layer(layer: DecoderLayer, x, positions, rope, ctx) -> torch.Tensor:
    """A head's plain decoder layer in the fastest form the context offers."""
    if ctx.fused_linear is not None and ctx.add_rms_norm is not None:
        return layer.forward_stream(x, positions, rope, ctx)
    if ctx.add_rms_norm is not None:
        out, residual = layer.forward_fused(x, None, positions, rope, ctx)
        return out + residual
    return layer(x, positions, rope, ctx)


class SharedHead(nn.Module):
    def __init__(self, arch: ModelArch, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False) if own_head else None


class MTPModule(DecoderLayer):
    """A decoder layer with DeepSeek-V3's MTP inputs and output head around it; parameter names
    match the checkpoint's `model.layers.{L + i}.*` keys."""

    def __init__(self, spec: HeadSpec, layer: int) -> None:
        super().__init__(spec.arch, layer)
        hidden = spec.arch.hidden_size
        self.enorm = RMSNorm(hidden, spec.arch.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, spec.arch.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = SharedHead(spec.arch, spec.own_lm_head)

    def forward(self, emb, hidden, positions, rope, ctx, from_target: bool):
        if ctx.add_rms_norm is None:
            x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
            x = super().forward(x, positions, rope, ctx)
            return x, self.shared_head.norm(x)
        return self._forward_fused(emb, hidden, positions, rope, ctx)

    def _forward_fused(self, emb, hidden, positions, rope, ctx):
        """The same module in the context's fused kernels, as `Eagle3Layer` runs: eager norms and
        cuBLAS matmuls made an MTP module's draft step at batch 1 about twice an EAGLE-3 step's
        launches (H200, docs/benchmarks.md). Above the fused-matmul row limit, the layer's norms
        still fold into its residual adds."""

        def norm(x: torch.Tensor, module: RMSNorm) -> torch.Tensor:
            return ctx.add_rms_norm(x, None, module.weight, module.eps)[0]

        both = torch.cat([norm(emb, self.enorm), norm(hidden, self.hnorm)], dim=-1)
        fused = ctx.fused_linear is not None
        projected = ctx.fused_linear(both, self.eh_proj.weight) if fused else self.eh_proj(both)
        x = _layer(self, projected, positions, rope, ctx)
        return x, norm(x, self.shared_head.norm)


class DraftHead(nn.Module):
    """The step modules of one head, their rotary table, and the embedding/lm_head they use."""

    def __init__(self, spec: HeadSpec, target_hidden: int) -> None:
        super().__init__()
        self.spec = spec
        arch = spec.arch
        per = spec.layers_per_module
        if spec.method == "eagle":
            modules = [EagleModule(spec, 0)]
        elif spec.method == "eagle3":
            modules = [Eagle3Module(spec, target_hidden, 0)]
        else:
            modules = [MTPModule(spec, i * per) for i in range(spec.num_modules)]
        self.step_modules = nn.ModuleList(modules)
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size) if spec.own_embedding else None
        own_top_head = spec.own_lm_head and spec.method != "mtp"
        self.lm_head = nn.Linear(arch.hidden_size, spec.vocab_out, bias=False) if own_top_head else None
        # EAGLE-3: target id of each draft-vocabulary id (None: the vocabularies are the same).
        self.register_buffer("draft_to_target", None, persistent=False)
        self.rope = RotaryEmbedding(arch)
        self._target: tuple[nn.Module, ...] = ()  # (embed_tokens, lm_head), set by bind

    def bind(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        """Use the target's embedding and lm_head where the head has none (held, not registered, so
        the target's weights are neither copied nor saved with the head). They must be whole: under
        TP the target's are vocab-sharded, and rank 0 binds full copies instead (a drafter never
        issues collectives; specserve/executor/__init__.py says why)."""
        if isinstance(embed_tokens, TPShard) or isinstance(lm_head, TPShard):
            raise ValueError(
                "speculative.draft_model: a draft head needs the unsharded embedding and lm_head"
            )
        self._target = (embed_tokens, lm_head)

    def module_for_step(self, step: int) -> int:
        return min(step, len(self.step_modules) - 1)

    @torch.inference_mode()
    def run(
        self,
        module: int,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        from_target: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of step module `module` over [T] tokens: (the hidden state the next step
        consumes [T, H], the hidden state its lm_head reads [T, H])."""
        return self.forward_step(module, input_ids, hidden, positions, ctx, from_target)

    def forward_step(
        self,
        module: int,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        from_target: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`run` with autograd (the trainer's forward; specserve/train/unroll.py)."""
        emb = (self.embed_tokens or self._target[0])(input_ids)
        return self.step_modules[module](emb, hidden, positions, self.rope, ctx, from_target)

    @torch.inference_mode()
    def logits(self, module: int, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the draft vocabulary [T, vocab_out] for chosen rows of `run`'s second output."""
        return self.output_head(module)(hidden).float()

    def output_head(self, module: int) -> nn.Module:
        """The lm_head step module `module`'s second output goes through: its own, the head's, or the
        target's (draft vocabulary out)."""
        own = getattr(self.step_modules[module], "shared_head", None)
        if own is not None and own.head is not None:
            return own.head
        return self.lm_head or self._target[1]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_to_target is None else self.draft_to_target[draft_ids]

    def to_target_probs(self, probs: torch.Tensor, vocab: int) -> torch.Tensor:
        """Scatter [T, vocab_out] draft-vocabulary probabilities onto the target vocabulary."""
        if self.draft_to_target is None:
            return probs
        out = probs.new_zeros(probs.shape[0], vocab)
        return out.index_copy_(1, self.draft_to_target, probs)
