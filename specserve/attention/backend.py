"""The attention backend interface and the per-step batch layout every backend reads.

Each request's context is a list of token slots in the paged KV cache, indexed 0..seq_len-1;
this step's new tokens are its last `query_len` entries. Position (for RoPE) and context index are
kept apart so tree drafts can give several tokens the same position. Without a custom mask a new
token sees every earlier context entry and itself (causal); with one it sees the whole prefix plus
the new tokens its mask row allows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specserve.engine.kv_cache import KVCache


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
    """What the model calls once per layer; built by a backend for one step."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write k/v [T, KvH, D] for the new tokens, attend with q [T, H, D]; returns [T, H, D]."""


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def prepare(self, batch: AttentionBatch, kv: KVCache) -> AttentionContext:
        """Plan one step once (gather indices, masks) so every layer reuses it."""
