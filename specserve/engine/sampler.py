"""Batched token sampling: one fused pass per step, no host sync, reproducible per request.

Semantics, per row (``filtered_probs_ref`` is the executable statement of them):

1. Banned tokens (``banned[b, v]``, used for ``min_new_tokens``) get probability 0.
2. ``temperature == 0`` is greedy: the argmax of the raw logits with banned tokens excluded, ties
   going to the lowest id (``torch.argmax`` semantics). Its distribution is that one-hot.
3. Otherwise ``p = softmax(logits / max(temperature, MIN_TEMPERATURE))`` (a temperature of 1e-38
   overflowed the division, and every row came out NaN: token 0, silently), then
   - top-k (``top_k > 0``) keeps the ``k`` most probable tokens;
   - top-p (``top_p < 1``) renormalises what top-k kept and keeps the smallest prefix, in descending
     probability, whose cumulative mass is ``>= top_p`` (always at least one token);
   - min-p (``min_p > 0``) drops tokens whose probability is ``< min_p * p_max`` (of what is left);
   - what survives is renormalised.
   "Descending probability" is a stable order: equal probabilities keep ascending token ids, so
   ties at a top-k or top-p boundary are resolved towards lower ids, identically on every device.

Randomness: no ``torch.Generator``. Each draw uses uniforms ``u(seed, counter, token)`` from a
counter-based integer hash evaluated on the device (``uniform_noise``), so a request's tokens depend
only on its own seed and output position: not on batch composition, process or device (CPU and
CUDA produce bit-identical noise; draws agree unless float rounding of the probabilities differs at
an exact near-tie). A token is drawn by the exponential race ``argmax_v(p_v / E_v)`` with
``E_v = -log(u_v)`` i.i.d. Exp(1): token ``v`` wins with probability exactly ``p_v`` (the same
trick as Gumbel-max, without the double log).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from specserve.engine.host_copy import to_device
from specserve_kernels import use_triton
from specserve_kernels.race_draw import MASK32, MUL_A, MUL_B, SALT_TOKEN, race_draw, race_draw_ref

# Odd multipliers below 2**31 (from Wellons' hash prospector, "lowbias32"): with 32-bit lanes every
# product stays below 2**63, so int64 tensors never overflow (signed overflow is UB in C++ kernels).
# They, the token id's salt and the mask are the race kernel's too, which hashes inline.
_MASK32, _MUL_A, _MUL_B, _SALT_TOKEN = MASK32, MUL_A, MUL_B, SALT_TOKEN
# Domain separators so that seed halves, counter and token id cannot cancel each other.
_SALT_SEED = 0x3C6EF372
_SALT_COUNTER = 0x1B873593
# Logits over this temperature stay finite in float32 (|logit| < 3e8): below it the division
# overflowed. Every distribution this low is the argmax's (ties aside) anyway.
MIN_TEMPERATURE = 1e-30


@dataclass(frozen=True)
class SamplingRow:
    """Host-side sampling parameters of one row of logits."""

    temperature: float  # 0 => greedy (argmax)
    top_k: int  # <= 0 => off
    top_p: float  # 1.0 => off; in (0, 1]
    min_p: float  # 0.0 => off; in [0, 1)
    seed: int  # per-request seed, 0 <= seed < 2**63
    counter: int  # index of the output token being sampled for that request


@dataclass(frozen=True)
class SamplingBatch:
    """Device tensors of a step's ``SamplingRow``s, plus host flags that let ``sample`` skip work."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64
    counter: torch.Tensor  # [B] int64
    noise_key: torch.Tensor  # [B] int64: _row_key(seed, counter), folded on the host (saves ~30 launches)
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    # The seeds and counters on the host, where the batch was built there: other salts' row keys are
    # folded there too (`noise`), one copy instead of some twenty tiny device operations, each a
    # launch (at batch 1 on the H200 they were a quarter of a sampled speculative step's host time).
    host: tuple[np.ndarray, np.ndarray] | None = None

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], device: torch.device | str) -> SamplingBatch:
        """One host->device copy of every field; an empty ``rows`` gives an empty batch."""
        fixed = [(r.temperature, r.top_k, r.top_p, r.min_p) for r in rows]
        return cls.from_columns(fixed, [r.seed for r in rows], [r.counter for r in rows], device)

    @classmethod
    def from_columns(
        cls,
        fixed: Sequence[tuple[float, int, float, float]],
        seeds: Sequence[int],
        counters: Sequence[int],
        device: torch.device | str,
    ) -> SamplingBatch:
        """`build` from columns: per row (temperature, top_k, top_p, min_p), its seed and its counter.
        What a step does (no `SamplingRow` per request and step). The int fields (and the row keys,
        folded on the host) and the float ones travel in one byte buffer: one copy."""
        device = torch.device(device)
        n = len(seeds)
        if n == 0:
            floats, ints = (
                torch.empty(3, 0, device=device),
                torch.empty(4, 0, dtype=torch.int64, device=device),
            )
            return cls(
                floats[0], ints[0], floats[1], floats[2], ints[1], ints[2], ints[3], True, False, False, False
            )
        buffer = np.empty(44 * n, dtype=np.uint8)  # [4, n] int64, then [3, n] float32
        ints = buffer[: 32 * n].view(np.int64).reshape(4, n)
        floats = buffer[32 * n :].view(np.float32).reshape(3, n)
        floats[:], ints[0] = sampling_columns(fixed)
        ints[1], ints[2] = seeds, counters
        ints[3] = _row_keys(seeds, counters)
        host = ints[1].copy(), ints[2].copy()
        flags = sampling_flags(floats[0], ints[0], floats[1], floats[2])._asdict()
        packed = to_device(torch.from_numpy(buffer), device)
        ints_t = packed[: 32 * n].view(torch.int64).view(4, n)
        floats_t = packed[32 * n :].view(torch.float32).view(3, n)
        return cls(
            temperature=floats_t[0],
            top_p=floats_t[1],
            min_p=floats_t[2],
            top_k=ints_t[0],
            seed=ints_t[1],
            counter=ints_t[2],
            noise_key=ints_t[3],
            **flags,
            host=host,
        )

    def __len__(self) -> int:
        return self.temperature.shape[0]

    def noise(self, vocab_size: int, salt: int = 0) -> torch.Tensor:
        """`uniform_noise(seed, counter, vocab_size, salt=salt)` of every row."""
        return noise_from_key(self.row_keys(salt), vocab_size)

    def row_keys(self, salt: int = 0) -> torch.Tensor:
        """[B] int64 each row's noise key for `salt`, folded on the host where the batch has its
        columns there."""
        if salt == 0:
            return self.noise_key
        if self.host is not None:
            seeds, counters = self.host
            return to_device(torch.from_numpy(_row_key(seeds, counters, salt)), self.seed.device)
        return _row_key(self.seed, self.counter, salt)


class SamplingFlags(NamedTuple):
    """Which filters a batch's sampled rows use: they pick `sample`'s code path (and so its float
    rounding), which a batch drawn elsewhere (the device loop) must follow to draw the same tokens."""

    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool


def sampling_flags(
    temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray
) -> SamplingFlags:
    """The flags of rows of these (float32-capped) columns: greedy rows ignore the filters."""
    sampled = temperature > 0
    return SamplingFlags(
        all_greedy=not bool(sampled.any()),
        any_top_k=bool((top_k[sampled] > 0).any()),
        any_top_p=bool((top_p[sampled] < 1.0).any()),
        any_min_p=bool((min_p[sampled] > 0.0).any()),
    )


def sampling_columns(fixed: Sequence[tuple[float, int, float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of (temperature, top_k, top_p, min_p) as the device holds them: [3, n] float32
    (temperature, top_p, min_p; a temperature past float32's range is its largest, uniform anyway)
    and [n] int64 top_k (a k past any vocabulary keeps every token, as 2**31 does; one near 2**63,
    which the API admits, would overflow the cast)."""
    params = np.array(fixed, dtype=np.float64).reshape(-1, 4).T
    floats = np.minimum(params[[0, 2, 3]], np.finfo(np.float32).max).astype(np.float32)
    return floats, np.minimum(params[1], 2.0**31).astype(np.int64)


GREEDY = SamplingFlags(True, False, False, False)


def device_batch(
    fixed: torch.Tensor, top_k: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor, flags: SamplingFlags
) -> SamplingBatch:
    """A batch whose columns live on the device already (`fixed` [3, B] float32: temperature,
    top_p, min_p, as `sampling_columns` lays them out), its row keys folded there: no host work,
    capturable in a CUDA graph (the device loop's sampled rows, whose counters advance there)."""
    key = _row_key(seed, counter)
    return SamplingBatch(fixed[0], top_k, fixed[1], fixed[2], seed, counter, key, *flags)


def sample(logits: torch.Tensor, batch: SamplingBatch, banned: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row of ``logits`` [B, V]; returns [B] int64 on the logits' device.

    Never synchronises with the host. Cost beyond the filters: one [B, V] integer hash (a handful of
    int64 elementwise ops) plus a log and a divide in float64, once per sampled step; an all-greedy
    batch skips all of it.
    """
    if batch.all_greedy:
        return greedy_tokens(logits, banned)
    return sample_from_probs(filtered_probs(logits, batch, banned), batch)


def greedy_tokens(logits: torch.Tensor, banned: torch.Tensor | None = None) -> torch.Tensor:
    """What `sample` draws for greedy rows: the argmax with banned tokens excluded [B] (no batch needed)."""
    return _mask_banned(logits, banned).argmax(dim=-1)


def sample_from_probs(
    probs: torch.Tensor, batch: SamplingBatch, *, salt: int = 0, drop: torch.Tensor | None = None
) -> torch.Tensor:
    """Draw one token per row from given probabilities [B, V] float32 (need not be normalised). Salt
    0 is the noise `sample` uses; speculative verify draws residuals with it and drafts with another
    salt. `drop` ([B] int64, -1: none): draw from p with that token removed (a rejected
    deterministic draft's residual), or from p where nothing else is left."""
    # Exponential race: argmax p/E with E ~ Exp(1) picks v with probability p_v. Greedy rows have
    # one-hot probs, so the race returns their argmax too; zero-probability tokens never win. One
    # pass on the GPU (`kernels/race_draw.py`), the [B, V] noise never stored.
    draw = race_draw if use_triton(probs.device) else race_draw_ref
    return draw(probs.contiguous(), batch.row_keys(salt), drop)


def filtered_probs(
    logits: torch.Tensor, batch: SamplingBatch, banned: torch.Tensor | None = None
) -> torch.Tensor:
    """The distribution ``sample`` draws from, [B, V] float32 (one-hot for greedy rows).

    Sorts only when some row uses top-k or top-p: min-p alone needs just the row maximum.
    """
    masked = _mask_banned(logits, banned)
    greedy = batch.temperature <= 0
    # Greedy rows get a dummy temperature here; their result is replaced by the one-hot below.
    temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
    temperature = temperature.clamp(min=MIN_TEMPERATURE)
    scaled = masked / temperature.unsqueeze(-1)
    if batch.any_top_k or batch.any_top_p:
        probs = _sorted_filter(scaled, batch)
    else:
        probs = torch.softmax(scaled, dim=-1)
        if batch.any_min_p:
            p_max = probs.amax(dim=-1, keepdim=True)
            probs = probs * (probs >= batch.min_p.unsqueeze(-1) * p_max)
            probs = probs / probs.sum(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter_(-1, masked.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy.unsqueeze(-1), one_hot, probs)


def _mask_banned(logits: torch.Tensor, banned: torch.Tensor | None) -> torch.Tensor:
    logits = logits.float()
    return logits if banned is None else logits.masked_fill(banned, float("-inf"))


def _sorted_filter(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """top-k, top-p and min-p in descending-probability order, scattered back to token order."""
    vocab = scaled.shape[-1]
    # Sorting logits orders probabilities too, and stable=True puts equal ones in ascending id order.
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    p = torch.softmax(sorted_logits, dim=-1)
    rank = torch.arange(vocab, device=scaled.device)
    keep = torch.ones_like(p, dtype=torch.bool)
    if batch.any_top_k:
        k = torch.where(batch.top_k > 0, batch.top_k.clamp(max=vocab), vocab)
        keep &= rank < k.unsqueeze(-1)
    if batch.any_top_p:
        kept = p * keep
        cum = kept.cumsum(dim=-1)
        # Keep a token iff the mass strictly before it is < top_p (of the top-k mass): the smallest
        # prefix reaching top_p. The shifted cumsum makes rank 0 always kept.
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
        top_p = batch.top_p.unsqueeze(-1)
        # rank 0 named too: a top_p below float32's least (1e-46) is 0 here, and then nothing was kept
        keep &= (before < top_p * cum[:, -1:]) | (top_p >= 1.0) | (rank == 0)
    if batch.any_min_p:
        # Ratio test, so it needs no renormalisation; p[:, 0] is the maximum and is always kept.
        keep &= p >= batch.min_p.unsqueeze(-1) * p[:, :1]
    kept = p * keep
    kept = kept / kept.sum(dim=-1, keepdim=True)
    return torch.zeros_like(kept).scatter_(-1, order, kept)


def uniform_noise(
    seed: torch.Tensor, counter: torch.Tensor, vocab_size: int, *, salt: int = 0
) -> torch.Tensor:
    """Uniforms in (0, 1) strictly, [B, vocab_size] float64, one per (seed, counter, token id).

    A pure function of its integer inputs, evaluated with int64 tensor ops on ``seed``'s device,
    every intermediate below 2**63. ``salt`` (0 <= salt < 2**32) selects an independent stream, e.g.
    for the accept/reject uniforms of speculative sampling. Values are ``(h + 0.5) / 2**32`` for a
    32-bit hash ``h``: exact in float64, never 0 or 1.
    """
    key = _row_key(seed.to(torch.int64), counter.to(torch.int64), salt)
    return noise_from_key(key, vocab_size)


def uniform_noise_host(
    seed: np.ndarray, counter: np.ndarray, vocab_size: int, device: torch.device, *, salt: int = 0
) -> torch.Tensor:
    """``uniform_noise`` of host seeds and counters (int64 arrays): the row keys are folded on the
    host, one copy instead of some twenty small device operations."""
    key = _row_key(np.asarray(seed, dtype=np.int64), np.asarray(counter, dtype=np.int64), salt)
    return noise_from_key(to_device(torch.from_numpy(key), device), vocab_size)


# Below this many rows the row keys are folded in Python (a seed's half cached), above with numpy.
PYTHON_KEY_ROWS = 32


def _row_keys(seeds: Sequence[int], counters: Sequence[int]) -> np.ndarray | list[int]:
    """`_row_key` of each (seed, counter) pair (salt 0), for a host buffer."""
    if len(seeds) > PYTHON_KEY_ROWS:
        return _row_key(np.asarray(seeds, dtype=np.int64), np.asarray(counters, dtype=np.int64))
    return [_counter_key(_seed_key(seed), counter) for seed, counter in zip(seeds, counters, strict=True)]


@functools.lru_cache(maxsize=4096)
def _seed_key(seed: int, salt: int = 0) -> int:
    """The seed's half of `_row_key` (Python ints): the same for every output index of a request."""
    key = _mix32(((seed >> 32) & _MASK32) ^ _SALT_SEED ^ (salt & _MASK32))
    return _mix32(key ^ (seed & _MASK32))


def _counter_key(seed_key, counter):
    """The counter's half of `_row_key`, on top of the seed's."""
    key = _mix32(seed_key ^ ((counter >> 32) & _MASK32) ^ _SALT_COUNTER)
    return _mix32(key ^ (counter & _MASK32))


def _row_key(seed, counter, salt: int = 0):
    """Fold (seed, counter, salt) into one 32-bit key; works on int64 tensors, int64 numpy arrays
    and Python ints alike (every intermediate stays below 2**63)."""
    key = _mix32(((seed >> 32) & _MASK32) ^ _SALT_SEED ^ (salt & _MASK32))
    return _counter_key(_mix32(key ^ (seed & _MASK32)), counter)


def noise_from_key(key: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Hash each row key [B] with every token id: the [B, V] part of ``uniform_noise``."""
    token_key = _token_keys(vocab_size, key.device)  # [V], shared by all rows
    key = key.unsqueeze(-1)
    h = _mix32(_mix32(key ^ token_key) ^ key)
    return (h.double() + 0.5) * (1.0 / 2**32)


_TOKEN_KEYS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _token_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    """Every token id's half of the noise hash [V]: the same for every draw, so computed once per
    vocabulary and device (seven launches a draw saved) — but not kept from inside a CUDA-graph
    capture, whose tensors hold their values only once the graph is replayed."""
    cached = _TOKEN_KEYS.get((vocab_size, device))
    if cached is not None:
        return cached
    keys = _mix32(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ _SALT_TOKEN)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        _TOKEN_KEYS[(vocab_size, device)] = keys
    return keys


def _mix32(x):
    """A 32-bit avalanche mix (xorshift-multiply, lowbias32) of values < 2**32 (int64 tensor, array or int)."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 15)


def filtered_probs_ref(
    logits: torch.Tensor, row: SamplingRow, banned: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain reference for one row: logits [V] (and optional banned [V] bool) -> probs [V] float64."""
    x = logits.double().clone()
    if banned is not None:
        x[banned] = float("-inf")
    vocab = x.shape[0]
    if row.temperature <= 0:
        out = torch.zeros(vocab, dtype=torch.float64)
        out[int(torch.argmax(x))] = 1.0
        return out
    p = torch.softmax(x / max(row.temperature, MIN_TEMPERATURE), dim=0).tolist()
    values = x.tolist()
    # Descending probability == descending logit; Python's sort is stable, so ties keep id order.
    kept = sorted(range(vocab), key=lambda i: -values[i])
    if row.top_k > 0:
        kept = kept[: row.top_k]
    if row.top_p < 1.0:
        mass = sum(p[i] for i in kept)
        prefix, cum = [], 0.0
        for i in kept:
            prefix.append(i)
            cum += p[i] / mass
            if cum >= row.top_p:
                break
        kept = prefix
    if row.min_p > 0.0:
        p_max = max(p[i] for i in kept)
        kept = [i for i in kept if p[i] >= row.min_p * p_max]
    out = torch.zeros(vocab, dtype=torch.float64)
    for i in kept:
        out[i] = p[i]
    return out / out.sum()
