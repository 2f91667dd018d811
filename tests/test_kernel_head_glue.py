"""A head's chain-step and loop-extend glue (`kernels/head_glue.py`) against the torch references, bit for bit.

Chain steps: one-module heads (one row a request, fed its own last output) and MTP's fresh steps
(several rows, the previous module's tail first), active rows and rows past their steps (pad rows on
the dummy slot), drafts buffers in both layouts the callers pass (the draft graphs' [step, batch]
rows transposed, the head loop's [batch, k]), previous outputs as strided slices. The extend:
requests that took 0 .. q tokens, finished ones, tails as a strided slice of the chain bucket. Every
output and every buffer written in place is compared. On the CPU the kernels run under the Triton
interpreter (conftest sets TRITON_INTERPRET=1); the `gpu` variant runs them natively at serving
widths on fresh random inputs.
"""

from __future__ import annotations

import pytest
import torch

from specserve_kernels.head_glue import (
    chain_step_input,
    chain_step_input_ref,
    extend_settle,
    extend_settle_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ints(g: torch.Generator, low: int, high: int, *shape: int) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=g)


def _step_case(g, batch, step, rows, fresh, hidden, dtype, transposed, page_size=4, modules=3):
    """The inputs of chain step `step` (host tensors): (seeds, steps, base, table, drafts, first,
    previous) and the keyword arguments."""
    chain = step + 2
    seeds = _ints(g, 0, 500, batch)
    steps = _ints(g, 0, chain, batch)  # some rows past their steps: pad rows
    base = _ints(g, 0, 40, batch)
    pages = -(-(40 + chain + 1) // page_size)
    table = torch.randperm(batch * pages + 8, generator=g)[: batch * pages].view(batch, pages) + 1
    drafts = _ints(g, 0, 500, chain + 1, batch).t() if transposed else _ints(g, 0, 500, batch, chain + 1)
    tails = torch.randn(batch, modules, hidden, generator=g).to(dtype)
    if step == 1 and not fresh:
        previous = tails[:, :1]  # the seed's tail: a strided slice of the bucket
    else:
        previous_rows = rows - 1 if fresh else int(_ints(g, 1, 4, 1))
        previous = torch.randn(batch, max(previous_rows, 1) + 1, hidden, generator=g).to(dtype)
        previous = previous[:, 1:] if previous_rows else previous[:, :0]
    first = tails[:, min(step - 1, modules - 1)] if fresh else None
    kw = dict(step=step, rows=rows, page_size=page_size, dummy_slot=0)
    return [seeds, steps, base, table, drafts, first, previous], kw


def _to(tensors, device):
    return [None if t is None else t.to(device) for t in tensors]


def _check_step(args, kw) -> None:
    ours = _to(args, DEVICE)
    ref = [None if t is None else t.clone() for t in args]
    got = chain_step_input(*ours, **kw)
    want = chain_step_input_ref(*ref, **kw)
    for name, a, b in zip(want._fields, got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b), name
    assert torch.equal(ours[4].cpu(), ref[4]), "drafts (column 0: the seed)"


@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize(("step", "fresh"), [(1, False), (3, False), (1, True), (2, True), (3, True)])
def test_chain_step_matches_the_reference(step, fresh, transposed):
    g = torch.Generator().manual_seed(step * 10 + fresh + 2 * transposed)
    for batch, hidden, dtype in [(1, 24, torch.float32), (5, 40, torch.bfloat16), (3, 1100, torch.float32)]:
        rows = step if fresh else 1
        _check_step(*_step_case(g, batch, step, rows, fresh, hidden, dtype, transposed))


def _settle_case(g, batch, q, hidden, logits_size, dtype, modules=2):
    records = _ints(g, 0, 500, batch, q + 2)
    records[:, q] = _ints(g, 0, q + 1, batch)  # taken: 0 (done, pad) .. q
    lengths = _ints(g, 1, 60, batch)
    limits = lengths + _ints(g, -2, 6, batch)  # some done
    steps_left = _ints(g, 0, 6, batch)
    to_logits = torch.randn(batch * q, logits_size, generator=g).to(dtype)
    out = torch.randn(batch * q, hidden, generator=g).to(dtype)
    tails = torch.randn(batch + 1, modules, hidden, generator=g).to(dtype)[:batch, 0]
    base, steps = _ints(g, 0, 60, batch), _ints(g, 0, 6, batch)
    return [records, lengths, limits, steps_left, to_logits, out, tails, base, steps]


def _check_settle(args) -> None:
    ours = _to(args, DEVICE)
    ref = [t.clone() for t in args]
    selected, moved = extend_settle(*ours)
    want_selected, want_moved = extend_settle_ref(*ref)
    assert torch.equal(selected.cpu(), want_selected) and torch.equal(moved.cpu(), want_moved)
    for name, a, b in zip(("tails", "base", "steps"), ours[6:], ref[6:], strict=True):
        assert torch.equal(a.cpu(), b), name
    for name, a, b in zip(("records", "lengths", "limits"), ours[:3], ref[:3], strict=True):
        assert torch.equal(a.cpu(), b), f"{name} is read only"


@pytest.mark.parametrize(("batch", "q"), [(1, 2), (1, 5), (4, 4), (7, 3)])
def test_extend_settle_matches_the_reference(batch, q):
    g = torch.Generator().manual_seed(batch * 7 + q)
    for hidden, logits_size, dtype in [
        (24, 24, torch.float32),
        (40, 72, torch.bfloat16),
        (1100, 1100, torch.float32),
    ]:
        _check_settle(_settle_case(g, batch, q, hidden, logits_size, dtype))


def test_launchers_check_shapes():
    g = torch.Generator().manual_seed(0)
    args, kw = _step_case(g, 2, 2, 1, False, 16, torch.float32, True)
    args = _to(args, DEVICE)
    with pytest.raises(ValueError, match="rows"):
        chain_step_input(*args, **{**kw, "rows": 3})
    with pytest.raises(ValueError, match="drafts"):
        chain_step_input(*args[:4], args[4][:, :2], *args[5:], **kw)
    with pytest.raises(ValueError, match="seeds"):
        chain_step_input(args[0].int(), *args[1:], **kw)
    settle = _to(_settle_case(g, 3, 4, 16, 16, torch.float32), DEVICE)
    with pytest.raises(ValueError, match="to_logits"):
        extend_settle(*settle[:4], settle[4][:5], *settle[5:])
    with pytest.raises(ValueError, match="tails"):
        extend_settle(*settle[:6], settle[6][:, :8], *settle[7:])
    empty = chain_step_input(
        *_to(_step_case(g, 0, 1, 1, False, 16, torch.float32, False)[0], DEVICE), **kw | {"step": 1}
    )
    assert empty.hidden.shape == (0, 16) and empty.query_start.shape == (1,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_gpu_serving_widths(batch):
    """SmolLM2-135M's head width (576) in bf16, page size 16, fresh random inputs: both kernels
    natively against their references."""
    g = torch.Generator().manual_seed(batch)
    for step, fresh in [(1, False), (2, False), (3, True)]:
        rows = step if fresh else 1
        for transposed in (True, False):
            _check_step(
                *_step_case(g, batch, step, rows, fresh, 576, torch.bfloat16, transposed, page_size=16)
            )
    for q in (2, 4, 6):
        _check_settle(_settle_case(g, batch, q, 576, 576, torch.bfloat16))
