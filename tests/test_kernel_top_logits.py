"""`kernels/top_logits.py` against its torch reference and, on ties, against a stable sort: a row's
log-sum-exp, its top k logits and their ids (ties to the lower id), over one slice or several."""

from __future__ import annotations

import pytest
import torch

from specserve_kernels.top_logits import MAX_K, top_logits, top_logits_ref

# The kernel runs on the GPU, or on the CPU under the Triton interpreter where there is none.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("rows", "vocab", "k"), [(1, 96, 1), (3, 1000, 8), (2, 9000, 5), (5, 4096, 32)])
def test_top_logits_equal_the_reference(rows, vocab, k, device=DEVICE):
    gen = torch.Generator().manual_seed(rows * vocab + k)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(device)
    lse, top, ids = top_logits(logits, k)
    ref_lse, ref_top, ref_ids = top_logits_ref(logits, k)
    assert torch.equal(ids, ref_ids) and torch.equal(top, ref_top)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-5)


def test_ties_go_to_the_lower_id_and_masked_entries_last(device=DEVICE):
    """Integer logits tie a lot (as bf16 logits do): the order is a stable sort's, across slices;
    -inf entries come only after every finite one, and a bf16 row reads as its fp32 values."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 6, (4, 9000), generator=gen).float()
    logits[1, 100:] = float("-inf")  # 100 finite entries
    logits[2] = float("-inf")
    logits[2, [7, 8500, 4100]] = torch.tensor([1.0, 3.0, 1.0])
    k = 8
    lse, top, ids = top_logits(logits.to(device), k)
    order = torch.sort(logits, dim=-1, descending=True, stable=True)
    for r in (0, 1, 3):
        assert ids[r].tolist() == order.indices[r, :k].tolist()
        assert top[r].tolist() == order.values[r, :k].tolist()
    assert ids[2, :3].tolist() == [8500, 7, 4100] and top[2, 3:].eq(float("-inf")).all()
    torch.testing.assert_close(lse.cpu(), torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-5)
    half = logits.to(torch.bfloat16)[:, :1500]
    _, top_h, ids_h = top_logits(half.to(device), k)
    stable = torch.sort(half.float(), dim=-1, descending=True, stable=True)
    assert ids_h.cpu().tolist() == stable.indices[:, :k].tolist()


def test_k_out_of_range_is_refused():
    logits = torch.zeros(2, 40)
    for k in (0, 41, MAX_K + 1):
        with pytest.raises(ValueError, match="k: expected"):
            top_logits(logits if k < 41 else torch.zeros(2, 100), k)
