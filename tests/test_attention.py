"""The torch attention backend over paged KV against a dense, per-request, loop-by-loop reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specserve.attention.backend import AttentionBatch
from specserve.attention.torch_backend import TorchAttentionBackend
from specserve.engine.kv_cache import KVCache
from specserve.model.arch import ModelArch

HEADS, KV_HEADS, DIM = 4, 2, 8


def _reference(q, keys, values, prefix, mask):
    """One request: q [n, H, D], keys/values [prefix + n, KvH, D], mask [n, n] among the new tokens."""
    out = torch.empty_like(q)
    group = HEADS // KV_HEADS
    for i in range(q.shape[0]):
        visible = [j for j in range(keys.shape[0]) if j < prefix or mask[i, j - prefix]]
        for h in range(HEADS):
            k, v = keys[visible, h // group], values[visible, h // group]
            weights = torch.softmax(k @ q[i, h] / math.sqrt(DIM), dim=0)
            out[i, h] = weights @ v
    return out


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("tree", [False, True])
def test_paged_attention_matches_dense_reference(page_size, tree):
    g = torch.Generator().manual_seed(page_size * 10 + tree)
    arch = ModelArch(
        vocab_size=8,
        hidden_size=HEADS * DIM,
        intermediate_size=8,
        num_layers=1,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
    )
    kv = KVCache.allocate(
        arch, num_pages=64, page_size=page_size, dtype=torch.float64, device=torch.device("cpu")
    )
    prefixes, news = [0, 5, 11], [6, 1, 4]  # a prefill, a decode, a chunk after a prefix
    free_pages = list(np.random.default_rng(0).permutation(np.arange(1, 64)))  # scattered pages
    rows, slots, dense, masks = [], [], [], []
    for prefix, n in zip(prefixes, news, strict=True):
        total = prefix + n
        pages = [int(free_pages.pop()) for _ in range(-(-total // page_size))]
        ctx_slots = [pages[j // page_size] * page_size + j % page_size for j in range(total)]
        keys = torch.randn(total, KV_HEADS, DIM, generator=g, dtype=torch.float64)
        values = torch.randn(total, KV_HEADS, DIM, generator=g, dtype=torch.float64)
        kv.k[0, ctx_slots[:prefix]] = keys[:prefix]  # earlier steps wrote the prefix
        kv.v[0, ctx_slots[:prefix]] = values[:prefix]
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
        mask = (
            causal & (torch.rand(n, n, generator=g) < 0.6) | torch.eye(n, dtype=torch.bool)
            if tree
            else causal
        )
        rows.append(pages)
        slots.extend(ctx_slots[prefix:])
        dense.append((keys, values))
        masks.append(mask)
    q = torch.randn(sum(news), HEADS, DIM, generator=g, dtype=torch.float64)
    k_new = torch.cat([k[p:] for (k, _), p in zip(dense, prefixes, strict=True)])
    v_new = torch.cat([v[p:] for (_, v), p in zip(dense, prefixes, strict=True)])
    width, qmax = max(len(r) for r in rows), max(news)
    custom = torch.zeros(len(news), qmax, qmax, dtype=torch.bool)
    for b, m in enumerate(masks):
        custom[b, : m.shape[0], : m.shape[1]] = m
    batch = AttentionBatch(
        query_start=torch.tensor(np.concatenate([[0], np.cumsum(news)])),
        seq_lens=torch.tensor([p + n for p, n in zip(prefixes, news, strict=True)]),
        slot_mapping=torch.tensor(slots),
        page_table=torch.tensor([r + [0] * (width - len(r)) for r in rows]),
        page_size=page_size,
        max_query_len=qmax,
        max_seq_len=max(p + n for p, n in zip(prefixes, news, strict=True)),
        custom_mask=custom if tree else None,
    )
    out = TorchAttentionBackend().prepare(batch, kv).attend(0, q, k_new, v_new)
    start = 0
    for b, (prefix, n) in enumerate(zip(prefixes, news, strict=True)):
        keys, values = dense[b]
        expected = _reference(q[start : start + n], keys, values, prefix, masks[b])
        torch.testing.assert_close(out[start : start + n], expected, rtol=1e-10, atol=1e-10)
        start += n
    # The new tokens' K/V landed in their slots.
    torch.testing.assert_close(kv.k[0, slots], k_new)
