"""What each tier's steps really emitted against what the policy predicted for them.

The policy's prediction of a tier's goodput is a model: live acceptance estimates times step-cost
tables. Where the model is wrong in a way that depends on the tier, it picks the wrong tier for good.
Issue 9's H100 runs show two such errors. At batch 16 on MT-Bench the pooled estimates of deep
n-gram positions (0.73-0.90 each, conditional on the draft reaching them) far exceed what the static
chains imply (~0.43 for position 2): the deep positions get tested while the policy holds a long
chain, which it does after copying stretches. So the 8-chain looked worth ~2.5 tokens a verify,
and the policy kept going back to it (28 switches in four batches, 0.95x the best static chain).
And the loop tiers are priced by back-to-back loop steps without host work.

So every speculative tier's prediction is corrected by what its steady steps measured: the tokens
they emitted over the tokens the prediction promised in the same seconds, over faded sums (`fade`
per step of that tier), per tier and batch class (powers of two: the cost model errs differently at
batch 1 and 64). Only errors between tiers are corrected: a tier's factor is its ratio over the
reference, the mean ratio of the tiers measured in its class, so an error common to every
speculative tier moves none of them against speculation off (a measured step already), and a tier
not yet measured keeps its prediction. Corrected outright, the simulated batch-64 runs
(`scripts/adaptive_sim.py`, where runs of 8 verifies waste rows on requests near their end) went off
and lost 3%.

At batch 1 (the engine's `COUNTERFACTUAL_BATCH`, `specserve/engine/adaptive_control.py`, which says
why not at larger ones) a chain tier is judged on every verify of any chain, not only on its own
steps (`ChainOutcomes`): greedy chains of one drafter share their drafts' prefixes, so a verify of a
chain D deep that kept a drafts says what a chain d deep would have kept on that draft, min(a, d),
for d <= D or a < D; past D, with all D kept, the estimates' own promise for the positions past D
stands in (neutral: only what was verified moves a correction). Judged on its own steps only, a
tier's ratio holds the states the policy picked it in: on the H200 (mixed prompts, batch 1) it ran
the 8-chain when a request's estimates were high, those steps made 0.54 of their promise against
the 1-chain's 1.05 on the steps left to it, and the policy held the 1-chain (0.92-0.95x the static
8-chain) where every static chain from 2 up made more.

A tier's ratio weighs by its evidence against `PRIOR` observations of the reference's, and the
reference is a mean, not the best ratio: on the H200 (mixed prompts, batch 64) one step of the
8-chain, run before its loop steps had priced it, made 1.53x its promise; as the reference it scored
every other tier down by a third, below speculation off, and the policy was off for 209 of 337
engine steps (0.86x the best static chain).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A correction stays within these: one step's evidence at a time, a burst of copying (or of misses)
# within a few steps may swing the measured tokens far from any estimate.
LOW, HIGH = 0.25, 2.0
# Per observation of another tier in its class: a correction not renewed is half gone after ~140
# (~6 batches of 16 requests in a device loop on the H100, a few seconds). Faster (half gone after
# 35), the modelled batch 64 of tests/test_spec_adaptive_rows.py went back to the 8-chain it had
# left, again and again.
IDLE_FADE = 0.995
# Observations of the class's typical error a tier's own ratio is weighed against: one step's ratio
# counts two thirds, a tier's saturated evidence (1 / (1 - fade): 5 at 0.8) ten elevenths. At 1, the
# 8-chain's 15% shortfall in tests/test_spec_adaptive_rows.py counted 12% and the policy went back to
# it more often (171 runs against 154 over 16 seeds).
PRIOR = 0.5
# A verify that kept every draft of a chain whose estimates gave it less than this chance of doing so
# says nothing of a deeper chain: the promise past it divided by this reach would blow up.
MIN_REACH = 0.01


@dataclass
class _Sums:
    measured: float = 0.0  # tokens the steps emitted, faded
    predicted: float = 0.0  # tokens the predictions promised in the steps' seconds, faded
    weight: float = 0.0  # the observations behind them, faded alike
    seen: int = 0  # the class's observations when this tier's last came

    @property
    def ratio(self) -> float:
        return min(max(self.measured / self.predicted, LOW), HIGH)


def batch_class(batch: int) -> int:
    """1, 2-3, 4-7, ...: batch sizes whose predictions err alike share a correction."""
    return max(batch, 1).bit_length()


class GoodputCalibration:
    """Per (tier, batch class): measured over predicted tokens of its steady steps, faded by `fade`
    per step of the tier (any hashable key), drawn back to no correction by `idle_fade` per step of
    another."""

    def __init__(self, fade: float = 0.8, idle_fade: float = IDLE_FADE) -> None:
        if not 0 <= fade < 1:
            raise ValueError("fade: must be in [0, 1)")
        if not 0 < idle_fade <= 1:
            raise ValueError("idle_fade: must be in (0, 1]")
        self.fade, self.idle_fade = fade, idle_fade
        self._sums: dict[tuple[object, int], _Sums] = {}
        self._seen: dict[int, int] = {}  # batch class -> its observations
        self.version = 0  # counts observations: factors read since are current when unchanged

    def observe(
        self, tier: object, batch: int, tokens: float, seconds: float, predicted_goodput: float
    ) -> None:
        """A steady step of `tier` over `batch` requests emitted `tokens` in `seconds`, where the
        policy had predicted `predicted_goodput` tokens per second."""
        promised = predicted_goodput * seconds
        if promised <= 0 or tokens < 0:
            return
        cls = batch_class(batch)
        sums = self._sums.setdefault((tier, cls), _Sums())
        sums.measured = sums.measured * self.fade + tokens
        sums.predicted = sums.predicted * self.fade + promised
        sums.weight = sums.weight * self.fade + 1.0
        sums.seen = self._seen[cls] = self._seen.get(cls, 0) + 1
        self.version += 1

    def factors(self, tiers: list, batch: int) -> dict:
        """Each of `tiers`' correction at `batch`: its ratio over the reference, drawn towards 1 by
        the trust it lacks (its evidence against `PRIOR`); an unmeasured tier's correction is 1. The
        reference is the class's mean ratio weighed by evidence times trust, so that the corrections'
        mean weighed by evidence is 1: speculation as a whole keeps its standing against off."""
        cls = batch_class(batch)
        seen = self._seen.get(cls, 0)
        own = {t: self._weighed(s, seen) for t in tiers if (s := self._sums.get((t, cls))) is not None}
        trusted = {t: (ratio, weight / (weight + PRIOR), weight) for t, (ratio, weight) in own.items()}
        mass = sum(trust * weight for _, trust, weight in trusted.values())
        if mass <= 0:
            return dict.fromkeys(tiers, 1.0)
        reference = sum(ratio * trust * weight for ratio, trust, weight in trusted.values()) / mass
        factors = dict.fromkeys(tiers, 1.0)
        for tier, (ratio, trust, _) in trusted.items():
            factors[tier] = min(max(trust * ratio / reference + 1 - trust, LOW), HIGH)
        return factors

    def weight(self, tier: object, batch: int) -> float:
        """The evidence behind `tier`'s ratio at `batch`: its faded observations, aged (0: none)."""
        cls = batch_class(batch)
        sums = self._sums.get((tier, cls))
        return 0.0 if sums is None else self._weighed(sums, self._seen.get(cls, 0))[1]

    def _weighed(self, sums: _Sums, seen: int) -> tuple[float, float]:
        """`sums`' ratio and the evidence behind it: its faded observations, times `idle_fade` per
        observation of another tier since its own last (text changes, and a tier left for an error
        it made an hour ago never runs again to show it no longer makes it)."""
        return sums.ratio, self.idle_fade ** (seen - sums.seen) * sums.weight

    def snapshot(self) -> dict[str, float]:
        """`TIER@CLASS` -> its correction, for diagnostics (the tier's `name` where it has one)."""
        return {
            f"{getattr(t, 'name', t)}@{1 << (c - 1)}": round(s.ratio, 3)
            for (t, c), s in sorted(self._sums.items(), key=lambda kv: (kv[0][1], str(kv[0][0])))
        }


def chain_outcomes(
    prefix: Sequence[float], verifies: Sequence[tuple[int, int]], depths: Sequence[int]
) -> list[tuple[float, float]]:
    """For each chain depth of `depths`: the tokens it would have emitted over `verifies` ((drafted,
    accepted) of one request's chain drafts, in order) and the tokens `prefix` (that request's
    `expected_prefix` before them) promised it. Past a draft whose every token was kept the
    promise stands in for the positions it did not reach; where it held no hope of reaching them
    (reach below `MIN_REACH`) that verify says nothing of the deeper chain."""
    out = []
    for depth in depths:
        made = promised = 0.0
        expected = prefix[min(depth, len(prefix) - 1)]
        for drafted, accepted in verifies:
            if drafted <= 0:
                continue
            if depth <= drafted or accepted < drafted:
                made += min(accepted, depth) + 1
            else:
                reach = prefix[drafted] - prefix[drafted - 1]
                if reach < MIN_REACH:
                    continue
                made += drafted + 1 + (expected - prefix[drafted]) / reach
            promised += expected
        out.append((made, promised))
    return out


class ChainOutcomes:
    """Per chain depth, what the verifies since the last `take` would have made under it and what
    the estimates promised (`chain_outcomes`), summed over requests."""

    def __init__(self, depths: Sequence[int]) -> None:
        self.depths = tuple(sorted(depths))
        self._sums = [[0.0, 0.0] for _ in self.depths]

    def add(self, prefix: Sequence[float], verifies: Sequence[tuple[int, int]]) -> None:
        for sums, (made, promised) in zip(
            self._sums, chain_outcomes(prefix, verifies, self.depths), strict=True
        ):
            sums[0] += made
            sums[1] += promised

    def take(self) -> dict[int, tuple[float, float]]:
        """depth -> (made, promised) of the depths with a promise; cleared for the next step."""
        out = {d: (m, p) for d, (m, p) in zip(self.depths, self._sums, strict=True) if p > 0}
        self._sums = [[0.0, 0.0] for _ in self.depths]
        return out
