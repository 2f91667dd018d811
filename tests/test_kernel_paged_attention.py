"""Paged attention (prefill, decode, verify, tree) against its torch reference and the torch backend.

Fresh random inputs per case: ragged batches, GQA and plain MHA, page sizes 1 and 16 with pages
scattered over the pool, fp32 and bf16, with and without split-K. Every slot no request may read
holds NaN, so a read past a request's seq_len shows up as NaN in the output.
On the CPU the kernel runs under TRITON_INTERPRET=1 (conftest.py); on a GPU, natively.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from specserve.attention.backend import AttentionBatch
from specserve.attention.torch_backend import TorchAttentionBackend
from specserve.engine.kv_cache import KVCache
from specserve_kernels.paged_attention import paged_attention, paged_attention_ref, split_counters

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [slots, KvH, D]
    v_cache: torch.Tensor
    batch: AttentionBatch

    def args(self) -> tuple:
        return self.q, self.k_cache, self.v_cache, self.batch


def make_case(
    prefixes: list[int],
    news: list[int],
    heads: int,
    kv_heads: int,
    dim: int,
    page_size: int,
    dtype: torch.dtype,
    tree: bool = False,
    seed: int = 0,
    device: str = DEVICE,
) -> PagedCase:
    """Requests with `prefixes[b]` cached tokens and `news[b]` new ones (already written to the cache,
    as the backend does before attending), on randomly scattered pages; every other slot is NaN."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefixes, news, strict=True)]
    pages_needed = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(pages_needed) + 3
    slots = num_pages * page_size
    k_cache = torch.full((slots, kv_heads, dim), float("nan"))
    v_cache = torch.full((slots, kv_heads, dim), float("nan"))
    k_cache[:page_size] = 0.0  # the dummy page, as KVCache.allocate leaves it
    v_cache[:page_size] = 0.0
    free = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    width = max(pages_needed) + 1  # a padding column past every request's pages
    page_table = torch.zeros(len(seq_lens), width, dtype=torch.int64)
    slot_mapping = []
    for b, (seq_len, n) in enumerate(zip(seq_lens, news, strict=True)):
        pages = [free.pop() for _ in range(pages_needed[b])]
        page_table[b, : len(pages)] = torch.tensor(pages)
        ctx = torch.arange(seq_len)
        ctx_slots = page_table[b, ctx // page_size] * page_size + ctx % page_size
        k_cache[ctx_slots] = torch.randn(seq_len, kv_heads, dim, generator=g)
        v_cache[ctx_slots] = torch.randn(seq_len, kv_heads, dim, generator=g)
        slot_mapping.append(ctx_slots[seq_len - n :])
    max_q = max(news)
    mask = None
    if tree:
        causal = torch.tril(torch.ones(max_q, max_q, dtype=torch.bool))
        mask = (torch.rand(len(news), max_q, max_q, generator=g) < 0.5) & causal
        mask |= torch.eye(max_q, dtype=torch.bool)
    q = torch.randn(sum(news), heads, dim, generator=g)
    starts = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()])
    batch = AttentionBatch(
        query_start=starts.to(device),
        seq_lens=torch.tensor(seq_lens).to(device),
        slot_mapping=torch.cat(slot_mapping).to(device),
        page_table=page_table.to(device),
        page_size=page_size,
        max_query_len=max_q,
        max_seq_len=max(seq_lens),
        custom_mask=None if mask is None else mask.to(device),
    )
    return PagedCase(q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype), batch)


def torch_backend_out(case: PagedCase) -> torch.Tensor:
    """The reference backend over the same cache (its attend rewrites the new tokens' K/V unchanged)."""
    b = case.batch
    kv = KVCache(case.k_cache[None].clone(), case.v_cache[None].clone(), b.page_size)
    k_new, v_new = kv.k[0, b.slot_mapping].clone(), kv.v[0, b.slot_mapping].clone()
    return TorchAttentionBackend().prepare(b, kv).attend(0, case.q, k_new, v_new)


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: within 1e-5 (relative, with an absolute floor for values near zero); bf16: 2e-2 absolute."""
    assert torch.isfinite(out).all(), "NaN/inf in the output: a slot past a request's context was read"
    tol = dict(rtol=1e-5, atol=1e-5) if out.dtype == torch.float32 else dict(rtol=0.0, atol=2e-2)
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), **tol)


SHAPES = {  # mode -> (prefixes, new tokens, heads, KV heads, head_dim)
    "prefill": ([0, 13, 3], [25, 9, 1], 6, 2, 32),  # ragged (75 rows: the 128-row tile), one past a prefix
    "decode": ([40, 4, 62], [1, 1, 1], 9, 3, 64),  # SmolLM2's heads
    "verify": ([30, 2], [5, 5], 4, 4, 16),  # k + 1 = 5 causal rows, plain MHA
    "tree": ([20, 0, 9], [5, 3, 4], 8, 2, 64),  # a tree mask among the new tokens
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", list(SHAPES))
def test_matches_reference_and_torch_backend(mode, page_size, dtype):
    prefixes, news, heads, kv_heads, dim = SHAPES[mode]
    case = make_case(
        prefixes, news, heads, kv_heads, dim, page_size, dtype, tree=mode == "tree", seed=page_size
    )
    ref = paged_attention_ref(*case.args())
    for splits in (None, 3):  # None: the heuristic (one slice on the CPU); 3 slices, some empty
        assert_matches(paged_attention(*case.args(), splits=splits), ref)
    assert_matches(paged_attention(*case.args()), torch_backend_out(case))
    # The merge's tickets went back to zero: the next split launch (here, the same again) counts
    # from zero, and gives the same result.
    assert not split_counters(1, case.q.device).any()
    assert torch.equal(paged_attention(*case.args(), splits=3), paged_attention(*case.args(), splits=3))


def test_rows_that_see_nothing_give_zeros_and_padding_requests_are_skipped():
    """A tree row with no visible key (no prefix, its own bit cleared) gives zeros, not NaN; a request
    with no new tokens (a padded batch slot) is skipped."""
    case = make_case([0, 6], [3, 2], 4, 2, 16, 1, torch.float32, tree=True, seed=3)
    mask = case.batch.custom_mask.clone()
    mask[0, 1] = False  # token 1 of request 0 sees nothing
    layout = dataclasses.replace(case.batch, custom_mask=mask)
    out = paged_attention(case.q, case.k_cache, case.v_cache, layout)
    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, layout)
    assert_matches(out, ref)
    assert out[1].abs().max().item() == 0.0
    # Request 1 gets no new tokens: its rows vanish from the batch, the rest is unchanged.
    device = layout.query_start.device
    padded = dataclasses.replace(
        layout,
        query_start=torch.tensor([0, 3, 3], device=device),
        seq_lens=torch.tensor([3, 6], device=device),
    )
    assert_matches(paged_attention(case.q[:3], case.k_cache, case.v_cache, padded), ref[:3])


def test_shape_errors_name_the_argument():
    case = make_case([2], [1], 4, 2, 16, 1, torch.float32)
    q, k, v, layout = case.args()
    with pytest.raises(ValueError, match="q"):
        paged_attention(q[0], k, v, layout)
    with pytest.raises(ValueError, match="KV heads"):
        paged_attention(q[:, :3], k, v, layout)
    with pytest.raises(ValueError, match="dtypes"):
        paged_attention(q.double(), k, v, layout)
    with pytest.raises(ValueError, match="query_start"):
        paged_attention(q, k, v, dataclasses.replace(layout, query_start=layout.query_start[:1]))
    with pytest.raises(ValueError, match="custom_mask"):
        paged_attention(q, k, v, dataclasses.replace(layout, custom_mask=torch.ones(1, 1, 1)))
