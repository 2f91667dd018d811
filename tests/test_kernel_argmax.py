"""The split argmax of greedy drafts (kernels/row_argmax.py) against torch.argmax: random rows, ties
across chunks, masked chunks, bf16 rows, strided rows; the in-place form (`out`, mapped through
`table`, kept where `keep` is unset) against its reference. TRITON_INTERPRET=1 on the CPU, native
on a GPU."""

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


def _check_in_place(g: torch.Generator, rows: int, vocab: int, chunk: int, stride: int) -> None:
    """`out` a strided column (a drafts buffer's), `table` a draft-to-target map, `keep` some rows."""
    logits = torch.randn(rows, vocab, generator=g) * 4
    table = torch.randperm(vocab * 3, generator=g)[:vocab]
    keep = torch.rand(rows, generator=g) < 0.6
    buffer = torch.randint(0, 1000, (rows, stride), generator=g)
    for t, k in [(None, None), (table, None), (table, keep), (None, keep)]:
        ours = buffer.to(DEVICE)
        args = dict(table=None if t is None else t.to(DEVICE), keep=None if k is None else k.to(DEVICE))
        got = row_argmax(logits.to(DEVICE), chunk=chunk, out=ours[:, 1], **args)
        want = buffer.clone()
        row_argmax_ref(logits, out=want[:, 1], table=t, keep=k)
        assert got.data_ptr() == ours[:, 1].data_ptr()
        assert torch.equal(ours.cpu(), want), (t is not None, k is not None)
    assert torch.equal(
        row_argmax(logits.to(DEVICE), chunk=chunk, table=table.to(DEVICE)).cpu(), table[logits.argmax(1)]
    )


@pytest.mark.parametrize(
    ("rows", "vocab", "chunk", "stride"), [(1, 7, 256, 2), (5, 1000, 256, 4), (9, 4099, 512, 3)]
)
def test_in_place_mapped_and_kept(rows, vocab, chunk, stride):
    _check_in_place(torch.Generator().manual_seed(rows + vocab), rows, vocab, chunk, stride)
    with pytest.raises(ValueError, match="keep"):
        row_argmax(torch.zeros(2, 5, device=DEVICE), keep=torch.ones(2, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="out"):
        row_argmax(torch.zeros(2, 5, device=DEVICE), out=torch.zeros(3, dtype=torch.int64, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_gpu_in_place_draft_vocabulary(rows):
    """EAGLE-3's 32k draft vocabulary onto SmolLM2's 49k ids, fresh random rows."""
    _check_in_place(torch.Generator().manual_seed(rows), rows, 32000, 1024, 5)
