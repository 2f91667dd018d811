"""The attention backend interface and the per-step batch layout every backend reads.

Each request's context is a list of token slots in the paged KV cache, indexed 0..seq_len-1;
this step's new tokens are its last `query_len` entries. Position (for RoPE) and context index are
kept apart so tree drafts can give several tokens the same position. Without a custom mask a new
token sees every earlier context entry and itself (causal); with one it sees the whole prefix plus
the new tokens its mask row allows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from specserve.engine.kv_cache import KVCache

if TYPE_CHECKING:
    from specserve.model.layers import RotaryEmbedding

# (x, residual or None, weight, eps) -> (weight * rms_norm(x + residual), x + residual)
AddRMSNorm = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]


class FusedLinear(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        norm: tuple[torch.Tensor, float] | None = None,
        residual: torch.Tensor | None = None,
        gated: bool = False,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class AttentionBatch:
    """Device tensors (and their host-side maxima) describing one step's batch."""

    query_start: torch.Tensor  # [B + 1] int64: cumulative query token counts
    seq_lens: torch.Tensor  # [B] int64: context length after this step's tokens are written
    slot_mapping: torch.Tensor  # [T] int64: KV slot each new token is written to
    page_table: torch.Tensor  # [B, max_pages] int64: context page -> cache page (padding: 0)
    page_size: int
    max_query_len: int
    max_seq_len: int
    # [B, max_query_len, max_query_len] bool, True where new token i may see new token j; None = causal.
    custom_mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]


class AttentionContext(ABC):
    """What the model calls once per layer; built by a backend for one step.

    Optional fusions, off by default (the model then runs its plain modules): a backend that
    applies RoPE inside its KV write sets `fuses_rotary`, and the model calls `attend_rotary` with
    the unrotated q/k; a backend that sets `add_rms_norm` has the decoder carry its residual stream
    as (x, residual) and run each residual add + RMSNorm through that function (and the MLP's
    activation through `silu_mul`, when set).
    """

    fuses_rotary: bool = False
    add_rms_norm: AddRMSNorm | None = None
    # gate_up [T, 2I] -> silu(gate) * up [T, I], for the MLPs of layers run with `add_rms_norm`.
    silu_mul: Callable[[torch.Tensor], torch.Tensor] | None = None
    # `specserve_kernels.fused_linear`'s signature: a backend that also sets this (with `add_rms_norm`)
    # has the decoder (at TP size 1) carry one stream through four matmuls per layer, each norm and
    # residual add fused into one (`DecoderLayer.forward_stream`).
    fused_linear: FusedLinear | None = None
    # With `fused_linear`: `attend_qkv` runs norm, q/k/v projection, RoPE and the KV write as one.
    fuses_qkv: bool = False

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write k/v [T, KvH, D] for the new tokens, attend with q [T, H, D]; returns [T, H, D]."""

    def attend_rotary(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
    ) -> torch.Tensor:
        """`attend` with q/k not yet rotated: RoPE at `positions` first (fused by backends that can)."""
        q, k = rope(positions, q, k)
        return self.attend(layer, q, k, v)

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
        """Backends that set `fuses_qkv`: RMSNorm(x) (`norm`: weight, eps) → the stacked q/k/v
        projection `weight` [(H + 2 KvH) * D, K] → RoPE → KV write → attention; returns [T, H, D]."""
        raise NotImplementedError


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def prepare(self, batch: AttentionBatch, kv: KVCache) -> AttentionContext:
        """Plan one step once (gather indices, masks) so every layer reuses it."""
