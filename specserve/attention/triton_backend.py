"""The Triton attention backend: the GPU fast path over the same paged KV cache as the torch backend.

Per layer it makes two launches (the keys split over programs for a small batch, merged in the same
launch): RoPE on q/k fused
with the KV write (`specserve_kernels.rope_store`), then paged attention straight over the cache
pages (`specserve_kernels.paged_attention`: prefill, decode and verify, causal or a tree mask). It
also hands the decoder the fused residual-add + RMSNorm (`specserve_kernels.rms_norm`), so each
layer's two norms are one launch each too, and the MLP's fused silu(gate) * up (`specserve_kernels.silu_mul`).
Steps of at most `fused_linear_tokens` tokens can go further: the decoder carries one residual
stream through four matmuls per layer with each norm, the activation and each residual add fused
in, the first of them also applying RoPE and writing the KV cache (`specserve_kernels.fused_linear`),
so a layer is those four plus attention. On by default for steps of at most 16 tokens
(`FUSED_LINEAR_TOKENS`): decode at small batch and the verifies of chains and small trees. At 1-4
tokens the matmuls take the kernels' GEMV form (`blocks_for`: many programs, each a few output
columns over the whole K; SPECSERVE_GEMV_ROWS): on an H100 a layer's four matmuls took 13.2 us at
one token against 27.9 for cuBLAS with the separate kernels, and a batch-1 decode step's graph
0.65 ms against 0.99. At 5-16 tokens they take the sizes a GPU sweep found fastest
(`specserve_kernels.gemv_sizes`): 19-20 us a layer against 27.3, a batch-1 verify graph of 6-16
tokens 0.89-0.92 ms against 1.02-1.04 (`scripts/bench_gemv.py`, `scripts/profile_verify.py`,
docs/benchmarks.md). Larger steps stay on cuBLAS. The table holds SmolLM2-135M's shapes; another
model's 5-16-token steps take the tile form's rule sizes, unmeasured against cuBLAS: sweep its
shapes (`scripts/bench_gemv.py`) or set SPECSERVE_FUSED_LINEAR_TOKENS=4.

Kernels run natively on CUDA. On the CPU the context calls each kernel's plain-torch reference
instead, unless SPECSERVE_TRITON_CPU=1 asks for the kernels under the Triton interpreter (see
`specserve_kernels.use_triton`).

Planning is host-only: `prepare` reads no device value, and the launch grid depends on the batch
size, `max_query_len` and the number of key splits alone (the kernels read every length from the
device tensors).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from specserve.attention.backend import AttentionBackend, AttentionBatch, AttentionContext
from specserve.engine.kv_cache import KVCache
from specserve_kernels import use_triton
from specserve_kernels.fused_linear import (
    QKVLayout,
    fused_linear,
    fused_linear_ref,
    qkv_rope_store,
    qkv_rope_store_ref,
)
from specserve_kernels.paged_attention import num_splits, paged_attention, paged_attention_ref
from specserve_kernels.rms_norm import add_rms_norm, add_rms_norm_ref
from specserve_kernels.rope_store import rope_kv_store, rope_kv_store_ref
from specserve_kernels.silu_mul import silu_mul, silu_mul_ref

if TYPE_CHECKING:
    from specserve.model.layers import RotaryEmbedding

# Steps up to this many tokens run the fused matmuls. At 1-4 tokens they take the GEMV form, which on
# an H100 cut a layer's four matmuls from 27.9 to 13.2 us and a batch-1 decode step's graph from 0.99
# to 0.65 ms; at 5-16 tokens (verifies) the sizes a sweep found fastest (kernels/gemv_sizes.json: the
# tile form with short K chunks, the q/k/v GEMV with every row at once), 19-20 us a layer against
# 27.3 for cuBLAS with its separate kernels, which cut a batch-1 verify graph of 6-16 tokens from
# 1.02-1.04 to 0.89-0.92 ms (docs/benchmarks.md). SPECSERVE_FUSED_LINEAR_TOKENS sets it (0: never),
# so a GPU run can time both paths from one copy of the code.
FUSED_LINEAR_TOKENS = int(os.environ.get("SPECSERVE_FUSED_LINEAR_TOKENS", "16"))


class TritonAttentionContext(AttentionContext):
    fuses_rotary = True

    def __init__(
        self,
        batch: AttentionBatch,
        layers: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
        kernels: bool,
        fused_norm: bool,
        splits: int | None = None,
        fused_linear_tokens: int = 0,
    ) -> None:
        self.batch = batch
        self.k_layers, self.v_layers = layers
        self.store = rope_kv_store if kernels else rope_kv_store_ref
        self.attention = paged_attention if kernels else paged_attention_ref
        if fused_norm:
            self.add_rms_norm = add_rms_norm if kernels else add_rms_norm_ref
            self.silu_mul = silu_mul if kernels else silu_mul_ref
            if batch.slot_mapping.shape[0] <= fused_linear_tokens:
                self.fused_linear = fused_linear if kernels else fused_linear_ref
                self.fuses_qkv = True
                self.qkv_rope_store = qkv_rope_store if kernels else qkv_rope_store_ref
        self.splits = splits  # None: chosen at the first layer, once the head counts are known

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.store(q, k, v, self.k_layers[layer], self.v_layers[layer], self.batch.slot_mapping)
        return self._attend(layer, q)

    def attend_rotary(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
    ) -> torch.Tensor:
        k_cache, v_cache = self.k_layers[layer], self.v_layers[layer]
        q = self.store(q, k, v, k_cache, v_cache, self.batch.slot_mapping, positions, rope.cos, rope.sin)
        return self._attend(layer, q)

    def attend_qkv(
        self,
        layer: int,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        norm: tuple[torch.Tensor, float] | None,
        num_heads: int,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
    ) -> torch.Tensor:
        k_cache = self.k_layers[layer]
        qkv = QKVLayout(
            num_heads,
            k_cache.shape[1],
            k_cache,
            self.v_layers[layer],
            self.batch.slot_mapping,
            positions,
            rope.cos,
            rope.sin,
        )
        return self._attend(layer, self.qkv_rope_store(x, weight, qkv, bias=bias, norm=norm))

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        b, k_cache = self.batch, self.k_layers[layer]
        if self.splits is None:
            kv_heads = k_cache.shape[1]
            group = q.shape[1] // kv_heads
            self.splits = num_splits(b.batch_size, b.max_query_len, b.max_seq_len, kv_heads, group, q.device)
        return self.attention(q, k_cache, self.v_layers[layer], b, splits=self.splits)


class TritonAttentionBackend(AttentionBackend):
    """`fused_norm`: also hand the decoder layers the fused residual-add + RMSNorm; and, for steps of
    at most `fused_linear_tokens` tokens, the matmuls with the norms and adds fused in (where a step
    is bound by launches: decode and verify batches; larger steps keep cuBLAS). `splits` fixes the
    number of key slices per attention program (None: chosen per step from the batch shape)."""

    name = "triton"

    def __init__(
        self,
        fused_norm: bool = True,
        splits: int | None = None,
        fused_linear_tokens: int = FUSED_LINEAR_TOKENS,
    ) -> None:
        self.fused_norm, self.splits, self.fused_linear_tokens = fused_norm, splits, fused_linear_tokens
        self._kv: KVCache | None = None
        self._layers: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] = ((), ())

    def prepare(self, batch: AttentionBatch, kv: KVCache) -> AttentionContext:
        if kv is not self._kv:  # one view per layer, made once per cache rather than per call
            self._kv, self._layers = kv, (kv.k.unbind(0), kv.v.unbind(0))
        kernels = use_triton(kv.k.device)
        return TritonAttentionContext(
            batch, self._layers, kernels, self.fused_norm, self.splits, self.fused_linear_tokens
        )
