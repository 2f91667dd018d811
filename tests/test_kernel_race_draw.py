"""The one-pass sampling race (`kernels/race_draw.py`) against its torch statement: the same draws,
token for token, with and without a dropped token, over vocabularies split into slices.

On the CPU it runs under TRITON_INTERPRET=1 (conftest.py sets it before triton is imported); on a
GPU, natively.
"""

from __future__ import annotations

import pytest
import torch

from specserve.engine.sampler import uniform_noise
from specserve_kernels.race_draw import race_draw, race_draw_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(rows: int, vocab: int, seed: int, sharpness: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(rows, vocab, generator=g) * sharpness, dim=-1)
    keys = torch.randint(0, 2**32, (rows,), generator=g, dtype=torch.int64)
    drop = torch.where(torch.rand(rows, generator=g) < 0.7, probs.argmax(dim=-1), -1)
    return probs, keys, drop


def _check(probs, keys, drop=None, block: int = 128) -> torch.Tensor:
    on = [t.to(DEVICE) if t is not None else None for t in (probs, keys, drop)]
    got = race_draw(*on, block=block).cpu()
    assert got.tolist() == race_draw_ref(probs, keys, drop).tolist()
    return got


@pytest.mark.parametrize(("rows", "vocab"), [(1, 7), (3, 1000), (40, 333), (5, 4099)])
def test_random_rows(rows, vocab):
    probs, keys, drop = _inputs(rows, vocab, seed=rows + vocab)
    _check(probs, keys)
    got = _check(probs, keys, drop)
    dropped = drop >= 0
    assert not (got[dropped] == drop[dropped]).any(), "a dropped token is never drawn while others have mass"


def test_the_reference_is_the_samplers_race():
    """Without a drop, the reference is the sampler's statement: argmax p / -log(u(seed, counter, v))."""
    from specserve.engine.sampler import _row_key

    probs, _, _ = _inputs(6, 500, seed=3)
    seed, counter = torch.arange(6, dtype=torch.int64) * 977, torch.arange(6, dtype=torch.int64) + 11
    expected = (probs.double() / -torch.log(uniform_noise(seed, counter, 500))).argmax(dim=-1)
    assert race_draw_ref(probs, _row_key(seed, counter), None).tolist() == expected.tolist()


def test_rows_with_nothing_but_the_dropped_token_draw_it():
    """A one-hot row whose token is dropped has no residual: the draw falls back to p (the token);
    zero rows elsewhere and a row of a few tokens."""
    probs = torch.zeros(3, 300)
    probs[0, 250] = 1.0
    probs[1, [3, 140, 299]] = torch.tensor([0.2, 0.3, 0.5])
    probs[2, 7] = 1.0
    keys = torch.tensor([5, 6, 7], dtype=torch.int64)
    got = _check(probs, keys, torch.tensor([250, 140, -1]), block=64)
    assert got.tolist()[0] == 250 and got.tolist()[1] in (3, 299) and got.tolist()[2] == 7


def test_draws_follow_p():
    """Over many keys one row's draws are distributed as p (the race is exact), and with a drop as p
    without that token, renormalised; the kernel's draws are the reference's (on a part of them:
    the interpreter is slow)."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    probs = p.expand(4000, 4).contiguous()
    keys = torch.arange(4000, dtype=torch.int64) * 2654435761 % 2**32
    drop = torch.zeros(4000, dtype=torch.int64)
    _check(probs[:64], keys[:64], block=4)
    _check(probs[:64], keys[:64], drop[:64], block=4)
    counts = torch.bincount(race_draw_ref(probs, keys), minlength=4).double() / 4000
    assert torch.allclose(counts, p.double(), atol=0.03)
    counts = torch.bincount(race_draw_ref(probs, keys, drop), minlength=4)
    assert counts[0] == 0
    assert torch.allclose(counts[1:].double() / 4000, p[1:].double() / 0.5, atol=0.03)


def test_shape_errors():
    probs, keys, _ = _inputs(2, 10, seed=1)
    with pytest.raises(ValueError, match="probs"):
        race_draw(probs.double().to(DEVICE), keys.to(DEVICE))
    with pytest.raises(ValueError, match="keys"):
        race_draw(probs.to(DEVICE), keys[:1].to(DEVICE))
    with pytest.raises(ValueError, match="drop"):
        race_draw(probs.to(DEVICE), keys.to(DEVICE), keys.int().to(DEVICE))
