"""Adaptive speculation: each step, the draft shape (or none) with the most accepted tokens per second.

For every prepared tier — speculation off, and draft shapes (num_steps, topk, num_draft_tokens) —
the policy predicts a step's goodput for the running batch:

    sum over requests of E_r[tokens emitted]  /  (draft cost + target cost)

with E_r from the live per-position acceptance (`AcceptanceTracker`, per request) and the costs from
the measured step tables (`StepCosts`: a target pass of batch x (draft tokens + 1), num_steps draft
steps). Speculation off is the tier whose drafts are empty: one token per request for a decode
step's cost. The best tier replaces the current one only when it beats it by `hysteresis` for
`patience` decisions in a row, so noise in the estimates does not make the engine flap between
shapes (each switch may mean other CUDA graphs and a cold draft cache).

While speculation is off nothing is verified, so nothing would tell the policy that the text became
predictable: every `probe_every` steps off, one step runs a speculative tier as a probe (not a
switch), every request drafting the tier's full depth, if any tier could beat decoding were all
its drafts accepted (at a large batch none may: no probe then). The probe's tier is the best under an
optimistic (upper-confidence, `AcceptanceTracker.pooled_upper`) estimate of the pooled acceptance,
not under the mean: a position barely tested gets a bonus, so deep tiers get tried. Issue 9's H100
run shows why: n-gram acceptance is bimodal (a long match or nothing), the policy probed only with
tier 1, whose misses made every deeper tier look hopeless, and stayed off at batch 1 on MT-Bench
while 8-deep drafts doubled throughput. A probe that emits fewer tokens than decoding would have in
the probe's predicted time loses, and each loss doubles the probe interval (up to
`max_probe_every`): on text no drafter predicts, probes (a synchronous step, the overlapped one
before it settled first) fade to a negligible share of the steps. A probe that wins restores
`probe_every`, and its evidence lifts the estimates, so the policy switches back on. A probe is
judged on its measured time (not its predicted one: priced too cheap, probes at batch 64 "won" and
switched the policy on where speculation lost), and one dearer than a decode step waits until its
extra time is at most `probe_share` of the steps off since the last one.

The measured goodput (tokens emitted per second of step, an EMA) sits beside the predicted one for
the metrics; `diagnostics` gives the cost table, the pooled estimates and the probe record for
benchmark reports.

Scoring reads each request's rates once: its expected tokens for every draft depth are prefix sums
of its reach (the chance draft j survives), which never rises with depth, so its draft steps in a
tier are min(depth, positions it reaches with odds of at least `min_reach`) for a model drafter (the
tier's depth for an n-gram lookup, which costs the same however deep) and every tier's score is
a lookup. While nothing was verified since (speculation off) and the batch is the same, the scores
change only as the cost tables drift, so they are kept for up to `rescore_every` decisions: the off
path costs about a tuple comparison per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.config import SpeculativeConfig
from specserve.spec.acceptance import AcceptanceTracker, expected_prefix, reach
from specserve.spec.step_costs import DECODE, DRAFT, VERIFY, StepCosts


@dataclass(frozen=True, order=True)
class Tier:
    """A draft shape; num_steps 0 is speculation off."""

    num_steps: int
    topk: int = 1
    num_draft_tokens: int = 0  # tokens verified per request: num_steps for a chain

    @classmethod
    def chain(cls, num_steps: int) -> Tier:
        return cls(num_steps, 1, num_steps)

    @property
    def off(self) -> bool:
        return self.num_steps == 0

    @property
    def name(self) -> str:
        """`off`, NUM_STEPS (a chain) or NUM_STEPSxTOPKxNUM_DRAFT_TOKENS (a tree)."""
        if self.off:
            return "off"
        return (
            str(self.num_steps) if self.topk == 1 else f"{self.num_steps}x{self.topk}x{self.num_draft_tokens}"
        )

    @property
    def query_len(self) -> int:
        """Tokens per request in the target pass: the draft tokens and the last verified one."""
        return self.num_draft_tokens + 1


OFF = Tier(0, 1, 0)


@dataclass(frozen=True)
class Decision:
    tier: Tier
    steps: dict[str, int]  # request id -> its draft steps (0: it decodes this step)
    predicted_goodput: float  # tokens per second the chosen tier is expected to emit
    switched: bool


class AdaptivePolicy:
    """`overlapped_off`: the engine runs plain steps overlapped, so speculation off costs a measured
    `DECODE` step (once one was measured), not a synchronous pass of one token. `draft_per_step`:
    a draft costs its steps times a `DRAFT` step (a model drafter's forwards); else one `DRAFT`
    entry is the whole draft, however deep (an n-gram lookup finds its match once and copies what
    follows: charged per step, 8-deep drafts looked twice their cost and lost to 4-deep ones)."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        costs: StepCosts,
        acceptance: AcceptanceTracker,
        hysteresis: float = 0.05,
        patience: int = 3,
        min_reach: float = 0.05,
        probe_every: int = 32,
        goodput_alpha: float = 0.1,
        rescore_every: int = 16,
        max_probe_every: int | None = None,
        probe_z: float = 1.0,
        overlapped_off: bool = False,
        draft_per_step: bool = True,
        probe_share: float = 0.03,
    ) -> None:
        if not tiers:
            raise ValueError("tiers: at least one")
        self.tiers = tuple(sorted(set(tiers)))
        self.costs, self.acceptance = costs, acceptance
        self.hysteresis, self.patience, self.min_reach = hysteresis, patience, min_reach
        self.probe_every, self.goodput_alpha = probe_every, goodput_alpha
        self.max_probe_every = max_probe_every or 8 * probe_every
        self.probe_z, self.overlapped_off, self.draft_per_step = probe_z, overlapped_off, draft_per_step
        self.rescore_every, self.probe_share = rescore_every, probe_share
        self._scored: _Scores | None = None
        self._scored_age = 0
        self.current: Tier | None = None
        self.switches = 0
        self.measured_goodput = 0.0
        self.probe_interval = probe_every  # steps off between probes: grows while probes lose
        self.probes = self.probes_won = 0
        self._since_probe = 0
        self._probing: tuple[Tier, float] | None = None  # the probe in flight, tokens it must beat
        self._challenger: Tier | None = None
        self._streak = 0
        self.last_batch = 0

    def goodput(self, tier: Tier, request_ids: Sequence[str]) -> float:
        """Predicted tokens per second of one step of `tier` over these requests."""
        return self._score(tuple(request_ids)).goodput[tier]

    def step_seconds(self, tier: Tier, batch: int) -> float:
        if tier.off and self.overlapped_off and self.costs.knows(DECODE):
            return self.costs.estimate(DECODE, batch, 1)
        seconds = self.costs.estimate(VERIFY, batch, tier.query_len)
        if not tier.off:
            draft = self.costs.estimate(DRAFT, batch, tier.topk)
            seconds += tier.num_steps * draft if self.draft_per_step else draft
        return seconds

    def decide(self, request_ids: Sequence[str]) -> Decision:
        """The tier for this step's decoding requests, and each one's draft steps."""
        ids = tuple(request_ids)
        scored = self._scored
        if (
            scored is None
            or scored.version != self.acceptance.version
            or scored.ids != ids
            or self._scored_age >= self.rescore_every
        ):
            scored = self._scored = self._score(ids)
            self._scored_age = 0
        self._scored_age += 1
        self.last_batch = len(ids)
        scores = scored.goodput
        best = max(self.tiers, key=lambda t: (scores[t], -t.num_steps))
        switched = self._update(best, scores)
        probe = self._probe(scored)
        tier = probe or self.current
        if probe is not None:
            steps = dict.fromkeys(ids, probe.num_steps)  # a probe tests every position it can
            predicted = self._upper_goodput(probe, len(ids))
        else:
            steps, predicted = scored.steps_of(tier), scores[tier]
        return Decision(tier, steps, predicted, switched)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step emitted `tokens` in `seconds` (draft and target): the measured goodput's EMA, and
        a probe's verdict (see `observe_probe`)."""
        if seconds > 0:
            rate = tokens / seconds
            old = self.measured_goodput
            self.measured_goodput = rate if old == 0 else old + self.goodput_alpha * (rate - old)

    def observe_probe(self, tokens: int, seconds: float | None = None) -> None:
        """The probe step just run emitted `tokens` over its requests in `seconds` (its draft and
        verify; None: as predicted): won when at least what decoding would have emitted in that
        time (interval back to `probe_every`), else lost (interval doubled, up to
        `max_probe_every`). Judged on the measured time, so a probe priced too cheap cannot win."""
        if self._probing is None:
            return
        tier, needed = self._probing
        self._probing = None
        if seconds is not None and seconds > 0:
            needed *= seconds / self.step_seconds(tier, self.last_batch or 1)
        self.probes += 1
        if tokens >= needed:
            self.probes_won += 1
            self.probe_interval = self.probe_every
        else:
            self.probe_interval = min(2 * self.probe_interval, self.max_probe_every)

    def diagnostics(self, batch: int | None = None) -> dict:
        """What the policy would say at `batch` (default: the last decision's): each tier's predicted
        step ms, the pooled per-position acceptance (with its evidence), the probe record."""
        batch = batch or self.last_batch or 1
        topks = sorted({t.topk for t in self.tiers if not t.off}) or [1]
        return {
            "batch": batch,
            "current": self.current.name if self.current is not None else None,
            "step_ms": {t.name: round(self.step_seconds(t, batch) * 1e3, 4) for t in self.tiers},
            "pooled_acceptance": {k: [round(r, 3) for r in self.acceptance.pooled(k)] for k in topks},
            "pooled_tested": {k: [round(n, 1) for n in self.acceptance.pooled_tested(k)] for k in topks},
            "switches": self.switches,
            "probes": self.probes,
            "probes_won": self.probes_won,
            "probe_interval": self.probe_interval,
        }

    def _score(self, ids: tuple[str, ...]) -> _Scores:
        """Each tier's predicted goodput over `ids`: every request's rates read once, per topk."""
        batch = len(ids)
        goodput: dict[Tier, float] = {}
        per_request: dict[int, list[tuple[str, list[float], int]]] = {}
        for topk in {t.topk for t in self.tiers if not t.off}:
            rows = []
            for rid, rates in self.acceptance.rates_of(ids, topk).items():
                # A lookup costs the same however deep: only a model drafter's depth is cut per request
                # (cut, an n-gram request fresh from a miss drafted 3 when its match ran on for 8).
                reach_count = (
                    sum(1 for p in reach(rates) if p >= self.min_reach) if self.draft_per_step else len(rates)
                )
                rows.append((rid, expected_prefix(rates), reach_count))
            per_request[topk] = rows
        for tier in self.tiers:
            if not batch:
                goodput[tier] = 0.0
                continue
            if tier.off:
                tokens = float(batch)
            else:
                k = tier.num_steps
                tokens = sum(prefix[max(1, min(k, n))] for _, prefix, n in per_request[tier.topk])
            goodput[tier] = tokens / self.step_seconds(tier, batch)
        return _Scores(ids, self.acceptance.version, goodput, per_request)

    def _upper_goodput(self, tier: Tier, batch: int) -> float:
        """`tier`'s goodput over `batch` requests under the pooled upper confidence bounds."""
        upper = expected_prefix(self.acceptance.pooled_upper(tier.topk, self.probe_z))
        return batch * upper[min(tier.num_steps, len(upper) - 1)] / self.step_seconds(tier, batch)

    def _probe(self, scored: _Scores) -> Tier | None:
        """A speculative tier to probe with, once every `probe_interval` steps with speculation off:
        the best under the upper confidence bounds of the pooled acceptance."""
        if not self.current.off:
            return self._probe_off(len(scored.ids))
        self._since_probe += 1
        speculative = [t for t in self.tiers if not t.off]
        if self._since_probe < self.probe_interval or not speculative or not scored.ids:
            return None
        batch = len(scored.ids)
        # Only a tier that could win were every draft accepted is worth a probe (at a large batch,
        # where drafting and a wide verify cost several decode steps, none may be).
        off_rate = scored.goodput[self.current]
        hopeful = [t for t in speculative if batch * t.query_len / self.step_seconds(t, batch) > off_rate]
        if not hopeful:
            self._since_probe = 0
            return None
        tier = max(hopeful, key=lambda t: self._upper_goodput(t, batch))
        # A probe that loses costs its step beyond a decode step: probe seldom enough that this
        # stays within `probe_share` of the time off (at batch 64 a probe costs ~2 decode steps).
        seconds, off_seconds = self.step_seconds(tier, batch), batch / off_rate
        if self._since_probe * self.probe_share * off_seconds < seconds - off_seconds:
            return None  # not yet: the steps off keep counting
        self._since_probe = 0
        # To win, it must emit what decoding would in the probe's time.
        self._probing = (tier, off_rate * seconds)
        return tier

    def _probe_off(self, batch: int) -> Tier | None:
        """While speculating: one plain step every `probe_every` steps until a plain step at this
        batch has been measured. Until then its price is derived (the start-up profile of a
        one-token pass, which on the H100 once came out 2.5x slow), and a tier the policy believes
        dear it never runs, so the price would stand for good. No verdict: a measurement."""
        off = next((t for t in self.tiers if t.off), None)
        kind = DECODE if self.overlapped_off else VERIFY
        if off is None or not batch or self.costs.measured_live(kind, batch, 1):
            self._since_probe = 0
            return None
        self._since_probe += 1
        if self._since_probe < self.probe_every:
            return None
        self._since_probe = 0
        self._probing = None
        return off

    def _update(self, best: Tier, scores: dict[Tier, float]) -> bool:
        if self.current is None:
            self.current = best
            return False
        if best == self.current or scores[best] <= scores[self.current] * (1 + self.hysteresis):
            self._challenger, self._streak = None, 0
            return False
        self._streak = self._streak + 1 if best == self._challenger else 1
        self._challenger = best
        if self._streak < self.patience:
            return False
        self.current, self._challenger, self._streak = best, None, 0
        self._since_probe = 0  # each regime counts its own steps to its first probe
        self.switches += 1
        self.probe_interval = self.probe_every  # a new regime: probe at the base rate when off again
        return True


@dataclass
class _Scores:
    """One scoring of a batch: kept while its requests and the acceptance estimates stand."""

    ids: tuple[str, ...]
    version: int
    goodput: dict[Tier, float]
    per_request: dict[int, list[tuple[str, list[float], int]]]  # topk -> (id, expected prefix, reach count)
    steps: dict[Tier, dict[str, int]] = field(default_factory=dict)

    def steps_of(self, tier: Tier) -> dict[str, int]:
        """Each request's draft steps in `tier` (0 when off), made once per scoring."""
        steps = self.steps.get(tier)
        if steps is None:
            if tier.off:
                steps = dict.fromkeys(self.ids, 0)
            else:
                k = tier.num_steps
                steps = {rid: max(1, min(k, n)) for rid, _, n in self.per_request[tier.topk]}
            self.steps[tier] = steps
        return steps


def default_tiers(num_steps: int, topk: int = 1, num_draft_tokens: int | None = None) -> tuple[Tier, ...]:
    """Off, chains of 1, 2, 4, ... up to `num_steps`, and the configured tree when topk > 1."""
    tiers = {OFF, Tier.chain(num_steps)}
    tiers.update(Tier.chain(s) for s in (1, 2, 4, 8, 16, 32) if s < num_steps)
    if topk > 1:
        tiers.add(Tier(num_steps, topk, num_draft_tokens or num_steps))
    return tuple(sorted(tiers))


def configured_tiers(spec: SpeculativeConfig) -> tuple[Tier, ...]:
    """The tiers `spec.adaptive` names, else `default_tiers` of the configured shape."""
    if spec.adaptive is None or spec.adaptive.tiers is None:
        return default_tiers(spec.num_steps, spec.topk, spec.draft_tokens)
    return tuple(sorted({Tier(*shape) for shape in spec.adaptive.tiers}))
