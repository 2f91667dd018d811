"""Adaptive speculation: each step, the draft shape (or none) with the most accepted tokens per second.

For every prepared tier — speculation off, and draft shapes (num_steps, topk, num_draft_tokens) —
the policy predicts a step's goodput for the running batch:

    sum over requests of E_r[tokens emitted]  /  (draft cost + target cost)

with E_r from the live per-position acceptance (`AcceptanceTracker`, per request) and the costs from
the measured step tables (`StepCosts`: a target pass of batch x (draft tokens + 1), num_steps draft
steps). Speculation off is the tier whose drafts are empty: one token per request for a decode
step's cost. The best tier replaces the current one only when it beats it by `hysteresis` over
`patience` verifies (decisions in a row, synchronously; a device loop's engine step settles a run of
up to 8), so noise in the estimates does not make the engine flap between shapes (each switch may
mean other CUDA graphs and a cold draft cache). Where a switch costs time of its own (a device loop's
runs are queued back to back, and a switch to or from speculation off exposes the host's settle of
the last run and the setup of a fresh one, `observe_switch_cost` and `observe_setup_cost`; between
the loops' chain lengths the next run is queued on the device as well, `switch_on_device`: no cost), the
challenger must win long enough for its gain to have paid for one: its streak in verifies at least
the switch's seconds over the gain's per verify of the standing tier (`_patience_for`). A gain of 5% pays for a 4 ms settle at batch 64 (1.4 ms loop steps) in ~57
verifies. Counted as 3, an A/B in one call on the H200 (the shipped head, MT-Bench) made 0.93 / 0.82
/ 0.98x the best static chain at batch 4 / 16 / 64 (its tier steps spread over 3-5 tiers), with the
settle paid for 1.00 / 0.99 / 1.01x (3 / 0 / 8 switches). While a chain stands, the positions past it up to
the next deeper tier's are scored by their upper confidence bound (`_explore_span`): the standing
chain never tests them, and a deeper tier must get run to be judged.

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

A tier whose steps made less than it promised, against another that kept its word better, is
scored down by the ratio (`specserve/spec/calibration.py`): the model of a tier's goodput errs by
tier (deep n-gram positions overrated after copying stretches), and the policy kept going back to a
tier that lost.

The measured goodput (tokens emitted per second of step, an EMA) sits beside the predicted one for
the metrics; `diagnostics` gives the cost table, the pooled estimates and the probe record for
benchmark reports.

What a tier costs and how deep each request drafts in it: a verify padded to a CUDA-graph bucket
costs the bucket of its widest row, so a narrower row is free and every request of an n-gram tier
drafts the tier's depth; an eager verify (no graphs: the CPU, tensor parallelism, a batch past the
largest bucket) costs by its tokens, and each request gets its own depth, 0 .. the tier's
(`specserve/spec/draft_depths.py`, `VerifyShapes`). A model drafter's request drafts only the
positions it reaches with odds of at least `min_reach`.

What tiers are compared by (`decide`'s `remaining`): with requests waiting to be admitted, a request
that finishes early makes room for one, and the step's goodput counts. With none waiting, the
batch's end does: `remaining` (tokens each may still emit) turns the score into the drain's tokens
per second, the batch's tokens over the time until its last request finishes at this tier, and a
probe is judged by the steps it saved that request (`observe_probe`). Issue 9, MT-Bench at batch
16: a step of the 8-chain emitted more tokens per second than a plain one (a few requests copying
long matches), so the policy speculated, but its slowest requests made ~1 token a step at 1.6x a
plain step's cost, the fast ones left early and the thin tail of the batch ran at the cost of a
full one: 0.70x plain (`scripts/adaptive_sim.py` reproduced it, 0.89x; 0.99x with the drain).

Scoring reads each request's rates once: its expected tokens for every draft depth are prefix sums
of its reach (the chance draft j survives), which never rises with depth, so every tier's score is
a few lookups per request. While nothing was verified since (speculation off) and the batch is the
same (its requests' remaining tokens all one step on), the scores change only as the cost tables
drift, so they are kept for up to `rescore_every` decisions: the off path costs about a tuple
comparison per step. Shadow drafts (`specserve/spec/shadow.py`) add evidence every plain step;
it rescores every `shadow_rescore_every` decisions (scoring 64 requests after each step's took
more host time than the plain step's own work). Off where no tier could win at the batch whatever
the acceptance (`_hopeless`, from the cost tables alone), a decision reads no request at all.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.config import SpeculativeConfig
from specserve.spec.acceptance import AcceptanceTracker, reach
from specserve.spec.calibration import GoodputCalibration, batch_class
from specserve.spec.draft_depths import (
    VerifyShapes,
    drain_depths,
    drain_steps,
    goodput_depths,
    thinned_drain_seconds,
)
from specserve.spec.step_costs import DECODE, DRAFT, MIN_SAMPLES, SETTLE, SETUP, VERIFY, StepCosts

# A batch this many times the one the standing tier was chosen at decides afresh, without hysteresis.
# At a model drafter's margin (0.15) an engine whose tier was set at batch 2 held the 4-chain when 64
# requests came, where the 3-chain scored 14% more and ran 13% faster (H200, docs/benchmarks.md
# twentieth session). Measured from the least batch run since the choice instead, every batch of 64
# after the one before had thinned to its last few requests decided afresh on its first step's
# estimates: the head's adaptive row wandered over chains 1-4 at batch 16 and 64 (0.958x and 0.915x
# the best static chain, H200, twenty-first session).
GROWTH_RESET = 4


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
MODEL_EVERY_CHAIN = 4  # a model drafter's default tiers: every chain up to this long (`configured_tiers`)
# Plain steps in a row while speculating (`_probe_off`): the first is a transition, the rest steady,
# enough of them for a price (`step_costs.MIN_SAMPLES`).
OFF_PROBE_STEPS = MIN_SAMPLES + 1


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
        shadow_rescore_every: int = 8,
        max_probe_every: int | None = None,
        probe_z: float = 1.0,
        overlapped_off: bool = False,
        draft_per_step: bool = True,
        probe_share: float = 0.03,
        shapes: VerifyShapes | None = None,
        calibration: GoodputCalibration | None = None,
        drain_strength: float | None = None,
        drain_thinning: bool = False,
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
        self.shadow_rescore_every = shadow_rescore_every
        self.shapes = shapes  # None: every verify padded to its widest row (graphs at every shape)
        self.calibration = calibration  # None: predictions taken as they are
        # the pool's weight in each request's rates where the drain forecasts the batch's end (None:
        # the tracker's, as for a step): a request's own evidence is its last ~10 verifies, and the
        # end lies a whole answer ahead, over which its text turns as the pool's does
        self.drain_strength = drain_strength
        # the drain's steps after a request ends priced at the requests still running, not the
        # whole batch (`thinned_drain_seconds`): opt-in until the GPU's batch-64 rows settle it
        self.drain_thinning = drain_thinning
        # (scores, the calibration's version) -> the corrected scores: the off path reuses one scoring
        # for many steps, and correcting it anew each step was host work on every plain step
        self._corrected: tuple[_Scores, int, dict[Tier, float]] | None = None
        self._speculative = [t for t in self.tiers if not t.off]
        self._widths = sorted({1, *(t.query_len for t in self.tiers if t.topk == 1)})
        self._topks = sorted({t.topk for t in self.tiers if not t.off})
        self._idle: dict[str, int] = {}  # request -> speculative steps in a row it drafted nothing
        self._scored: _Scores | None = None
        self._scored_age = 0
        self._gate: tuple[int, int, bool] | None = None  # (batch, `_decisions` when judged, hopeless)
        self._decisions = 0
        self.hopeless = False  # the last decision was off with no tier able to win (`_hopeless`)
        self.current: Tier | None = None
        self._last_on: Tier | None = None  # the last speculative tier that stood (`_resumes`)
        # Chain lengths whose runs the engine queues on the device behind each other's (its device
        # loops share the requests' state): a switch among them exposes no settle and no setup
        self.switch_on_device: frozenset[int] = frozenset()
        self.switches = 0
        self.switches_at: Counter[int] = Counter()  # batch -> switches decided there
        self.measured_goodput = 0.0
        self.probe_interval = probe_every  # steps off between probes: grows while probes lose
        self.probes = self.probes_won = 0
        self._since_probe = 0
        self._off_left = 0  # plain steps still to run in a row of `_probe_off`'s
        self._probing: tuple[Tier, float] | None = None  # the probe in flight, tokens it must beat
        self._probe_left: dict[str, int] | None = None  # its requests' tokens left (drain), or None
        self._challenger: Tier | None = None
        self._streak = 0
        self.last_batch = 0
        self._chosen_at = 0  # the batch the standing tier was chosen at (0: none yet)

    def goodput(self, tier: Tier, request_ids: Sequence[str]) -> float:
        """Predicted tokens per second of one step of `tier` over these requests."""
        return self._score(tuple(request_ids), None).goodput[tier]

    def step_seconds(self, tier: Tier, batch: int) -> float:
        """A step of `tier` over `batch` requests, each drafting the tier's full depth."""
        if tier.off and self.overlapped_off and self.costs.knows(DECODE):
            return self.costs.estimate(DECODE, batch, 1)
        k = tier.num_steps
        return self._step_seconds(tier, batch, k, batch if k else 0, batch * k)

    def verify_seconds(self, batch: int, tokens: int, deepest: int) -> float:
        """A target pass over `batch` requests of `tokens` tokens in all, the widest drafting
        `deepest`: its CUDA-graph bucket's cost, or (eager) by its tokens (`draft_depths`)."""
        if self.shapes is None:
            width = next((w for w in self._widths if w > deepest), deepest + 1)
        else:
            width = self.shapes.bucket(batch, deepest + 1)
            if width is None:
                return self._eager_seconds(batch, tokens / batch)
        return self.costs.estimate(VERIFY, batch, width)

    def decide(
        self, request_ids: Sequence[str], remaining: Sequence[int] | None = None, verifies: int = 1
    ) -> Decision:
        """The tier for this step's decoding requests, and each one's draft steps. `remaining`: the
        tokens each may still emit, when no request waits to be admitted: the tiers are then judged
        by how soon the batch finishes (`draft_depths`), not by this step's tokens per second.
        `verifies`: the verifies since the decision before (a device loop's run settles up to 8 in
        one engine step): what hysteresis and the probes of plain steps count, so that they take as
        many verifies with the loop as without it."""
        ids = tuple(request_ids)
        verifies = max(verifies, 1)
        self.hopeless = self.stays_off(len(ids))  # as the caller's own asking just before, if it did
        self._decisions += 1
        if self.hopeless:
            return self._stay_off(ids)
        # Decoding moves every request on by one token: only a change beyond that rescores.
        lead = None if remaining is None else _lead(remaining)
        scored = self._scored
        acceptance = self.acceptance
        if (
            scored is None
            or scored.version != acceptance.version
            or scored.ids != ids
            or scored.lead != lead
            or scored.explore != self._explore_key()
            or self._scored_age >= self.rescore_every
            or (
                scored.shadow_version != acceptance.shadow_version
                and self._scored_age >= self.shadow_rescore_every
            )
        ):
            scored = self._scored = self._score(ids, remaining, lead)
            self._scored_age = 0
        self._scored_age += 1
        self.last_batch = len(ids)
        scores = self._calibrated(scored)
        best = max(self.tiers, key=lambda t: (scores[t], -t.num_steps))
        switched = self._update(best, scores, verifies) if self._known(ids) else self._hold()
        probe = self._probe(scored, verifies)
        tier = probe or self.current
        if probe is not None:
            steps = dict.fromkeys(ids, probe.num_steps)  # a probe tests every position it can
            predicted = self._upper_goodput(probe, len(ids))
        else:
            steps, predicted = self._revisit(tier, scored.steps_of(tier), verifies), scored.goodput[tier]
        return Decision(tier, steps, predicted, switched)

    def forget(self, request_id: str) -> None:
        self._idle.pop(request_id, None)

    def observe_switch_cost(self, batch: int, seconds: float) -> None:
        """A switch at `batch` would cost `seconds` of its own: the host's settle of a device-loop
        run, hidden behind the next run while the tier stands, exposed when it changes."""
        self.costs.observe(SETTLE, batch, 1, seconds)

    def observe_setup_cost(self, batch: int, seconds: float) -> None:
        """A fresh device-loop run over `batch` requests took the host `seconds` to set up: a switch
        leaves the device idle for that too, after the settle."""
        self.costs.observe(SETUP, batch, 1, seconds)

    def switch_seconds(self, batch: int, start: Tier | None = None, end: Tier | None = None) -> float:
        """What a switch from `start` to `end` costs at `batch`: nothing between chains the device
        switches between (`switch_on_device`), else the cost tables' `SETTLE` and `SETUP`, each where
        measured (none: a synchronous engine, whose step after a switch is as dear as any). Priced
        by the settle alone, a switch at batch 64 on the H200 was 2.7-4.0 ms, less than half of what
        it left the device idle for (6.7-9.7 ms with the setup), and n-gram tiers within 3% of each
        other took turns (59 switches, 0.95x the best static chain; docs/benchmarks.md,
        twenty-third session)."""
        if start is not None and end is not None and self._on_device(start) and self._on_device(end):
            return 0.0
        costs = self.costs
        return sum(costs.estimate(kind, batch, 1) for kind in (SETTLE, SETUP) if costs.measures(kind))

    def _on_device(self, tier: Tier) -> bool:
        return tier.topk == 1 and tier.num_steps in self.switch_on_device

    def observe_outcome(self, tier: Tier, batch: int, tokens: int, seconds: float, predicted: float) -> None:
        """A steady step (or device-loop run) of `tier` over `batch` requests emitted `tokens` in
        `seconds`, where `predicted` tokens per second were expected: the tier's correction
        (`specserve/spec/calibration.py`). Speculation off is priced by its measured steps already."""
        if self.calibration is not None and not tier.off and seconds > 0:
            self.calibration.observe(tier, batch, tokens, seconds, predicted)

    def observe_chain_outcomes(self, batch: int, outcomes: dict[Tier, tuple[float, float]]) -> None:
        """What each chain tier would have emitted over a step's verifies of `batch` requests, against
        what its estimates promised ((made, promised) tokens, `calibration.ChainOutcomes`): the chain
        tiers' corrections, judged on the same drafts."""
        if self.calibration is not None:
            for tier, (made, promised) in outcomes.items():
                self.calibration.observe(tier, batch, made, 1.0, promised)

    def _calibrated(self, scored: _Scores) -> dict[Tier, float]:
        """`scored`'s scores, each speculative tier's times its correction at the batch."""
        calibration = self.calibration
        if calibration is None or not calibration.version:
            return scored.score
        kept = self._corrected
        if kept is not None and kept[0] is scored and kept[1] == calibration.version:
            return kept[2]
        factors = calibration.factors(self._speculative, len(scored.ids))
        corrected = {t: s * factors.get(t, 1.0) for t, s in scored.score.items()}
        self._corrected = (scored, calibration.version, corrected)
        return corrected

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step emitted `tokens` in `seconds` (draft and target): the measured goodput's EMA, and
        a probe's verdict (see `observe_probe`)."""
        if seconds > 0:
            rate = tokens / seconds
            old = self.measured_goodput
            self.measured_goodput = rate if old == 0 else old + self.goodput_alpha * (rate - old)

    def observe_probe(
        self, tokens: int, seconds: float | None = None, emitted: dict[str, int] | None = None
    ) -> None:
        """The probe step just run emitted `tokens` over its requests in `seconds` (its draft and
        verify; None: as predicted): won when at least what decoding would have emitted in that
        time (interval back to `probe_every`), else lost (interval doubled, up to
        `max_probe_every`). Judged on the measured time, so a probe priced too cheap cannot win,
        unless steady steps of the tier measured its price at this batch: a probe of a device-loop
        tier runs synchronously, at several times a loop step's cost (the H200, mixed prompts,
        batch 64: 5.5 against 2.1 ms for the 2-chain), and every probe lost while the static chains
        made 1.2-1.4x plain; the policy stayed off.
        Decided on the drain (`emitted`: each request's tokens, 1 where not given), it is judged by
        what it did for the batch's last requests, counted for the whole batch: their mean tokens,
        over those a step of the tier could leave last (within its query length of the most tokens
        left). A probe whose predictable requests raced ahead while the slowest one made a token
        did nothing for the batch's end (issue 9, batch 16: such probes "won" and the tail paid for
        them). Judged by the least any of them made, a probe at a batch's start, every request tied
        at its `max_new_tokens`, won only when every request kept a draft, and lost nearly always:
        the likeliest way the H200's MT-Bench batch-16 row stayed off for 140 of 263 engine steps
        while every static chain made 1.05-1.10x plain (1 of 7 probes won)."""
        if self._probing is None:
            return
        tier, needed = self._probing
        left, self._probing, self._probe_left = self._probe_left, None, None
        if left and emitted is not None:
            most = max(left.values())
            last = [emitted.get(rid, 1) for rid, r in left.items() if r > most - tier.query_len]
            tokens = len(left) * sum(last) / len(last)
        if seconds is not None and seconds > 0:
            batch = self.last_batch or 1
            priced = self.step_seconds(tier, batch)
            if self.costs.measured_live(VERIFY, batch, tier.query_len):
                seconds = min(seconds, priced)  # what its steps cost once switched to, measured
            needed *= seconds / priced
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
            "objective": "drain" if self._scored is not None and self._scored.left else "goodput",
            "step_ms": {t.name: round(self.step_seconds(t, batch) * 1e3, 4) for t in self.tiers},
            "profile_ms": self._profile_ms(batch),
            "pooled_acceptance": {k: [round(r, 3) for r in self.acceptance.pooled(k)] for k in topks},
            "pooled_tested": {k: [round(n, 1) for n in self.acceptance.pooled_tested(k)] for k in topks},
            "switches": self.switches,
            "switches_at_batch": self.switches_at.get(batch, 0),
            "switch_ms": round(self.switch_seconds(batch) * 1e3, 4),
            "probes": self.probes,
            "probes_won": self.probes_won,
            "probe_interval": self.probe_interval,
            "calibration": self.calibration.snapshot() if self.calibration is not None else {},
        }

    def _profile_ms(self, batch: int) -> dict[str, float]:
        """Each tier's verify as the start-up profile timed it at `batch` (its graph bucket's width):
        beside `step_ms`, how much of a price live steps added. At MT-Bench batch 16 on the H200 the
        1- and 2-chains, never run there, were priced 12% over decoding, where they cost ~6% more
        when run (docs/benchmarks.md, thirty-third session)."""
        out = {}
        for tier in self.tiers:
            width = tier.query_len
            if self.shapes is not None and tier.topk == 1:
                width = self.shapes.bucket(batch, width) or width
            profiled = self.costs.profiled(VERIFY, batch, width)
            if profiled is not None:
                out[tier.name] = round(profiled * 1e3, 4)
        return out

    def stays_off(self, batch: int) -> bool:
        """Whether the next decision over `batch` requests is off without reading them (`_hopeless`):
        the caller need not gather what `decide` would not read (`remaining`)."""
        if self.current is None or not self.current.off or not batch:
            self._gate = None  # the cost tables move on meanwhile: judged afresh when off again
            return False
        return self._hopeless(batch)

    def _hopeless(self, batch: int) -> bool:
        """Whether, off at `batch`, no tier could be switched to or probed whatever the acceptance:
        then the step is off without scoring a request (scoring the batch every step made issue 9's
        plain steps on the H100 ~1 ms dearer at batch 64). A step whose deepest request drafts d
        emits at most d + 1 tokens per request (goodput: the batch's tokens over the batch, at most
        1 + d; the drain: its last request's, likewise), so a tier scores at most max over d of
        (d + 1) x off's step / the least such a step costs, times off's score. It rests on the cost
        tables alone, so it is kept per batch for `rescore_every` decisions, as scores are."""
        gate = self._gate
        if gate is not None and gate[0] == batch and self._decisions - gate[1] < self.rescore_every:
            return gate[2]
        off_seconds = self.step_seconds(self.current, batch)
        hopeless = True
        for tier in self.tiers:
            if tier.off:
                continue
            # `_probe`'s test: a probe needs a tier that could beat decoding were all drafts accepted
            if tier.query_len * off_seconds > self.step_seconds(tier, batch):
                hopeless = False
                break
            for deepest in range(1, tier.num_steps + 1):
                least = self._least_seconds(tier, batch, deepest)
                if least <= 0 or (deepest + 1) * off_seconds > least * (1 + self.hysteresis):
                    hopeless = False
                    break
            if not hopeless:
                break
        self._gate = (batch, self._decisions, hopeless)
        return hopeless

    def _least_seconds(self, tier: Tier, batch: int, deepest: int) -> float:
        """The least a step of `tier` over `batch` requests may cost, the deepest drafting `deepest`:
        that one alone, or all of them that deep (the tables need not rise with batch everywhere)."""
        return min(
            self._step_seconds(tier, batch, deepest, drafting, deepest * drafting) for drafting in {1, batch}
        )

    def _stay_off(self, ids: tuple[str, ...]) -> Decision:
        """`decide` where `_hopeless`: off, as scoring would have decided (no challenger, no probe:
        `_probe`'s count of steps off runs on as it would), without reading any request's estimates."""
        batch = len(ids)
        self._challenger, self._streak = None, 0
        self._scored_age += 1
        self.last_batch = batch
        self._since_probe += 1
        if self._since_probe >= self.probe_interval:
            self._since_probe = 0  # what `_probe` does when no tier is hopeful
        off = self.current
        return Decision(off, dict.fromkeys(ids, 0), batch / self.step_seconds(off, batch), False)

    def _score(
        self, ids: tuple[str, ...], remaining: Sequence[int] | None, lead: tuple[int, ...] | None = None
    ) -> _Scores:
        """Each tier's depths per request, predicted goodput and score over `ids`: every request's
        rates read once, per topk."""
        batch = len(ids)
        left = None if remaining is None else [max(r, 1) for r in remaining]
        prefixes: dict[int, list[tuple[list[float], int]]] = {}
        ahead: dict[int, list[list[float]]] = {}  # the drain's forecast per topk, when it has its own
        for topk in {t.topk for t in self.tiers if not t.off}:
            rows = []
            explore = self._explore_span(topk)
            if left is not None and self.drain_strength is not None:
                forecast = self.acceptance.rates_of(ids, topk, explore, self.probe_z, self.drain_strength)
                ahead[topk] = [self.acceptance.prefix(rates) for rates in forecast.values()]
            for rates in self.acceptance.rates_of(ids, topk, explore, self.probe_z).values():
                # A model drafter's request drafts only the positions it reaches with odds of at
                # least min_reach; an n-gram lookup costs the same however deep (cut like that, a
                # request fresh from a miss drafted 3 when its match ran on for 8): its cut, where
                # narrower rows are cheaper, is `draft_depths`'.
                reach_count = (
                    sum(1 for p in reach(rates) if p >= self.min_reach) if self.draft_per_step else len(rates)
                )
                rows.append((self.acceptance.prefix(rates), reach_count))
            prefixes[topk] = rows
        goodput: dict[Tier, float] = {}
        score: dict[Tier, float] = {}
        depths: dict[Tier, list[int]] = {}
        for tier in self.tiers:
            if not batch:
                goodput[tier] = score[tier] = 0.0
                depths[tier] = []
                continue
            if tier.off:
                chosen, tokens = [0] * batch, [1.0] * batch
                seconds = self.step_seconds(tier, batch)
            else:
                rows = prefixes[tier.topk]
                chosen = self._depths(tier, rows, left)
                tokens = [prefix[d] for (prefix, _), d in zip(rows, chosen, strict=True)]
                seconds = self._seconds(tier, batch, chosen)
            goodput[tier] = sum(tokens) / seconds
            if left is None:
                score[tier] = goodput[tier]
            else:  # drain: the batch's tokens over the time until its last request finishes
                forecast = ahead.get(tier.topk)
                if forecast is not None:
                    tokens = [prefix[d] for prefix, d in zip(forecast, chosen, strict=True)]
                score[tier] = sum(left) / self._drain_seconds(tier, seconds, tokens, left)
            if not tier.off and not any(chosen):
                score[tier] = 0.0  # nobody drafts: a decode step, which off is (overlapped, where it can be)
            depths[tier] = chosen
        if lead is None and remaining is not None:
            lead = _lead(remaining)
        acceptance = self.acceptance
        return _Scores(
            ids,
            acceptance.version,
            acceptance.shadow_version,
            self._explore_key(),
            left,
            lead,
            goodput,
            score,
            depths,
        )

    def _drain_seconds(self, tier: Tier, seconds: float, tokens: list[float], left: list[int]) -> float:
        """Until the batch's last request ends at `tier`, a step of the whole batch costing `seconds`:
        every step at that price, or (`drain_thinning`) each at the price of the requests still
        running, every one drafting the tier's depth."""
        if not self.drain_thinning:
            return seconds * drain_steps(tokens, left)
        # priced per graph batch the engine's buckets pad to, not per count still running: pricing up
        # to 64 counts a tier made a scoring at batch 64 seven times dearer (3.7 against 0.5 ms, CPU);
        # eager steps (no graphs: the CPU, tensor parallelism) cost by their tokens, so every count
        padded = self.shapes.padded if self.shapes is not None else (lambda running: running)
        full = padded(len(left))

        def at(running: int) -> float:
            size = padded(running)
            return seconds if size == full else self.step_seconds(tier, size)

        return thinned_drain_seconds(tokens, left, at, padded)

    def _explore_key(self) -> tuple[tuple[int, int] | None, ...]:
        """What `_explore_span` gives every topk: scores stand only while it does."""
        return tuple(self._explore_span(topk) for topk in self._topks)

    def _explore_span(self, topk: int) -> tuple[int, int] | None:
        """While a tier of `topk` stands, the positions (0-based start, stop) past its depth up to the
        next deeper tier's, which it never tests: scored by the pool's upper bound
        (`AcceptanceTracker.rates_of`), so that tier gets run when they lack evidence and is then
        judged on what its verifies measured. One tier deeper at a time: its positions are the ones
        reached most often and it costs the least more; bounding every deeper position at once, an
        8-chain over drafts whose first position held 0.3 kept coming back (its deep positions,
        seldom reached, stayed untested) at 0.57x the 1-chain's goodput. Off (probes explore there),
        under another topk (trees and chains keep apart estimates) or at the deepest tier: none."""
        current = self.current
        if current is None or current.off or current.topk != topk:
            return None
        deeper = [t.num_steps for t in self.tiers if t.topk == topk and t.num_steps > current.num_steps]
        return (current.num_steps, min(deeper)) if deeper else None

    def _depths(self, tier: Tier, rows: list[tuple[list[float], int]], left: list[int] | None) -> list[int]:
        """Each request's draft steps in `tier` (see `draft_depths` for an n-gram chain)."""
        k, batch = tier.num_steps, len(rows)
        if tier.topk > 1 or self.draft_per_step:
            return [max(1, min(k, n)) for _, n in rows]
        if self.shapes is None or self.shapes.bucket(batch, k + 1) is not None:
            return [k] * batch  # padded to the widest row: a narrower one saves nothing
        prefixes = [prefix for prefix, _ in rows]
        if left is not None:
            return drain_depths(prefixes, left, k)
        per_token = max(self._eager_seconds(batch, k + 1) - self._eager_seconds(batch, 1), 0.0) / (batch * k)
        per_request = self.costs.estimate(DRAFT, batch, tier.topk) / batch
        chosen, _ = goodput_depths(
            prefixes, k, lambda d: self._seconds(tier, batch, d), per_token, per_request
        )
        return chosen

    def _seconds(self, tier: Tier, batch: int, depths: Sequence[int]) -> float:
        """A step of `tier` whose requests draft `depths` (0: decodes in the pass): the verify, and
        the draft of those drafting (`deepest` steps of a model drafter, one lookup each of n-gram)."""
        drafting = len(depths) - depths.count(0) if isinstance(depths, list) else sum(1 for d in depths if d)
        return self._step_seconds(tier, batch, max(depths, default=0), drafting, sum(depths))

    def _step_seconds(self, tier: Tier, batch: int, deepest: int, drafting: int, drafts: int) -> float:
        """`_seconds` from the depths' aggregates: the deepest, how many draft, the drafts in all."""
        if tier.topk > 1:
            seconds = self.costs.estimate(VERIFY, batch, tier.query_len)
        else:
            seconds = self.verify_seconds(batch, batch + drafts, deepest)
        if drafting:
            draft = self.costs.estimate(DRAFT, drafting, tier.topk)
            seconds += deepest * draft if self.draft_per_step else draft
        return seconds

    def _eager_seconds(self, batch: int, width: float) -> float:
        """An eager pass of `batch` requests, `width` tokens each on average: linear in the width
        between the measured widths (a pass costs by its tokens, however they are spread)."""
        widths = self._widths
        i = bisect.bisect_left(widths, width)
        if i < len(widths) and widths[i] == width or i == 0:
            return self.costs.estimate(VERIFY, batch, widths[min(i, len(widths) - 1)])
        if i == len(widths):
            return self.costs.estimate(VERIFY, batch, widths[-1]) * width / widths[-1]
        lo, hi = widths[i - 1], widths[i]
        low = self.costs.estimate(VERIFY, batch, lo)
        return low + (self.costs.estimate(VERIFY, batch, hi) - low) * (width - lo) / (hi - lo)

    def _revisit(self, tier: Tier, steps: dict[str, int], verifies: int = 1) -> dict[str, int]:
        """A request given no draft for `probe_every` speculative steps (verifies) in a row drafts the
        tier's depth once: unverified, its estimates would never learn that its text turned predictable."""
        if tier.off:
            return steps
        out = steps
        for rid, n in steps.items():
            if n:
                self._idle.pop(rid, None)
                continue
            idle = self._idle.get(rid, 0) + verifies
            if idle >= self.probe_every:
                out = dict(steps) if out is steps else out
                out[rid], idle = tier.num_steps, 0
            self._idle[rid] = idle
        return out

    def _upper_goodput(self, tier: Tier, batch: int, seconds: float | None = None) -> float:
        """`tier`'s goodput over `batch` requests under the pooled upper confidence bounds (`seconds`:
        its step's, when known)."""
        upper = self.acceptance.prefix(self.acceptance.pooled_upper(tier.topk, self.probe_z))
        seconds = self.step_seconds(tier, batch) if seconds is None else seconds
        return batch * upper[min(tier.num_steps, len(upper) - 1)] / seconds

    def _probe_candidates(self, scored: _Scores, off_rate: float) -> list[tuple[Tier, float, float]]:
        """The tiers `_probe` may pick, each with its step's seconds and its goodput under the upper
        bounds, made once per scoring: while a dear probe waits for its share of the time off (at
        batch 64, ~90 steps) `_probe` asks every step, and pricing each tier over the batch anew
        cost a plain step ~50 µs of host time there."""
        if scored.probe is None or scored.probe[0] != off_rate:
            batch, out = len(scored.ids), []
            for tier in self.tiers:
                if tier.off:
                    continue
                seconds = self.step_seconds(tier, batch)
                if batch * tier.query_len / seconds > off_rate:
                    out.append((tier, seconds, self._upper_goodput(tier, batch, seconds)))
            scored.probe = (off_rate, out)
        return scored.probe[1]

    def _probe(self, scored: _Scores, verifies: int = 1) -> Tier | None:
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
        hopeful = self._probe_candidates(scored, off_rate)
        if not hopeful:
            self._since_probe = 0
            return None
        tier, seconds, _ = max(hopeful, key=lambda c: c[2])
        # A probe that loses costs its step beyond a decode step: probe seldom enough that this
        # stays within `probe_share` of the time off (at batch 64 a probe costs ~2 decode steps).
        off_seconds = batch / off_rate
        if self._since_probe * self.probe_share * off_seconds < seconds - off_seconds:
            return None  # not yet: the steps off keep counting
        self._since_probe = 0
        # To win, it must emit what decoding would in the probe's time.
        self._probing = (tier, off_rate * seconds)
        self._probe_left = dict(zip(scored.ids, scored.left, strict=True)) if scored.left else None
        return tier

    def _probe_off(self, batch: int) -> Tier | None:
        """While speculating: plain steps every `probe_every` engine steps until a plain step at a
        batch of this one's class has been measured (`_plain_priced_near`; steps, not verifies:
        where a device loop runs, a plain step ends its run and, with a head drafter, costs
        synchronous catch-up steps after it; on the H100 at batch 64, plain steps every 32 verifies,
        4 loop steps, took 11 ms each and made adaptive 0.76x the best static chain). Until then its
        price is derived (the start-up profile of a one-token pass, which on the H100 once came out
        2.5x slow), and a tier the policy believes dear it never runs, so the price would stand for
        good. `OFF_PROBE_STEPS` in a row: an overlapped plain
        step's wall is the wait for the step before, so only from the second of a row on is one
        steady, a plain step's measured cost (`specserve/engine/adaptive_control.py`), and a price
        takes a few. No verdict: a measurement.

        None where off runs in a device loop of its own (n-gram drafting's plain loop): a probe's
        steps run synchronously, and a loop tier's synchronous steps price nothing
        (`AdaptiveSpeculation.observe_step`), so such a probe measured nothing and came back every
        `probe_every` engine steps, breaking the chain's run each time. On the H200 (thirty-fourth
        session, MT-Bench, batch 64, `scripts/trace_steps.py`) the run with one took 403 ms, the run
        without 317, the static 1-chain 305. Off's loop steps price it once it runs; until then its
        loop gap is the narrowest chain's in proportion to its one row (`StepCosts.loop_gap`)."""
        off = next((t for t in self.tiers if t.off), None)
        kind = DECODE if self.overlapped_off else VERIFY
        if (
            off is None
            or not batch
            or off.num_steps in self.switch_on_device
            or self._plain_priced_near(kind, batch)
        ):
            self._since_probe = self._off_left = 0
            return None
        if self._off_left:
            self._off_left -= 1
            return off
        self._since_probe += 1  # engine steps: with a head's loop a plain step breaks the loop
        if self._since_probe < self.probe_every:
            return None
        self._since_probe, self._off_left = 0, OFF_PROBE_STEPS - 1
        self._probing = self._probe_left = None
        return off

    def _plain_priced_near(self, kind: str, batch: int) -> bool:
        """Whether steady plain steps priced a batch of `batch`'s class (`batch_class`: 32-63 is one):
        the cost tables carry that price to the class's other batches with the profile's shape
        (`StepCosts.estimate`). Asked of the exact batch, a batch thinning in its tail (63, 62, ...,
        each a few steps, seldom two plain steps at one size) called for a row of plain steps every
        `probe_every` engine steps to its end, each row breaking the loop twice: the likeliest source
        of the H200's 20 plain steps in ~170 of the MT-Bench batch-64 row, 2 of them at 64."""
        lo = 1 << (batch_class(batch) - 1)  # the class's batches: lo .. 2 lo - 1
        return any(lo <= b < 2 * lo for b in self.costs.live_batches(kind, 1))

    def _known(self, ids: tuple[str, ...]) -> bool:
        """Whether any of the batch's requests has verified a draft: a batch of fresh ones (a bench
        batch's first steps, a server's after idling) reads the pool's rates alone, which the
        previous answers' ends set, and no tier is chosen on those (`_hold`). Speculation off decides
        as ever, its steps verify nothing and held off a batch waited for a probe (simulated mixed
        prompts at batch 4: off for 311 of 337 steps, 0.95x the best static chain against 0.97x),
        unless a fresh batch grew GROWTH_RESET-fold since off was chosen (`_resumes`)."""
        current = self.current
        if current is None:
            return True
        if current.off and not self._resumes(len(ids)):
            return True
        return any(self.acceptance.known(ids, k) for k in self._topks)

    def _resumes(self, batch: int) -> bool:
        """Off, chosen at a batch a quarter of this one or less, with a speculative tier to go back to:
        a batch's tail goes off for its last tokens (a request with one left emits one whatever the
        tier), and the next batch of fresh requests would start off, leaving it only after
        `patience` plain steps scored on the pool's rates. `scripts/adaptive_sim.py` (six seeds):
        on the mixed prompts adaptive over the best static chain went from 0.970 / 0.973 to 0.993 /
        1.005 at batch 16 / 64, MT-Bench as before (docs/benchmarks.md, twenty-fifth session)."""
        return self._last_on is not None and 0 < GROWTH_RESET * self._chosen_at <= batch

    def _hold(self) -> bool:
        """The standing tier runs on, no challenger gaining on it, and a grown batch decides afresh
        once its requests have verified. On the pool's rates alone the H200's n-gram rows switched
        to the 8-chain on the first step of most batches of 4 and 16 (MT-Bench) and back a run or
        two later, when the requests' own misses came in (12 switches on a batch's first step in
        one MT-Bench row of batches 1-64); the head's batch 16 chose the 4-chain on its first step
        and held it for the row (docs/benchmarks.md, twenty-second session). Off held so
        (`_resumes`) goes back to the last speculative tier that stood, and the batch, grown since
        off was chosen, decides afresh once its requests have verified."""
        self._challenger, self._streak = None, 0
        if self.current is None or not self.current.off or self._last_on is None:
            return False
        self._set_current(self._last_on, self._chosen_at)
        return True

    def _update(self, best: Tier, scores: dict[Tier, float], verifies: int = 1) -> bool:
        """Switch to `best` once it has won by `hysteresis` over `patience` verifies: the decision
        where it first wins counts one, each later one the verifies since the decision before (one a
        synchronous step; a device loop's run, up to 8 in one engine step, counted in engine steps
        took 3 runs, 24 verifies, where a synchronous engine took 3)."""
        batch = self.last_batch
        if self.current is None:
            self.current, self._chosen_at = best, batch
            self._last_on = None if best.off else best
            return False
        # Grown GROWTH_RESET-fold since the standing tier was chosen: a new regime, whose best tier
        # takes over at once (the standing one was chosen for another batch)
        grown = self._chosen_at > 0 and batch >= GROWTH_RESET * self._chosen_at
        if grown or self._chosen_at <= 0:  # none known (a tier set from outside): this batch
            self._chosen_at = batch
        if best == self.current or (
            not grown and scores[best] <= scores[self.current] * (1 + self.hysteresis)
        ):
            self._challenger, self._streak = None, 0
            return False
        if not grown:
            self._streak = self._streak + verifies if best == self._challenger else 1
            self._challenger = best
            if self._streak < self._patience_for(best, scores[best], scores[self.current]):
                return False
        self._set_current(best, batch)
        return True

    def _set_current(self, tier: Tier, chosen_at: int) -> None:
        """A switch to `tier`, counted as chosen at batch `chosen_at`."""
        self.current, self._challenger, self._streak, self._chosen_at = tier, None, 0, chosen_at
        if not tier.off:
            self._last_on = tier
        self._since_probe = self._off_left = 0  # each regime counts its own steps to its first probe
        self.switches += 1
        self.switches_at[self.last_batch] += 1
        self.probe_interval = self.probe_every  # a new regime: probe at the base rate when off again

    def _patience_for(self, tier: Tier, challenger: float, standing: float) -> float:
        """Verifies `tier`, scoring `challenger`, must win for against the standing tier's
        `standing` before a switch: `patience`, or as many as its gain takes to pay for the switch's
        own cost at this batch (the module docstring), whichever is more."""
        cost = self.switch_seconds(self.last_batch, self.current, tier)
        if cost <= 0 or standing <= 0:
            return self.patience
        step = self.step_seconds(self.current, self.last_batch)
        gain = challenger / standing - 1.0
        return max(self.patience, math.ceil(cost / (gain * step))) if gain > 0 and step > 0 else self.patience


@dataclass
class _Scores:
    """One scoring of a batch: kept while its requests and the acceptance estimates stand."""

    ids: tuple[str, ...]
    version: int
    shadow_version: int  # the shadow drafts' observations it saw (rescored every few decisions)
    explore: tuple[tuple[int, int] | None, ...]  # the positions scored optimistic (`_explore_key`)
    left: list[int] | None  # tokens each may still emit, scored by the drain (nobody waits); else None
    lead: tuple[int, ...] | None  # `left` less its least: what one more decode step leaves as it is
    goodput: dict[Tier, float]  # predicted tokens per second of a step
    score: dict[Tier, float]  # what tiers are compared by: goodput, or the drain's tokens per second
    depths: dict[Tier, list[int]]  # each request's draft steps, in `ids` order
    steps: dict[Tier, dict[str, int]] = field(default_factory=dict)
    # `_probe_candidates`: (off's goodput they were judged against, [(tier, seconds, upper goodput)])
    probe: tuple[float, list[tuple[Tier, float, float]]] | None = None

    def steps_of(self, tier: Tier) -> dict[str, int]:
        """Each request's draft steps in `tier` (0 when off), made once per scoring."""
        steps = self.steps.get(tier)
        if steps is None:
            steps = self.steps[tier] = dict(zip(self.ids, self.depths[tier], strict=True))
        return steps


def _lead(remaining: Sequence[int]) -> tuple[int, ...]:
    """Each request's tokens left beyond the least: what a decode step (one token each) leaves as is."""
    least = min(remaining)
    return tuple(r - least for r in remaining)


def default_tiers(
    num_steps: int, topk: int = 1, num_draft_tokens: int | None = None, every_chain: int = 0
) -> tuple[Tier, ...]:
    """Off, chains of 1, 2, 4, ... up to `num_steps` (and of every length up to `every_chain`), and
    the configured tree when topk > 1."""
    tiers = {OFF, Tier.chain(num_steps)}
    tiers.update(Tier.chain(s) for s in (1, 2, 4, 8, 16, 32) if s < num_steps)
    tiers.update(Tier.chain(s) for s in range(1, min(every_chain, num_steps) + 1))
    if topk > 1:
        tiers.add(Tier(num_steps, topk, num_draft_tokens or num_steps))
    return tuple(sorted(tiers))


def configured_tiers(spec: SpeculativeConfig) -> tuple[Tier, ...]:
    """The tiers `spec.adaptive` names, else `default_tiers` of the configured shape: a model
    drafter's with every chain up to `MODEL_EVERY_CHAIN`. Its chain pays a draft step per position,
    so goodput peaks at one length and falls off on both sides (the H100's EAGLE-3 head at batch 1:
    chains 3 / 4 / 5 made 2,287 / 2,171 / 2,096 tok/s), and without the 3-chain the best tier was
    0.95x the best static one; an n-gram lookup costs the same at any depth, powers of two suffice."""
    if spec.adaptive is None or spec.adaptive.tiers is None:
        every = MODEL_EVERY_CHAIN if spec.method != "ngram" else 0
        return default_tiers(spec.num_steps, spec.topk, spec.draft_tokens, every)
    return tuple(sorted({Tier(*shape) for shape in spec.adaptive.tiers}))
