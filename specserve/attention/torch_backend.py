"""Plain-torch attention over the paged KV cache: the reference every faster backend is tested against.

It gathers each request's context into a padded [B, S, KvH, D] block and runs SDPA with a boolean
mask built once per step. Simple and exact; the Triton backend replaces the gather on GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specserve.attention.backend import AttentionBackend, AttentionBatch, AttentionContext
from specserve.engine.kv_cache import KVCache

# Never cuDNN: it builds a plan for every new shape, and these shapes change every step (the context
# length grows). On the H100 an EAGLE-3 tree draft over new lengths took 320 ms a step with it, the
# same steps again (plans cached) 20 ms.
_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class TorchAttentionContext(AttentionContext):
    def __init__(self, batch: AttentionBatch, kv: KVCache) -> None:
        self.kv = kv
        self.slot_mapping = batch.slot_mapping
        self.key_slots = _context_slots(batch)  # [B, S]
        self.query_index, query_valid = _query_layout(batch)  # [B, Q]
        self.mask = _attention_mask(batch, query_valid)  # [B, 1, Q, S]
        self.output_rows = _output_rows(batch)  # [T] row of each token in the padded [B*Q] output

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.kv.k[layer, self.slot_mapping] = k
        self.kv.v[layer, self.slot_mapping] = v
        keys = self.kv.k[layer][self.key_slots].transpose(1, 2)  # [B, KvH, S, D]
        values = self.kv.v[layer][self.key_slots].transpose(1, 2)
        queries = q[self.query_index].transpose(1, 2)  # [B, H, Q, D]
        if q.is_cuda:
            with sdpa_kernel(_SDPA_BACKENDS):
                out = F.scaled_dot_product_attention(
                    queries, keys, values, attn_mask=self.mask, enable_gqa=True
                )
        else:  # the CPU has no cuDNN to avoid; entering the context costs every call
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=self.mask, enable_gqa=True)
        out = out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])  # [B*Q, H, D]
        return out.index_select(0, self.output_rows)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prepare(self, batch: AttentionBatch, kv: KVCache) -> AttentionContext:
        return TorchAttentionContext(batch, kv)


def _context_slots(batch: AttentionBatch) -> torch.Tensor:
    """KV slot of every context entry of every request, [B, max_seq_len] (padding reads slot 0)."""
    index = torch.arange(batch.max_seq_len, device=batch.seq_lens.device)
    pages = batch.page_table[:, index // batch.page_size]
    slots = pages * batch.page_size + index % batch.page_size
    return torch.where(index < batch.seq_lens[:, None], slots, torch.zeros_like(slots))


def _query_layout(batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat token index of each (request, query row), and which rows are real."""
    rows = torch.arange(batch.max_query_len, device=batch.seq_lens.device)
    query_lens = batch.query_start[1:] - batch.query_start[:-1]
    valid = rows < query_lens[:, None]
    index = torch.where(valid, batch.query_start[:-1, None] + rows, torch.zeros_like(rows))
    return index, valid


def _output_rows(batch: AttentionBatch) -> torch.Tensor:
    """Index into the padded [B * max_query_len] output for every real token (no host sync: T is known)."""
    total = int(batch.slot_mapping.shape[0])
    device = batch.seq_lens.device
    query_lens = batch.query_start[1:] - batch.query_start[:-1]
    owner = torch.repeat_interleave(
        torch.arange(batch.batch_size, device=device), query_lens, output_size=total
    )
    within = torch.arange(total, device=device) - batch.query_start[owner]
    return owner * batch.max_query_len + within


def _attention_mask(batch: AttentionBatch, query_valid: torch.Tensor) -> torch.Tensor:
    device = batch.seq_lens.device
    query_lens = batch.query_start[1:] - batch.query_start[:-1]
    prefix_lens = batch.seq_lens - query_lens  # context entries before this step's tokens
    rows = torch.arange(batch.max_query_len, device=device)
    cols = torch.arange(batch.max_seq_len, device=device)
    in_prefix = cols[None, None, :] < prefix_lens[:, None, None]
    new_col = cols[None, None, :] - prefix_lens[:, None, None]  # index among new tokens
    if batch.custom_mask is None:
        among_new = (new_col >= 0) & (new_col <= rows[None, :, None])
    else:
        gathered = torch.gather(
            batch.custom_mask,
            2,
            new_col.clamp(0, batch.max_query_len - 1).expand(-1, batch.max_query_len, -1),
        )
        among_new = (new_col >= 0) & (new_col < query_lens[:, None, None]) & gathered
    mask = (in_prefix | among_new) & query_valid[:, :, None]
    # Padding query rows see slot 0 only, so SDPA never normalises an empty row into NaN.
    mask[:, :, 0] |= ~query_valid
    return mask.unsqueeze(1)
