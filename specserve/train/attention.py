"""Attention for training: dense [B, S] batches instead of KV pages, with the masks of an unrolled draft chain.

The model layers call `AttentionContext.attend(layer, q, k, v)` as they do when serving; these contexts
answer it over a batch of B sequences padded to S tokens (flattened to [B * S] rows, padding at the
end of each row, so causal attention never lets a real token see a pad).

`CausalContext` is plain causal attention (the target's forward, and every step module's first pass
over a sequence). `UnrollContext` adds EAGLE-3's training-time test: after a module's causal pass
(its *base*), each further chain step r at base position p is the draft the module would make r
tokens past p when serving, and its query sees what the drafter's KV holds then: the base keys at
positions <= p, plus the keys the chain itself wrote at p for steps 1..r (the "diagonal"), nothing
else. This is the mask `head_drafter.py` produces incrementally; tests/test_train_draft.py checks the
two agree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.attention.backend import AttentionContext


class CausalContext(AttentionContext):
    def __init__(self, batch: int, seq: int) -> None:
        self.batch, self.seq = batch, seq

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q4 = self._blocks(q)
        # KV heads repeated here rather than `enable_gqa`, which not every fused SDPA kernel takes.
        k4, v4 = (_repeat_heads(self._blocks(t), q.shape[1]) for t in (k, v))
        return self._rows(F.scaled_dot_product_attention(q4, k4, v4, is_causal=True))

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """[B * S, heads, D] -> [B, heads, S, D]"""
        return x.view(self.batch, self.seq, x.shape[1], x.shape[2]).transpose(1, 2)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """[B, heads, S, D] -> [B * S, heads, D]"""
        return x.transpose(1, 2).reshape(self.batch * self.seq, x.shape[1], x.shape[3])


class UnrollContext(CausalContext):
    """Causal passes (`causal()`, the default) record each layer's keys as its base; chain steps
    (`chain()`) attend to the base keys causally and to their own diagonal."""

    def __init__(self, batch: int, seq: int) -> None:
        super().__init__(batch, seq)
        self.base: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.diagonal: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.chaining = False

    def causal(self) -> None:
        self.chaining = False

    def chain(self) -> None:
        self.chaining = True

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k4, v4 = self._blocks(k), self._blocks(v)
        if not self.chaining:
            self.base[layer], self.diagonal[layer] = (k4, v4), []
            return super().attend(layer, q, k, v)
        if layer not in self.base:
            raise RuntimeError(f"layer {layer}: a chain step needs that layer's causal pass first")
        self.diagonal[layer].append((k4, v4))
        return self._rows(self._chain_attention(self._blocks(q), layer))

    def _chain_attention(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """softmax over [base keys at <= p ; diagonal keys at p] for every query p, in fp32."""
        base_k, base_v = (_repeat_heads(t, q.shape[1]) for t in self.base[layer])
        diag = self.diagonal[layer]
        diag_k = torch.stack([_repeat_heads(k, q.shape[1]) for k, _ in diag], dim=-2)  # [B, H, S, r, D]
        diag_v = torch.stack([_repeat_heads(v, q.shape[1]) for _, v in diag], dim=-2)
        scale = q.shape[-1] ** -0.5
        base_scores = (q @ base_k.transpose(-1, -2)).float() * scale  # [B, H, S, S]
        seq = q.shape[2]
        later = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        base_scores = base_scores.masked_fill(later, float("-inf"))
        diag_scores = (q.unsqueeze(-2) * diag_k).sum(-1).float() * scale  # [B, H, S, r]
        probs = torch.cat([base_scores, diag_scores], dim=-1).softmax(dim=-1)
        out = probs[..., :seq].to(base_v.dtype) @ base_v
        out = out + (probs[..., seq:, None].to(diag_v.dtype) * diag_v).sum(-2)
        return out.to(q.dtype)


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: [B, KvH, S, D] -> [B, H, S, D]"""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)
