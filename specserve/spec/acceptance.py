"""Live estimates of how far drafts get accepted: per draft position, per request and pooled.

A verify that drafted n tokens and accepted m says, for positions 1..m, "accepted given the ones
before were", and for position m + 1 (when m < n) "rejected given the ones before were"; positions
past m + 1 were never tested. Each position's conditional acceptance a_i is an exponential moving
average of those outcomes: one per request (what its text lets a drafter predict) and one pooled
over all requests (the prior a new request starts from). Tree drafts (topk > 1) accept differently
from chains, so every estimate is kept per topk.

The expected tokens one verify of a k-step draft emits is then 1 + sum_{j<=k} prod_{i<=j} a_i: the
bonus (or corrected) token always, and draft j when all drafts up to j survive.

Acceptance may rise with depth: an n-gram lookup either finds a long match, whose tokens are then
mostly right, or nothing (position 1 rejected). So a position never tested does not inherit a low
rate from the one before it: its prior is at least the configured (optimistic) one. Otherwise a
tier-1 stretch that sees many misses would make every deeper tier look hopeless without ever having
tried one (what kept issue 9's batch-1 MT-Bench run off although 8-deep drafts doubled throughput).

N-gram acceptance comes in stretches: a lookup that found a long match keeps finding it for a while,
and one that found none keeps failing. So the verifies of a k-chain are not a fair sample of the
text: a long chain crosses a good stretch in a few verifies and spends many on a poor one, and its
rates at position 1 come out far below a short chain's. Greedy SmolLM2 on 24 MT-Bench prompts
(256 tokens each, replayed on the CPU): position 1 was accepted in 0.37 of a 1-chain's verifies
and in 0.19 of an 8-chain's; the 8-chain's rates promised a 1-chain 1.19 tokens a verify and a
2-chain 1.33, where they made 1.37 and 1.55. On the H200 this kept adaptive n-gram speculation
off, or on the 8-chain, at batch 16-64 where the 1- and 2-chains were the best static rows
(docs/benchmarks.md, twenty-eighth session). With `per_token` a verify that emitted m + 1 tokens
counts m + 1 times, as if every token had been a verify's start, and a j-chain's tokens a verify
are the harmonic mean of 1 + min(L, j) over those starts (L: the drafts a start would have had
accepted; `harmonic_prefix`): a j-chain verifies once per 1 + min(L, j) tokens of the stretch it
is in. From the same 8-chain's verifies that promised 1.39, 1.57, 1.74 and 1.85 tokens to the 1-,
2-, 4- and 8-chains, which made 1.37, 1.55, 1.73 and 1.85. Where acceptance does not come in
stretches (independent positions) this promises a shorter chain up to ~10% too much, so it is for
n-gram drafting (the engine sets it), not for a head's: the shipped EAGLE-3 head's 4-chain (greedy,
16 MT-Bench prompts, 192 tokens, on the CPU) promised the 1- and 2-chains 1.60 and 1.95 tokens a
verify per verify and 1.71 and 2.08 per token, where they made 1.64 and 2.03.

`pooled_upper` is an upper confidence bound per position (the pooled rate plus a bonus that shrinks
with the evidence): the policy probes with the tier that is best under it, so a deep tier whose
positions were barely tested gets tried rather than judged on its prior. While it speculates, the
positions just past the standing draft length are scored by it too (`rates_of`'s `explore`): a chain
of 1 never tests position 2, so that evidence only fades, and its mean, back at a prior that knows
nothing of the drafter, kept the H100's batch-1 EAGLE-3 runs on the 1-chain for 16 of 21 steps
(pooled tests of positions 2-4: 2.8, 2.2, 1.1) where the 3- and 4-chains made more.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np


class AcceptanceTracker:
    """`request_alpha` / `pooled_alpha`: how fast a request's own evidence fades (per verify of it)
    and the pooled evidence (per step: `observe`'s `batch`; per verify, the pool's memory was under
    one step at batch 64, and its deep positions, tested only after long matches, rested on the
    prior). `prior`: the rate before anything was observed at a topk; optimistic, so every
    tier gets tried and then judged on what it measured. `strength`: how many observations the
    prior is worth against the evidence.

    Each position's rate is (accepted + strength * prior) / (tested + strength) over faded counts:
    a request's prior is the pool's rate, the pool's prior at a position is its own rate at the
    position before or the configured prior, whichever is higher (see the module docstring). Evidence fades with every verify, tested
    or not, so a position the current draft length never reaches drifts back to its prior rather
    than keeping one unlucky outcome forever — which would stop the policy from ever trying longer
    drafts again."""

    def __init__(
        self,
        max_positions: int,
        request_alpha: float = 0.1,
        pooled_alpha: float = 0.02,
        prior: float = 0.7,
        strength: float = 2.0,
    ) -> None:
        self.max_positions = max_positions
        # count each verify by the tokens it emitted, and price chains by `harmonic_prefix` (the
        # module docstring: n-gram acceptance comes in stretches)
        self.per_token = False
        self.request_alpha, self.pooled_alpha = request_alpha, pooled_alpha
        self.prior, self.strength = prior, strength
        self._pooled: dict[int, _Counts] = {}
        self._requests: dict[tuple[str, int], _Counts] = {}
        self._fades: dict[int, float] = {}  # batch -> the pool's fade per verify
        self.version = 0  # counts verifies' observations: estimates read since are current when unchanged
        # Counts shadow drafts' observations (`specserve/spec/shadow.py`) apart: a few arrive every
        # plain step, and rescoring the batch after each cost a plain step more host time than the
        # step's own work at batch 16 on the H100; the policy reads them every few steps instead.
        self.shadow_version = 0

    def observe(
        self,
        request_id: str,
        topk: int,
        drafted: int,
        accepted: int,
        batch: int = 1,
        shadow: bool = False,
    ) -> None:
        """One verify of `request_id`'s draft of `drafted` tokens (depth, for a tree), `accepted` kept;
        `batch`: the verifies of its step (the pool fades by `pooled_alpha` per step, not per verify).
        `shadow`: a shadow draft scored while speculation is off (counted in `shadow_version`)."""
        self._observe(request_id, topk, ((drafted, accepted),), batch)
        if shadow:
            self.shadow_version += 1
        else:
            self.version += 1

    def observe_run(
        self, topk: int, runs: Sequence[tuple[str, Sequence[tuple[int, int]]]], batch: int
    ) -> list[int]:
        """A device-loop run's verifies: each request's (drafted, accepted) in order, its j-th verify
        made in the run's step j alongside the other requests' j-th; accepted counts up to drafted,
        and a verify that drafted nothing (a request at its end) tested nothing and is left out.
        A request's own estimates take its verifies as `observe` one at a time does; the pool takes each
        step's verifies together, fading by `pooled_alpha` once over the step (as over `batch`
        verifies) and counting them alike. At batch 64 a run settles 512 verifies an engine step,
        and observed one by one they were the adaptive engine's largest host cost there; the pool
        also took them request after request, mixing the run's steps. Returns the verifies
        observed per request."""
        made = [len(verifies) for _, verifies in runs]
        steps = max(made, default=0)
        if not steps:
            return made
        pad = [(0, 0)] * steps
        outcomes = np.array([list(verifies) + pad[len(verifies) :] for _, verifies in runs], dtype=np.int64)
        drafted, accepted = outcomes[:, :, 0], outcomes[:, :, 1]
        if (accepted < 0).any() or (drafted < 0).any():
            raise ValueError("accepted, drafted: a verify's counts are never negative")
        tested = np.minimum(np.minimum(drafted, accepted + 1), self.max_positions)
        present = tested > 0
        accepted = np.minimum(accepted, tested)
        positions = np.arange(self.max_positions)
        tests, accepts = tested[:, :, None] > positions, accepted[:, :, None] > positions
        owns = [self._own(request_id, topk) for request_id, _ in runs]
        weights = (accepted + 1).astype(float) if self.per_token else np.ones(accepted.shape)
        folded = _fold_own(owns, present, tests, accepts, self.request_alpha, weights)
        for row, (own, increments) in enumerate(zip(owns, folded, strict=True)):
            if increments is None:  # its running factor renormalises on the way: one at a time
                triples = zip(
                    tested[row].tolist(), accepted[row].tolist(), weights[row].tolist(), strict=True
                )
                kept = [(t, a, w) for t, a, w in triples if t]
                own.add_many([(t, a) for t, a, _ in kept], self.request_alpha, [w for _, _, w in kept])
            else:
                own.add_counts(*increments)
        pool, fade = self._pool(topk), self._pool_fade(batch)
        per_step = zip(
            (tests * weights[:, :, None]).sum(axis=0).tolist(),
            (accepts * weights[:, :, None]).sum(axis=0).tolist(),
            present.sum(axis=0).tolist(),
            strict=True,
        )
        for step_tests, step_accepts, count in per_step:
            pool.add_together(step_tests, step_accepts, count, fade)
        observed = present.sum(axis=1).tolist()
        self.version += sum(observed)
        return observed

    def _observe(self, request_id: str, topk: int, verifies: Sequence[tuple[int, int]], batch: int) -> None:
        outcomes = self._outcomes(verifies)
        weights = [accepted + 1.0 for _, accepted in outcomes] if self.per_token else None
        self._own(request_id, topk).add_many(outcomes, self.request_alpha, weights)
        self._pool(topk).add_many(outcomes, self._pool_fade(batch), weights)

    def prefix(self, rates: Sequence[float]) -> list[float]:
        """[s]: the tokens a verify of an s-deep chain emits, for every s from 0 to len(rates):
        `harmonic_prefix` with `per_token`, else `expected_prefix`."""
        return harmonic_prefix(rates) if self.per_token else expected_prefix(rates)

    def _own(self, request_id: str, topk: int) -> _Counts:
        own = self._requests.get((request_id, topk))
        if own is None:
            own = self._requests[(request_id, topk)] = _Counts(self.max_positions)
        return own

    def _outcomes(self, verifies: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """(positions tested, accepted) of each (drafted, accepted) verify."""
        most = self.max_positions
        outcomes = []
        for drafted, accepted in verifies:
            if not 0 <= accepted <= drafted:
                raise ValueError(f"accepted: {accepted} outside [0, drafted={drafted}]")
            outcomes.append((min(drafted, accepted + 1, most), accepted))
        return outcomes

    def _pool_fade(self, batch: int) -> float:
        """Per verify of a step of `batch`: the pool fades by `pooled_alpha` over the whole step."""
        if batch <= 1:
            return self.pooled_alpha
        fade = self._fades.get(batch)
        if fade is None:
            fade = self._fades[batch] = 1.0 - (1.0 - self.pooled_alpha) ** (1.0 / batch)
        return fade

    def pooled(self, topk: int) -> list[float]:
        """The pooled per-position rates at `topk`."""
        pool = self._pool(topk)
        out, rate = [], self.prior
        for i in range(self.max_positions):
            rate = pool.rate(i, max(rate, self.prior), self.strength)
            out.append(rate)
        return out

    def pooled_upper(self, topk: int, z: float = 1.0, span: tuple[int, int] | None = None) -> list[float]:
        """An upper confidence bound on each pooled rate: the rate plus z * 0.5 / sqrt(evidence),
        evidence being the position's faded test count plus the prior's strength (0.5: the largest
        standard deviation of one outcome). `span`: (start, stop), the 0-based positions bounded so;
        the others keep their mean rate (what `rates_of`'s `explore` scores by)."""
        tested = self._pool(topk).tested  # one unscaled copy (a property: not per position)
        start, stop = span if span is not None else (0, self.max_positions)
        return [
            min(1.0, rate + z * 0.5 / math.sqrt(tested[i] + self.strength)) if start <= i < stop else rate
            for i, rate in enumerate(self.pooled(topk))
        ]

    def pooled_tested(self, topk: int) -> list[float]:
        """The pool's faded test count per position (how much evidence each pooled rate rests on)."""
        return list(self._pool(topk).tested)

    def rates(self, request_id: str, topk: int) -> list[float]:
        """Per-position conditional acceptance for `request_id`: its own evidence over the pool's rates."""
        return self.rates_of([request_id], topk)[request_id]

    def rates_of(
        self,
        request_ids: Sequence[str],
        topk: int,
        explore: tuple[int, int] | None = None,
        z: float = 1.0,
        strength: float | None = None,
    ) -> dict[str, list[float]]:
        """`rates` of several requests, the pool's rates computed once. `explore`: (start, stop), the
        0-based positions that start from the pool's upper bound (`pooled_upper`, `z`) instead of its
        mean: positions the standing draft length never tests, whose evidence only fades (module
        docstring). `strength`: the pool's weight against a request's own evidence (default: the
        tracker's)."""
        pooled = self.pooled(topk) if explore is None else self.pooled_upper(topk, z, explore)
        strength = self.strength if strength is None else strength
        prior = [strength * p for p in pooled]
        requests = self._requests
        out = {}
        for request_id in request_ids:
            own = requests.get((request_id, topk))
            # `_Counts.rate` inlined (the same arithmetic): a batch's rates are read every rescoring
            if own is None:
                out[request_id] = pooled
                continue
            sc = own._scale
            out[request_id] = [
                (a * sc + w) / (t * sc + strength)
                for a, t, w in zip(own._accepted, own._tested, prior, strict=True)
            ]
        return out

    def known(self, request_ids: Sequence[str], topk: int) -> bool:
        """Whether any of `request_ids` has evidence of its own at `topk` (else each reads the pool's
        rates alone)."""
        requests = self._requests
        return any((request_id, topk) in requests for request_id in request_ids)

    def forget(self, request_id: str) -> None:
        """A finished request's own estimates (the pooled ones keep what it taught them)."""
        for key in [k for k in self._requests if k[0] == request_id]:
            del self._requests[key]

    def expected_tokens(self, request_id: str, topk: int, steps: int) -> float:
        """Tokens one verify of a `steps`-deep draft is expected to emit (1 with no draft)."""
        rates = self.rates(request_id, topk)[:steps]
        return self.prefix(rates)[-1]

    def reach(self, request_id: str, topk: int) -> list[float]:
        """[j]: the probability that draft j + 1 is accepted (every draft before it too)."""
        return reach(self.rates(request_id, topk))

    def _pool(self, topk: int) -> _Counts:
        if topk not in self._pooled:
            self._pooled[topk] = _Counts(self.max_positions)
        return self._pooled[topk]


class _Counts:
    """Faded accepted / tested counts per position.

    Stored unfaded against one running factor (`_scale`, the product of every fade since the last
    renormalisation): an observation then touches only the positions it tested instead of fading
    every position of its request's counts and of the pool's, at batch 64 512 times an engine step
    of 8-verify loop runs (docs/benchmarks.md, twelfth session)."""

    _FLOOR = 1e-150  # renormalise below this factor, far above float underflow

    def __init__(self, positions: int) -> None:
        self._accepted, self._tested = [0.0] * positions, [0.0] * positions
        self._scale = 1.0

    @property
    def accepted(self) -> list[float]:
        scale = self._scale
        return [a * scale for a in self._accepted]

    @property
    def tested(self) -> list[float]:
        scale = self._scale
        return [t * scale for t in self._tested]

    def add_many(
        self, outcomes: Sequence[tuple[int, int]], alpha: float, weights: Sequence[float] | None = None
    ) -> None:
        """(tested, accepted) outcomes in order, each fading the counts by `alpha` first: one call
        for a device-loop run's verifies of a request (8 at a time; a call each was most of the
        adaptive engine's host work per engine step at batch 64). `weights`: what each counts
        (default 1)."""
        keep = 1.0 - alpha
        scale = self._scale
        for n, (tested, accepted) in enumerate(outcomes):
            before, scale = scale, scale * keep
            if scale < self._FLOOR:  # renormalise: the counts as they stand before this outcome
                self._scale = before
                self._accepted, self._tested, scale = self.accepted, self.tested, keep
            weight = (1.0 if weights is None else weights[n]) / scale
            counts = self._tested
            for i in range(tested):
                counts[i] += weight
            counts = self._accepted
            for i in range(min(accepted, tested)):
                counts[i] += weight
        self._scale = scale

    def add_together(
        self, tested: Sequence[float], accepted: Sequence[float], count: int, alpha: float
    ) -> None:
        """`count` outcomes at once, each fading the counts by `alpha`, all weighed as the last:
        `tested[i]` / `accepted[i]` of them tested / accepted position i."""
        if not count:
            return
        scale = self._scale * (1.0 - alpha) ** count
        if scale < self._FLOOR:
            self._accepted, self._tested = self.accepted, self.tested
            scale = (1.0 - alpha) ** count
        self._scale = scale
        weight = 1.0 / scale
        for counts, add in ((self._tested, tested), (self._accepted, accepted)):
            for i, n in enumerate(add):
                if n:
                    counts[i] += weight * n

    def add_counts(self, tested: Sequence[float], accepted: Sequence[float], scale: float) -> None:
        """Increments already weighed against the running factor, which becomes `scale`
        (`_fold_own`)."""
        self._tested = [c + n for c, n in zip(self._tested, tested, strict=True)]
        self._accepted = [c + n for c, n in zip(self._accepted, accepted, strict=True)]
        self._scale = scale

    def rate(self, position: int, prior: float, strength: float) -> float:
        scale = self._scale
        return (self._accepted[position] * scale + strength * prior) / (
            self._tested[position] * scale + strength
        )


def expected_tokens(rates: Sequence[float], steps: int) -> float:
    total, survive = 1.0, 1.0
    for rate in rates[:steps]:
        survive *= rate
        total += survive
    return total


def _fold_own(
    owns: Sequence[_Counts],
    present: np.ndarray,
    tests: np.ndarray,
    accepts: np.ndarray,
    alpha: float,
    counts: np.ndarray,
) -> Iterator[tuple[list[float], list[float], float] | None]:
    """Per request, its run's outcomes folded into one increment of its counts, as `_Counts.add_many`
    adds them one by one: its m-th outcome (1-based) weighs 1 / (s (1 - alpha)^m), s its running
    factor before them. `present`: [request, step], whether the step made an outcome; `tests` /
    `accepts`: [request, step, position], whether it tested / accepted the position; `counts`:
    [request, step], what each outcome counts (`AcceptanceTracker.per_token`). Yields
    (tested, accepted, new factor) per request, or None where the factor would pass
    `_Counts._FLOOR` (renormalised one outcome at a time instead)."""
    keep = 1.0 - alpha
    scales = np.array([own._scale for own in owns])
    order = np.cumsum(present, axis=1)  # m of each outcome
    weights = np.where(present, counts * keep ** -order.astype(float) / scales[:, None], 0.0)
    tested = np.einsum("rs,rsp->rp", weights, tests).tolist()
    accepted = np.einsum("rs,rsp->rp", weights, accepts).tolist()
    ends = (scales * keep ** order[:, -1].astype(float)).tolist()
    for row, end in enumerate(ends):
        yield None if end < _Counts._FLOOR else (tested[row], accepted[row], end)


def expected_prefix(rates: Sequence[float]) -> list[float]:
    """[s]: `expected_tokens(rates, s)` for every s from 0 to len(rates), in one pass."""
    out, total, survive = [1.0], 1.0, 1.0
    for rate in rates:
        survive *= rate
        total += survive
        out.append(total)
    return out


def harmonic_prefix(rates: Sequence[float]) -> list[float]:
    """[s]: the tokens a verify of an s-deep chain emits, for every s from 0 to len(rates), where
    `rates` are per-token rates (`AcceptanceTracker.per_token`): with L the drafts a token's start
    would have had accepted (P(L >= i) the product of the first i rates), a chain verifies once per
    1 + min(L, s) tokens, so it emits 1 / E[1 / (1 + min(L, s))] tokens a verify."""
    out, survive, partial = [1.0], 1.0, 0.0  # partial: E over the starts that stop before s
    for i, rate in enumerate(rates):
        partial += survive * (1.0 - rate) / (1 + i)
        survive *= rate
        out.append(1.0 / (partial + survive / (i + 2)))
    return out


def reach(rates: Sequence[float]) -> list[float]:
    out, survive = [], 1.0
    for rate in rates:
        survive *= rate
        out.append(survive)
    return out
