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

A chain step runs as one fused causal SDPA call, never as [B, heads, S, S] scores: the diagonal's r
keys are folded into one extra *sink* key at the front of every row, whose score for query p is
log sum_j exp(q_p . k_j) over that query's own diagonal keys, and whose value carries the sink's
attention weight out in an extra head dim. The softmax over [sink; base keys <= p] then gives each
base key exactly its weight in the softmax over [base keys <= p; diagonal keys], and the sink the
diagonal's total weight, which multiplies the diagonal's own softmax-weighted values. The result is
the dense computation's, rearranged (tests/test_train_draft.py compares values and gradients).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.attention.backend import AttentionContext

# Head dims appended for the sink: [D] and [D + 1] carry the sink's score into q . k (as a bf16 high
# and low part, so bf16 keeps it to ~16 bits), and value dim [D] carries the sink's weight out.
# Eight keep the head size a multiple of 8, which fused SDPA kernels need.
_EXTRA = 8


class CausalContext(AttentionContext):
    def __init__(self, batch: int, seq: int) -> None:
        self.batch, self.seq = batch, seq

    # Both contexts' `attend` stay eager under `--compile` (torch.compile of the step modules): their
    # per-layer Python state would otherwise become guards, and every chain depth its own graph.
    @torch.compiler.disable
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q4 = self._blocks(q)
        # KV heads repeated here rather than `enable_gqa`, which not every fused SDPA kernel takes.
        k4, v4 = (self._blocks(_repeat_heads(t, q.shape[1])) for t in (k, v))
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
        self.base: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # rows [B * S, KvH, D]
        self.diagonal: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        # Per layer, built on its first chain step and shared by the later ones: the base keys and
        # values with every head's KV repeated, the extra dims and the sink row, [B, H, 1 + S, D + 8].
        self.sinked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.chaining = False

    def causal(self) -> None:
        self.chaining = False

    def chain(self) -> None:
        self.chaining = True

    @torch.compiler.disable
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self.chaining:
            self.base[layer], self.diagonal[layer] = (k, v), []
            self.sinked.pop(layer, None)
            return super().attend(layer, q, k, v)
        if layer not in self.base:
            raise RuntimeError(f"layer {layer}: a chain step needs that layer's causal pass first")
        self.diagonal[layer].append((k, v))
        if layer not in self.sinked:
            self.sinked[layer] = self._sinked_base(*self.base[layer], heads=q.shape[1])
        return self._chain_attention(q, layer)

    def _sinked_base(self, k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        dim = k.shape[-1]
        sink_k = k.new_zeros(self.batch, heads, 1, dim + _EXTRA)
        sink_k[..., dim : dim + 2] = 1.0  # q . k_sink = the two score dims of q
        sink_v = v.new_zeros(self.batch, heads, 1, dim + _EXTRA)
        sink_v[..., dim] = 1.0  # output dim D = the sink's weight
        keys, values = (self._blocks(F.pad(_repeat_heads(t, heads), (0, _EXTRA))) for t in (k, v))
        return torch.cat([sink_k, keys], dim=2), torch.cat([sink_v, values], dim=2)

    def _chain_attention(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """softmax over [base keys at <= p ; diagonal keys at p] for every query row p."""
        rows, heads, dim = q.shape
        kv_heads = self.base[layer][0].shape[1]
        scale = dim**-0.5
        diag_k = torch.stack([k for k, _ in self.diagonal[layer]], dim=2)  # [T, KvH, r, D]
        diag_v = torch.stack([v for _, v in self.diagonal[layer]], dim=2)
        grouped = q.view(rows, kv_heads, heads // kv_heads, dim)  # query head h reads KV head h // G
        scores = (grouped @ diag_k.transpose(-1, -2)).float() * scale  # [T, KvH, G, r]
        log_weights = scores.log_softmax(-1)
        mixed = log_weights.exp().to(diag_v.dtype) @ diag_v  # the diagonal's values, by its own weights
        # The sink's score, over 1/scale: the log of the diagonal's total (unnormalised) weight, i.e.
        # logsumexp(scores), read off the log-softmax (one op, not logsumexp's several).
        carry = (scores[..., :1] - log_weights[..., :1]).view(rows, heads, 1) / scale
        high = carry.to(q.dtype)
        low = (carry - high.float()).to(q.dtype)
        padding = q.new_zeros(rows, heads, _EXTRA - 2)
        query = F.pad(self._blocks(torch.cat([q, high, low, padding], dim=-1)), (0, 0, 1, 0))
        keys, values = self.sinked[layer]
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale)
        out = self._rows(out[:, :, 1:])  # [T, H, D + 8], the sink's own query row dropped
        return out[..., :dim] + out[..., dim : dim + 1] * mixed.view(rows, heads, dim)


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: [T, KvH, D] -> [T, H, D], query head h reading KV head h // (H / KvH)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)
