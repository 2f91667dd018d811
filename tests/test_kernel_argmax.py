"""The split argmax of greedy drafts (kernels/row_argmax.py) against torch.argmax: random rows, ties
across chunks, masked chunks, bf16 rows, strided rows. TRITON_INTERPRET=1 on the CPU, native on a GPU."""

from __future__ import annotations

import pytest
import torch

from specserve_kernels.argmax import row_argmax, row_argmax_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(logits: torch.Tensor, chunk: int = 256) -> None:
    got = row_argmax(logits.to(DEVICE), chunk=chunk)
    assert got.dtype == torch.int64
    assert got.cpu().tolist() == row_argmax_ref(logits.float()).tolist()


@pytest.mark.parametrize(
    ("rows", "vocab", "chunk"), [(1, 7, 256), (3, 1000, 256), (5, 4099, 512), (2, 49152, 1024)]
)
def test_random_rows(rows, vocab, chunk):
    g = torch.Generator().manual_seed(rows * vocab)
    _check(torch.randn(rows, vocab, generator=g) * 4, chunk)


def test_ties_and_masks():
    logits = torch.zeros(5, 600)
    logits[0, [5, 300, 599]] = 2.0  # equal maxima in different chunks
    logits[1, [255, 256]] = 2.0  # straddling a chunk edge
    logits[3] = float("-inf")  # nothing finite: index 0, as torch.argmax
    logits[4, :520] = float("-inf")  # the first chunks fully masked
    logits[4, 560] = 1.0
    _check(logits)  # row 2: all equal -> 0


def test_bf16_strided_rows_and_shape_errors():
    g = torch.Generator().manual_seed(2)
    wide = (torch.randn(3, 1030, generator=g) * 3).bfloat16()
    _check(wide[:, :1000])  # rows with a stride past their length
    _check(wide[:, :1000].float())
    with pytest.raises(ValueError, match="logits"):
        row_argmax(torch.zeros(3, device=DEVICE))
    assert row_argmax(torch.zeros(0, 5, device=DEVICE)).shape == (0,)
