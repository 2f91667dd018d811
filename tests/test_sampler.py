"""The sampler draws exactly from the documented distribution, reproducibly per request."""

from __future__ import annotations

import dataclasses
import random
import warnings

import numpy as np
import pytest
import torch
from scipy import stats

from specserve.engine.sampler import (
    SamplingBatch,
    SamplingRow,
    filtered_probs,
    filtered_probs_ref,
    sample,
    uniform_noise,
)

CPU = torch.device("cpu")
PLAIN = SamplingRow(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0)
GREEDY = dataclasses.replace(PLAIN, temperature=0.0)


def _logits(batch: int, vocab: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _random_row(rng: random.Random, seed: int, counter: int) -> SamplingRow:
    return SamplingRow(
        temperature=rng.choice([0.0, 0.3, 0.7, 1.0, 1.5]),
        top_k=rng.choice([0, 0, 1, 3, 7, 100]),
        top_p=rng.choice([1.0, 1.0, 0.1, 0.5, 0.8, 0.95]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.2, 0.5]),
        seed=seed,
        counter=counter,
    )


def _sample_rows(logits: torch.Tensor, rows: list[SamplingRow], banned=None) -> torch.Tensor:
    return sample(logits, SamplingBatch.build(rows, CPU), banned)


# ---- greedy and banned tokens ---------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = _logits(8, 50)
    logits[3, 7] = logits[3, 11] = logits[3].max() + 1.0  # a tie goes to the lower id
    out = _sample_rows(logits, [GREEDY] * 8)
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(dim=-1))
    assert out[3] == 7


def test_greedy_rows_in_a_mixed_batch_are_argmax() -> None:
    logits = _logits(6, 50)
    rows = [GREEDY, dataclasses.replace(PLAIN, seed=5), GREEDY, PLAIN, GREEDY, PLAIN]
    out = _sample_rows(logits, rows)
    for i in (0, 2, 4):
        assert out[i] == logits[i].argmax()


def test_banned_tokens_are_never_chosen() -> None:
    vocab = 20
    logits = _logits(1, vocab).expand(400, vocab).clone()
    logits[:, 4] = 50.0  # the favourite, banned below
    banned = torch.zeros(400, vocab, dtype=torch.bool)
    banned[:, [4, 9, 13]] = True
    greedy = _sample_rows(logits, [GREEDY] * 400, banned)
    assert torch.equal(greedy, logits.masked_fill(banned, float("-inf")).argmax(-1))
    rows = [dataclasses.replace(PLAIN, temperature=2.0, seed=s) for s in range(400)]
    drawn = _sample_rows(logits, rows, banned)
    assert not banned.gather(1, drawn.unsqueeze(1)).any()
    assert len(set(drawn.tolist())) > 5  # really sampling, not stuck


# ---- reproducibility -------------------------------------------------------------------------


def test_same_seed_and_counter_give_the_same_token_whatever_the_batch() -> None:
    vocab = 64
    rng = random.Random(1)
    target = SamplingRow(temperature=1.0, top_k=20, top_p=0.9, min_p=0.01, seed=123456789, counter=7)
    logits = _logits(16, vocab, seed=3)
    alone = _sample_rows(logits[5:6], [target])
    for trial in range(5):
        rows = [_random_row(rng, rng.randrange(2**63), rng.randrange(1000)) for _ in range(16)]
        rows[5] = target
        mixed = _sample_rows(logits, rows)
        assert mixed[5] == alone[0], trial


def test_different_counters_give_different_draws() -> None:
    vocab = 1000
    logits = torch.zeros(200, vocab)  # uniform: every draw is pure noise
    rows = [dataclasses.replace(PLAIN, seed=42, counter=c) for c in range(200)]
    drawn = _sample_rows(logits, rows)
    assert len(set(drawn.tolist())) > 150
    again = _sample_rows(logits, rows)
    assert torch.equal(drawn, again)
    other_seed = _sample_rows(logits, [dataclasses.replace(r, seed=43) for r in rows])
    assert (other_seed != drawn).sum() > 150


def test_noise_is_a_function_of_seed_counter_and_token_only() -> None:
    seeds = torch.tensor([0, 1, 2**63 - 1, 2**40 + 5])
    counters = torch.tensor([0, 3, 2**32 + 1, 9])
    wide = uniform_noise(seeds, counters, 300)
    narrow = uniform_noise(seeds[2:3], counters[2:3], 100)
    assert torch.equal(wide[2, :100], narrow[0])
    salted = uniform_noise(seeds, counters, 300, salt=1)
    assert not torch.isclose(salted, wide).any()


# ---- the distribution ------------------------------------------------------------------------

CHI2_CASES = {
    "temperature": SamplingRow(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0),
    "top_k": SamplingRow(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0, seed=0, counter=0),
    "top_p": SamplingRow(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0, seed=0, counter=0),
    "min_p": SamplingRow(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, seed=0, counter=0),
    "combined": SamplingRow(temperature=0.7, top_k=8, top_p=0.9, min_p=0.05, seed=0, counter=0),
}


@pytest.mark.parametrize("name", list(CHI2_CASES))
def test_samples_follow_the_reference_distribution(name: str) -> None:
    vocab, draws = 16, 20_000
    logits = _logits(1, vocab, seed=11, scale=0.5)[0]  # flat enough that every filter keeps several
    row = CHI2_CASES[name]
    expected = filtered_probs_ref(logits, row).numpy()
    assert (expected > 0).sum() >= 5
    # Many requests in one batch: each row its own seed, some rows also at other counters.
    rows = [dataclasses.replace(row, seed=1000 + i * 7919, counter=i % 3) for i in range(draws)]
    drawn = _sample_rows(logits.expand(draws, vocab), rows)
    counts = np.bincount(drawn.numpy(), minlength=vocab)
    assert counts[expected == 0].sum() == 0, "drew a token the filters removed"
    observed, wanted = _merge_small_bins(counts[expected > 0], expected[expected > 0] * draws)
    assert stats.chisquare(observed, wanted).pvalue > 1e-3


def _merge_small_bins(observed: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pool bins expecting < 5 draws, where the χ² approximation breaks down."""
    small = expected < 5
    if not small.any():
        return observed, expected
    return (
        np.append(observed[~small], observed[small].sum()),
        np.append(expected[~small], expected[small].sum()),
    )


def test_filtered_probs_matches_the_reference() -> None:
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        batch, vocab = rng.randint(1, 12), rng.choice([2, 5, 16, 33])
        # Few distinct values: many exact ties, including at the top-k / top-p boundaries.
        logits = torch.randint(-3, 3, (batch, vocab), generator=gen).float() * 0.5
        if trial % 2:
            logits = torch.randn(batch, vocab, generator=gen) * 3.0
        banned = torch.rand(batch, vocab, generator=gen) < 0.2
        banned[:, 0] = False  # keep every row drawable
        rows = [_random_row(rng, rng.randrange(2**63), 0) for _ in range(batch)]
        got = filtered_probs(logits, SamplingBatch.build(rows, CPU), banned)
        for i, row in enumerate(rows):
            want = filtered_probs_ref(logits[i], row, banned[i])
            assert torch.allclose(got[i].double(), want, atol=1e-6), (trial, i, row)


@pytest.mark.parametrize(
    "row",
    [
        dataclasses.replace(PLAIN, temperature=1e-38),  # logits / T overflowed float32: NaN rows
        dataclasses.replace(PLAIN, temperature=1e-300),
        dataclasses.replace(PLAIN, top_p=1e-46),  # 0 in float32: nothing was kept
        dataclasses.replace(PLAIN, top_p=1e-46, top_k=3, temperature=1e-38),
    ],
)
def test_the_least_temperatures_and_top_p_draw_the_likeliest_token(row: SamplingRow) -> None:
    logits = _logits(4, 50, scale=20.0)
    rows = [dataclasses.replace(row, seed=s) for s in range(4)]
    probs = filtered_probs(logits, SamplingBatch.build(rows, CPU))
    assert not probs.isnan().any()
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.allclose(probs.amax(-1), torch.ones(4))
    assert torch.equal(_sample_rows(logits, rows), logits.argmax(-1))
    for i in range(4):
        want = filtered_probs_ref(logits[i], rows[i])
        assert torch.allclose(probs[i].double(), want, atol=1e-6)


def test_a_top_k_past_the_vocabulary_keeps_every_token() -> None:
    """The API admits any top_k below 2**63: one past the vocabulary filters nothing (the same
    probabilities, to float rounding, and the same draws as no top_k), and one near 2**63 packs
    without overflowing the cast."""
    logits = _logits(3, 50, scale=3.0)
    plain = [dataclasses.replace(PLAIN, seed=s) for s in range(3)]
    for k in (50, 51, 2**40, 2**63 - 1):
        rows = [dataclasses.replace(r, top_k=k) for r in plain]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # numpy's "invalid value encountered in cast"
            batch = SamplingBatch.build(rows, CPU)
        unfiltered = filtered_probs(logits, SamplingBatch.build(plain, CPU))
        torch.testing.assert_close(filtered_probs(logits, batch), unfiltered, atol=1e-7, rtol=1e-5)
        assert torch.equal(_sample_rows(logits, rows), _sample_rows(logits, plain))


def test_top_p_tie_at_the_boundary_keeps_the_lower_id() -> None:
    # probs (0.4, 0.2, 0.2, 0.2): top_p=0.5 needs the first two; ids 1..3 tie, id 1 must win.
    logits = torch.log(torch.tensor([[0.2, 0.2, 0.4, 0.2]]))
    row = dataclasses.replace(PLAIN, top_p=0.5)
    got = filtered_probs(logits, SamplingBatch.build([row], CPU))[0].double()
    want = torch.tensor([1 / 3, 0.0, 2 / 3, 0.0], dtype=torch.float64)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(filtered_probs_ref(logits[0], row), want, atol=1e-12)


def test_no_sort_path_matches_sort_path() -> None:
    logits = _logits(4, 40)
    rows = [dataclasses.replace(PLAIN, min_p=m) for m in (0.0, 0.1, 0.3, 0.9)]
    fast = filtered_probs(logits, SamplingBatch.build(rows, CPU))
    sorted_rows = [dataclasses.replace(r, top_p=0.999999) for r in rows]  # forces the sort
    batch = dataclasses.replace(SamplingBatch.build(sorted_rows, CPU), top_p=torch.ones(4))
    assert batch.any_top_p
    assert torch.allclose(fast, filtered_probs(logits, batch), atol=1e-6)


# ---- the hash ---------------------------------------------------------------------------------


def test_uniform_noise_is_strictly_inside_the_unit_interval_and_uniform() -> None:
    seeds = torch.tensor([0, 1, 2, 2**62, 2**63 - 1, 987654321])
    counters = torch.tensor([0, 0, 1, 5, 2**20, 77])
    u = uniform_noise(seeds, counters, 5000)
    assert u.shape == (6, 5000) and u.dtype == torch.float64
    assert (u > 0).all() and (u < 1).all()
    assert stats.kstest(u.flatten().numpy(), "uniform").pvalue > 1e-3
    for row in u:  # every row on its own too
        assert stats.kstest(row.numpy(), "uniform").pvalue > 1e-3
    # Neighbouring seeds, counters and tokens must not be correlated.
    assert abs(np.corrcoef(u[0].numpy(), u[1].numpy())[0, 1]) < 0.05
    assert abs(np.corrcoef(u[0, :-1].numpy(), u[0, 1:].numpy())[0, 1]) < 0.05


def test_sample_is_the_exponential_race_over_public_noise() -> None:
    """sample() uses the row keys folded on the host; they must give uniform_noise's values."""
    rng = random.Random(3)
    rows = [_random_row(rng, rng.randrange(2**63), rng.randrange(2**40)) for _ in range(32)]
    logits = _logits(32, 300, seed=4)
    batch = SamplingBatch.build(rows, CPU)
    u = uniform_noise(batch.seed, batch.counter, 300)
    race = (filtered_probs(logits, batch).double() / -torch.log(u)).argmax(-1)
    assert torch.equal(sample(logits, batch), race)


def test_uniform_noise_extremes_are_exact() -> None:
    # The largest and smallest representable uniforms keep -log(u) finite and positive.
    u = uniform_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096)
    e = -torch.log(u)
    assert torch.isfinite(e).all() and (e > 0).all()


# ---- batches ----------------------------------------------------------------------------------


def test_empty_batch() -> None:
    batch = SamplingBatch.build([], CPU)
    assert len(batch) == 0 and batch.all_greedy
    out = sample(torch.empty(0, 10), batch)
    assert out.shape == (0,) and out.dtype == torch.int64


def test_build_flags_ignore_greedy_rows() -> None:
    batch = SamplingBatch.build([dataclasses.replace(GREEDY, top_k=3, top_p=0.5, min_p=0.1)], CPU)
    assert batch.all_greedy and not (batch.any_top_k or batch.any_top_p or batch.any_min_p)
    batch = SamplingBatch.build([GREEDY, dataclasses.replace(PLAIN, top_k=3)], CPU)
    assert not batch.all_greedy and batch.any_top_k and not batch.any_top_p
    assert batch.seed.dtype == torch.int64 and batch.temperature.dtype == torch.float32


@pytest.mark.gpu
def test_cuda_matches_cpu_without_host_sync() -> None:
    rng = random.Random(5)
    vocab = 1000
    logits = _logits(64, vocab, seed=9)
    banned = torch.zeros(64, vocab, dtype=torch.bool)
    banned[::3, :10] = True
    device = torch.device("cuda")
    gpu_logits, gpu_banned = logits.to(device), banned.to(device)
    seeds, counters = torch.tensor([7, 2**63 - 1]), torch.tensor([0, 3])
    gpu_seeds, gpu_counters = seeds.to(device), counters.to(device)
    batches = {
        "mixed": [_random_row(rng, rng.randrange(2**63), rng.randrange(100)) for _ in range(64)],
        "min_p only": [dataclasses.replace(PLAIN, min_p=0.1, seed=s) for s in range(64)],
        "greedy": [GREEDY] * 64,
    }
    for name, rows in batches.items():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            batch = SamplingBatch.build(rows, device)
            got = sample(gpu_logits, batch, gpu_banned)
            probs = filtered_probs(gpu_logits, batch, gpu_banned)
            noise = uniform_noise(gpu_seeds, gpu_counters, vocab)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        cpu_batch = SamplingBatch.build(rows, CPU)
        assert torch.equal(got.cpu(), sample(logits, cpu_batch, banned)), name
        assert torch.allclose(probs.cpu(), filtered_probs(logits, cpu_batch, banned), atol=1e-6), name
        assert torch.equal(noise.cpu(), uniform_noise(seeds, counters, vocab)), name


@pytest.mark.parametrize("rows", [3, 40])  # keys folded row by row in Python, and with numpy
@pytest.mark.parametrize("salt", [0, 1, 2, 3])
def test_a_batch_s_salted_noise_is_uniform_noise(rows: int, salt: int) -> None:
    """`SamplingBatch.noise` folds a salt's row keys on the host (a batch built there) or on the
    device (one built from device columns, `device_batch`): either way `uniform_noise`'s values."""
    from specserve.engine.sampler import GREEDY as NO_FILTERS
    from specserve.engine.sampler import device_batch

    rng = random.Random(rows * 10 + salt)
    seeds = [rng.randrange(2**63) for _ in range(rows)]
    counters = [rng.randrange(5000) for _ in range(rows)]
    batch = SamplingBatch.build(
        [dataclasses.replace(PLAIN, seed=s, counter=c) for s, c in zip(seeds, counters, strict=True)], CPU
    )
    want = uniform_noise(torch.tensor(seeds), torch.tensor(counters), 17, salt=salt)
    assert torch.equal(batch.noise(17, salt), want)
    on_device = device_batch(
        torch.ones(3, rows), torch.zeros(rows, dtype=torch.int64), batch.seed, batch.counter, NO_FILTERS
    )
    assert on_device.host is None and torch.equal(on_device.noise(17, salt), want)
