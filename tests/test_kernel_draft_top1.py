"""The fused top-1 draft kernel against softmax + argmax: random and adversarial logits.

On the CPU it runs under TRITON_INTERPRET=1 (conftest.py sets it before triton is imported); on a
GPU, natively.
"""

from __future__ import annotations

import pytest
import torch

from specserve_kernels.draft_top1 import draft_top1, draft_top1_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(logits: torch.Tensor, block: int = 256) -> None:
    tokens, probs = draft_top1(logits.to(DEVICE), block=block)
    ref_tokens, ref_probs = draft_top1_ref(logits.double())
    assert tokens.cpu().tolist() == ref_tokens.tolist()
    torch.testing.assert_close(probs.cpu().double(), ref_probs.double(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("rows", "vocab"), [(1, 7), (3, 1000), (5, 4099)])
def test_random_logits(rows, vocab):
    g = torch.Generator().manual_seed(rows * vocab)
    _check(torch.randn(rows, vocab, generator=g) * 4)


def test_ties_pick_the_lowest_id_across_blocks():
    logits = torch.zeros(3, 600)
    logits[0, [5, 300, 599]] = 2.0  # equal maxima in different blocks
    logits[1, [299, 300]] = 2.0  # straddling a block edge
    _check(logits)  # row 2: all equal, p = 1/600


def test_huge_magnitudes_and_masks():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 700, generator=g) * 1e4
    logits[1] = torch.full((700,), float("-inf"))
    logits[1, 650] = -3e38  # one finite token left: p = 1
    logits[2, :400] = float("-inf")  # the first blocks fully masked
    logits[3, 1::2] = float("-inf")
    _check(logits)
    tokens, probs = draft_top1(logits.to(DEVICE), block=256)
    assert tokens[1].item() == 650 and probs[1].item() == 1.0


def test_probability_is_not_assumed_one():
    logits = torch.tensor([[2.0, 2.0, 1.0, -1.0]])
    _, probs = draft_top1(logits.to(DEVICE), block=256)
    assert 0.4 < probs.item() < 0.5


def test_bf16_input_and_shape_errors():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 513, generator=g) * 3).bfloat16()
    tokens, probs = draft_top1(logits.to(DEVICE), block=256)
    ref_tokens, ref_probs = draft_top1_ref(logits.float())
    assert tokens.cpu().tolist() == ref_tokens.tolist()
    torch.testing.assert_close(probs.cpu(), ref_probs, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="logits"):
        draft_top1(torch.zeros(3))
