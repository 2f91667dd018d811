"""Adaptive speculation inside the engine's step: the policy's tier and budgets in, the outcomes out.

Each step (`Engine._propose_drafts`) the policy (`specserve/spec/adaptive.py`) picks the tier for the
decoding requests: it becomes `Engine.spec_settings` (off is a plain decode step: no drafter runs),
and each request drafts the steps the policy gave it (fewer, or none, where its own drafts are
hopeless and a narrower row is cheaper: `specserve/spec/draft_depths.py`), within what it may still
emit. The engine says how its verify passes run (`shapes`: its CUDA-graph buckets) and whether
requests wait; with none waiting the policy judges tiers by how soon the batch finishes, from each
request's tokens left (`max_new_tokens` less its output). Each verify tells the acceptance estimates how far that
request's draft got against the budget it was given: a drafter proposing less than the budget (an
n-gram lookup without a match) counts as rejected there, since one token is all the step made of it.
Each step's host times refine the cost tables: a step of decodes and verifies only (no prefill chunk)
is a target pass of its batch at its tier's width (the CUDA-graph bucket the tier pads to; a step
whose lookups found shorter drafts was cheaper, and that is what the tier costs on average: keyed by
its widest draft instead, e.g. 7, the measurement fed a shape no tier is priced at; an eager pass,
which costs by its tokens, is scaled to the tier's width first), less its draft phase, which is `num_steps`
draft steps (one, for an n-gram lookup, whose cost does not grow with depth), and less its `settle` phase: before a speculative step the engine settles the plain
step still in flight (drafting needs its tokens), a wait for the device that belongs to that step.
Charged to the draft phase (as it was), it made every probe's draft look a whole decode step dear,
so probes and switches never paid. A plain step the engine overlapped is a `DECODE` step (its host
work hidden), timed as a whole. A probe's emitted tokens (accepted drafts plus one per verified
request; with none waiting, each request's, for the drain) give the policy its verdict. The
predicted and the measured goodput go to the step's stats for the metrics; `diagnostics` (the
policy's prices beside the steady and the transition steps' measured ms) to benchmark reports.

Only steady steps set prices: a step that ran the tier of the step before, over the same batch, both
decodes and verifies only, with nothing settled first. An overlapped plain step launches its own
pass and then waits for the one before, so its wall is the step before's device time: after a
prefill (the first plain step of every bench run) the prefill's, after a synchronous step almost
nothing (the launch alone). Issue 9's H100 run filed such a step as a batch-16 plain step's cost
(4.11 ms, against 1.19 ms steady); the policy, believing it, speculated where plain decoding was
best (0.62x) and, no longer running plain steps there, never measured better. A speculative step
after plain steps (a probe, a switch) pays for leaving the overlapped pipeline: its settle is
left out, and whatever else such a step pays (the run measured probes of the 8-chain at batch 1 at
1.5x its static steps' 1.34 ms, and the policy stayed off where the 8-chain made 1.5x plain) is
not the tier's cost either. Those steps still fill in a shape nothing else prices
(`StepCosts.observe`'s `steady`), and still judge their probe.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.config import MODEL_HYSTERESIS, NGRAM_HYSTERESIS, SpeculativeConfig
from specserve.engine.request import Request
from specserve.engine.scheduler import ScheduledItem
from specserve.engine.stats import SpecSettings, StepStats
from specserve.spec.acceptance import AcceptanceTracker
from specserve.spec.adaptive import AdaptivePolicy, Tier, configured_tiers
from specserve.spec.calibration import ChainOutcomes, GoodputCalibration
from specserve.spec.draft_depths import VerifyShapes
from specserve.spec.shadow import Lookup, ShadowDrafts
from specserve.spec.step_costs import DECODE, DRAFT, VERIFY, StepCosts, robust_mean

DIAGNOSTIC_STEPS = 256  # steps per (tier, batch) whose costs `diagnostics` summarises
# Batches up to this judge each chain tier on every chain verify (`_chain_outcomes`); larger ones on
# their own steps' tokens in their time. At batch 1 a step's tokens are its one request's, and the
# tier its state picked: judged on its own steps the 8-chain, run when a request's estimates were
# high, scored 0.54 of its promise against the 1-chain's 1.05 on the H200 (mixed prompts) and was
# left, 0.92-0.95x the static 8-chain; judged on every verify, adaptive made 1.04-1.08x the best
# static chain there. At batch 4-64 a batch ends with its slowest request and a loop's rows run on
# past the others' ends, which a verify's tokens do not show: judged so, the policy ran the 8-chain
# for most steps at 0.92-0.95x the best static chain, against 0.96-0.99x judged on its own steps
# (the H200, one call, docs/benchmarks.md).
COUNTERFACTUAL_BATCH = 1


@dataclass(frozen=True)
class _StepShape:
    """What a step was, as far as the next step's time may hold some of it."""

    tier: Tier
    batch: int
    clean: bool  # decodes and verifies only: no prefill chunk rode along


def context_tokens(reqs: Sequence[Request]) -> float:
    """The mean context of `reqs` in tokens, prompt and output (what a device loop's step costs beyond
    its profile grows with, per request: `StepCosts`)."""
    return sum(r.prompt_len + r.num_output for r in reqs) / max(len(reqs), 1)


def settings_of(tier: Tier) -> SpecSettings:
    return SpecSettings() if tier.off else SpecSettings(tier.num_steps, tier.topk, tier.num_draft_tokens)


class AdaptiveSpeculation:
    def __init__(self, spec: SpeculativeConfig) -> None:
        config = spec.adaptive
        if config is None:
            raise ValueError("speculative.adaptive: not configured")
        self.tiers = configured_tiers(spec)
        self.costs = StepCosts(alpha=config.cost_alpha)
        depth = max(max(t.num_steps for t in self.tiers), 1)
        self.acceptance = AcceptanceTracker(
            depth, config.request_alpha, config.pooled_alpha, config.prior, config.prior_strength
        )
        self.policy = AdaptivePolicy(
            self.tiers,
            self.costs,
            self.acceptance,
            hysteresis=adaptive_hysteresis(spec),
            patience=config.patience,
            min_reach=config.min_reach,
            probe_every=config.probe_every,
            draft_per_step=spec.method != "ngram",
            drain_strength=config.drain_strength,
            drain_thinning=config.drain_thinning,
            calibration=None
            if config.calibration_fade is None
            else GoodputCalibration(config.calibration_fade),
        )
        self.tier = max(self.tiers)  # this step's (a probe's, while the policy is off)
        # whether the loop runs either side of a switch of chain length set prices (`observe_loop`)
        self.switch_runs_priced = config.switch_runs_priced
        # the last speculative tier decided: a step of prefills alone runs it (`decide`)
        self._last_speculative: Tier = max(self.tiers)
        # Chain lengths the engine runs in a device loop: their prices come from loop steps only
        # (profiled, then `observe_loop`), never from the same tier run synchronously, which a
        # head's chain pays ~1 ms of host drafting for at batch 1 (the loop: nothing extra).
        self._looped_chains: frozenset[int] = frozenset()
        self.predicted_goodput = 0.0
        # tier -> the goodput its last standing decision predicted: a device loop's run is settled a
        # step after it was launched, by when the policy may be elsewhere. 0 (no correction) where
        # steady steps had not priced the tier at that batch yet: a prediction at its profile's price
        # (a loop step's without the attention over real contexts, 1.5 against 2.4 ms at batch 64 in
        # tests/test_spec_adaptive_rows.py) promised too much, and the correction blamed whichever
        # tier ran first for it, long after its price was known
        self._predicted: dict[Tier, float] = {}
        self._steps: dict[str, int] = {}  # request id -> draft steps the policy gave it this step
        self._budgets: dict[str, int] = {}  # request id -> drafts it was asked for this step
        # request id -> its verifies since the last decision: one a synchronous step, a device loop's
        # run (settled after that decision) up to 8; the policy counts its intervals in these
        self._verified: Counter[str] = Counter()
        self.tier_steps: Counter[Tier] = Counter()  # steps run per tier (probes included)
        self._probe = False  # this step runs a probe (a tier other than the policy's standing one)
        self._emitted = 0  # tokens this step's verifies emitted
        self._emitted_by: dict[str, int] = {}  # a probe's: request id -> tokens it emitted
        self._decoding = 0  # requests decoding this step (its items, unless a prefill rides along)
        # (tier name, batch) -> [steps, seconds]: measured wall time of whole steps, for diagnostics
        self._walls: dict[tuple[str, int], list[float]] = {}
        # (tier name, batch) -> the last steps' cost beyond a settle: steady ones, and transitions
        self._steady_ms: dict[tuple[str, int], deque[float]] = {}
        self._transition_ms: dict[tuple[str, int], deque[float]] = {}
        self._previous: _StepShape | None = None  # the step before: what this step's time may hold of it
        self.shadow: ShadowDrafts | None = None  # n-gram drafts scored while off (`use_shadow`)
        self._shadow_lookups = config.shadow_lookups
        # every chain tier's outcome over each verify of any chain, for the corrections up to
        # `COUNTERFACTUAL_BATCH` (else, and for trees: their own steady steps' tokens against the
        # goodput promised, `_predicted`)
        chains = [t.num_steps for t in self.tiers if t.topk == 1 and not t.off]
        self._outcomes = ChainOutcomes(chains) if self.policy.calibration is not None and chains else None
        self._contexts: dict[int, float] = {}  # batch -> its requests' mean context at its last decision

    @property
    def looped_chains(self) -> frozenset[int]:
        return self._looped_chains

    @looped_chains.setter
    def looped_chains(self, chains: frozenset[int]) -> None:
        """The engine's loop chains; their verify widths take no synchronous steps' residual, and a
        switch among them is queued on the device (the loops share the requests' state)."""
        self._looped_chains = frozenset(chains)
        self.policy.switch_on_device = self._looped_chains
        self.costs.loop_widths[VERIFY] = frozenset(n + 1 for n in self._looped_chains)

    def use_shadow(self, lookup: Lookup, plain_steps: int = 1) -> None:
        """The drafter is an n-gram lookup (host work): while off, score what it would have drafted
        (`specserve/spec/shadow.py`) rather than wait for probes. `plain_steps`: the plain steps an
        engine step off runs (a device-loop run's; 1 on the host). `shadow_lookups` is per plain
        step: at 2 an engine step, off in the loop at batch 64 (runs of 8) gave each request one
        shadow in a batch's 32 engine steps, so while off its estimates stood still; in
        `scripts/adaptive_sim.py --off-loop` 4 or more a step took adaptive over the best static from
        0.97 / 0.95 / 0.97 to 0.98 / 0.99 / 1.01 (MT-Bench, batch 4 / 16 / 64). A lookup is ~3 us of
        host time, hidden behind the run the device works on."""
        chains = [t.num_steps for t in self.tiers if t.topk == 1 and not t.off]
        if self._shadow_lookups <= 0 or not chains:
            return
        depth = max(chains)

        def observe(request_id: str, drafted: int, accepted: int, batch: int) -> None:
            self.acceptance.observe(request_id, 1, drafted, accepted, batch, shadow=True)

        self.shadow = ShadowDrafts(lookup, depth, self._shadow_lookups * max(plain_steps, 1), observe)

    @property
    def overlapped_off(self) -> bool:
        """Whether the engine overlaps its plain steps (it says so once built)."""
        return self.policy.overlapped_off

    @overlapped_off.setter
    def overlapped_off(self, value: bool) -> None:
        self.policy.overlapped_off = value

    @property
    def shapes(self) -> VerifyShapes | None:
        """How the engine runs verify passes (its CUDA-graph buckets; None: padded to the widest row)."""
        return self.policy.shapes

    @shapes.setter
    def shapes(self, value: VerifyShapes | None) -> None:
        self.policy.shapes = value

    def decide(self, reqs: Sequence[Request], waiting: int = 0) -> SpecSettings:
        """This step's tier for the decoding requests `reqs`, as the engine's speculation settings.
        `waiting`: requests not yet admitted; with none, tiers are judged by how soon `reqs` finish
        (each may emit up to its `max_new_tokens`)."""
        self._budgets.clear()
        if not reqs:  # nothing decodes: nothing to decide
            self._steps, self._probe, self._decoding = {}, False, 0
            # A step of prefills alone under a speculative tier, whatever stands: the drafter then
            # takes the prompts' features in the step (a head extends over them in its graphs). Off
            # (left from the last batch's tail), the prefill ran as a plain step the head skipped,
            # and the first speculative step caught it up synchronously: 11 ms at batch 16 on the
            # H200 (EAGLE-3, the bench: every batch starts so), ~10% of the batch's wall time.
            return settings_of(self.tier if not self.tier.off else self._last_speculative)
        # Off where no tier could win (`AdaptivePolicy.stays_off`), the policy reads no request
        if waiting or self.policy.stays_off(len(reqs)):
            remaining = None
        else:
            remaining = [r.params.max_new_tokens - r.num_output for r in reqs]
        if self.shadow is not None:
            self.shadow.score(reqs)
        verifies = max(self._verified.values(), default=1)
        self._verified.clear()
        self.costs.context = self._contexts[len(reqs)] = context_tokens(reqs)
        decision = self.policy.decide([r.request_id for r in reqs], remaining, verifies)
        if self.shadow is not None and decision.tier.off:
            if not self.policy.hopeless:  # else no estimate could change the decision: no lookups
                self.shadow.start(reqs)
        elif self.shadow is not None:
            self.shadow.drop()
        self.tier, self._steps = decision.tier, decision.steps
        if not decision.tier.off:
            self._last_speculative = decision.tier
        self._probe, self._emitted = decision.tier != self.policy.current, 0
        self._emitted_by.clear()
        self._decoding = len(reqs)
        self.predicted_goodput = decision.predicted_goodput
        if not self._probe:  # held to it once its steps priced it (`_predicted`)
            priced = self.costs.measured_live(VERIFY, len(reqs), self.tier.query_len)
            self._predicted[self.tier] = decision.predicted_goodput if priced else 0.0
        self.tier_steps[self.tier] += 1
        return settings_of(self.tier)

    def steps_for(self, req: Request) -> int:
        return self._steps.get(req.request_id, self.tier.num_steps)

    def drafting(self, req: Request, budget: int) -> None:
        """`req` drafts with `budget` steps this step (after the engine's own limits)."""
        self._budgets[req.request_id] = budget

    def observe_verify(self, req: Request, accepted: int) -> None:
        budget = self._budgets.get(req.request_id, 0)
        if budget and not self.tier.off:
            kept = min(accepted, budget)
            if self._on_verifies(self._decoding, self.tier.topk):
                self._chain_outcomes(req.request_id, [(budget, kept)])
            self.acceptance.observe(req.request_id, self.tier.topk, budget, kept, len(self._budgets))
            self._verified[req.request_id] += 1
            self._emitted += kept + 1
            if self._probe:
                self._emitted_by[req.request_id] = kept + 1

    @property
    def probing(self) -> bool:
        """This step runs a probe (its goodput is measured from the step itself)."""
        return self._probe

    def observe_chain(self, req: Request, depth: int, accepted: int, batch: int) -> None:
        """A verify the device loop ran (a chain tier `depth` deep over `batch` requests), its
        acceptance, whatever tier the policy has moved to since the run was launched. As for a
        synchronous verify (`observe_verify`: the budget, not the lookup's length), a draft that
        came out shorter than the tier counts as rejected past its end: what a chain that deep gains
        is what the lookups give, short ones included (counting only the drafted positions, the
        policy expected 2.2 tokens a verify of the 8-chain at batch 64 where 1.72 came)."""
        self.observe_run_chains([(req, [(depth, accepted)])], batch)

    def observe_run_chains(
        self, runs: Sequence[tuple[Request, Sequence[tuple[int, int]]]], batch: int
    ) -> None:
        """`observe_chain` for each (depth, accepted) verify of a device-loop run, per request in
        order, in one call: at batch 64 a run settles 512 of them an engine step, and observed one
        by one they were most of the adaptive engine's host work there
        (`AcceptanceTracker.observe_run`; docs/benchmarks.md, twelfth and seventeenth sessions)."""
        if self._on_verifies(batch):
            for req, verifies in runs:
                kept = [(depth, min(accepted, depth)) for depth, accepted in verifies if depth > 0]
                if kept:
                    self._chain_outcomes(req.request_id, kept)
        observed = self.acceptance.observe_run(1, [(req.request_id, v) for req, v in runs], batch)
        for (req, _), count in zip(runs, observed, strict=True):
            if count:
                self._verified[req.request_id] += count

    def _on_verifies(self, batch: int, topk: int = 1) -> bool:
        """Whether a tier's correction at `batch` comes from every chain verify (`_chain_outcomes`),
        not from its own steps: a chain's (`topk` 1), up to `COUNTERFACTUAL_BATCH`."""
        return self._outcomes is not None and topk == 1 and batch <= COUNTERFACTUAL_BATCH

    def _chain_outcomes(self, request_id: str, verifies: Sequence[tuple[int, int]]) -> None:
        """What each chain tier would have made of `request_id`'s chain verifies, against what its
        estimates (before them) promised: the corrections' evidence (`calibration.ChainOutcomes`)."""
        if self._outcomes is not None:
            self._outcomes.add(self.acceptance.prefix(self.acceptance.rates(request_id, 1)), verifies)

    def _settle_outcomes(self, batch: int) -> None:
        if self._outcomes is not None:
            outcomes = self._outcomes.take()
            if outcomes:
                self.policy.observe_chain_outcomes(batch, {Tier.chain(d): o for d, o in outcomes.items()})

    def observe_loop(
        self,
        batch: int,
        depth: int,
        seconds: float,
        context: float = 1.0,
        settle: float = 0.0,
        steady: bool = True,
    ) -> None:
        """What a device-loop step of chains `depth` long over `batch` requests took, read from a
        run the device ran back to back over contexts of `context` tokens on average
        (`context_tokens`: where the profile's contexts are empty, what it costs beyond the profile
        grows with the context as its steps show, `StepCosts.observe`'s `rows`); kept for `diagnostics` as a
        steady step of its tier. `settle`: the host's seconds appending the run before, which the
        device spent on this one and a switch leaves it idle for (the policy's switch cost).
        Not `steady` (a switch of chain length just before or after the run where
        `switch_runs_priced` is off, `Engine._observe_loop`): the settle alone, and the step among
        the transitions."""
        self.policy.observe_switch_cost(batch, settle)
        name = Tier.chain(depth).name
        if not steady:
            self._transition_ms.setdefault((name, batch), deque(maxlen=DIAGNOSTIC_STEPS)).append(seconds)
            return
        self.costs.observe(VERIFY, batch, depth + 1, seconds, rows=True, context=context)
        self._steady_ms.setdefault((name, batch), deque(maxlen=DIAGNOSTIC_STEPS)).append(seconds)

    def steady_run(self, switched_before: bool, switched_after: bool) -> bool:
        """Whether a resumed loop run prices its tier (`observe_loop`'s `steady`): always where
        `switch_runs_priced`, else unless a switch of chain length came just before or after it."""
        return self.switch_runs_priced or not (switched_before or switched_after)

    def observe_setup(self, batch: int, seconds: float) -> None:
        """The host took `seconds` to set up a fresh device-loop run over `batch` requests (what a
        switch of tier exposes beside the settle)."""
        self.policy.observe_setup_cost(batch, seconds)

    def observe_run(
        self,
        batch: int,
        depth: int,
        tokens: int,
        seconds: float,
        ended: bool = False,
        steady: bool = True,
    ) -> None:
        """A device-loop run of chains `depth` long over `batch` requests, queued behind the run
        before it, emitted `tokens` in `seconds` (the step that settled it): the measured goodput
        (a loop's steps reach `observe_step` no other way: the metric stood still while loops ran)
        and the corrections: every chain tier's from its verifies up to `COUNTERFACTUAL_BATCH`,
        else its own, unless the run `ended` a request: its tokens stop at the request's end while
        the prediction counts whole verifies (`observe_step`), or it was not `steady` (its
        `seconds` are not its own, `observe_loop`)."""
        self.policy.observe_step(tokens, seconds)
        self._settle_outcomes(batch)
        tier = Tier.chain(depth)
        predicted = self._predicted.get(tier)
        if predicted and steady and not ended and not self._on_verifies(batch):
            self.policy.observe_outcome(tier, batch, tokens, seconds, predicted)

    def observe_step(self, items: Sequence[ScheduledItem], stats: StepStats, ended: bool = False) -> None:
        """A step over `items` that took `stats`. `ended`: it finished a request, and corrects no tier:
        its tokens stop at the request's end while the prediction counts whole verifies, and the
        tier that ends a batch is the drain's pick. On the H200 (MT-Bench, the head's 4-chain,
        batch 16) the runs that ended a batch made 0.92 of their promise on average (21 runs,
        0.71-1.08), the runs before them 1.03 (117, 0.82-1.43): with a bench batch's requests ending
        together, whatever tier ran last was scored down for it."""
        phases = stats.phases
        seconds = phases.get("step")
        batch = len(items)
        clean = batch == self._decoding and all(item.num_known == 1 and item.completes for item in items)
        previous, self._previous = self._previous, _StepShape(self.tier, batch, clean)
        self._settle_outcomes(batch)
        if not seconds:
            return
        self.policy.observe_step(stats.generation_tokens, seconds)
        settle = phases.get("settle", 0.0)
        if self._probe:
            emitted, self._emitted_by = self._emitted_by, {}
            self.policy.observe_probe(self._emitted, seconds - settle, emitted)
        # Steady: the step before ran this tier over this batch, decodes only. An overlapped plain
        # step's wall is the wait for the step before it (a prefill's, or none after a synchronous
        # step); a speculative one after plain steps settled them first (see the module docstring).
        steady = clean and not settle and previous == self._previous
        own = not ended and not self._on_verifies(batch, self.tier.topk)
        if own and clean and not self._probe and previous is not None and previous.tier == self.tier:
            self.policy.observe_outcome(
                self.tier, batch, stats.generation_tokens, seconds, self._predicted.get(self.tier, 0.0)
            )
        if clean:
            self._record(batch, seconds, seconds - settle, steady)
        if self.tier.topk == 1 and self.tier.num_steps in self.looped_chains:
            # a loop tier run synchronously (a probe, a catch-up; off while requests wait): its loop
            # steps price it
            return
        if self.tier.off:
            if steady:  # overlapped: the wall is the period, host work and all; else the pass alone
                overlapped = self.overlapped_off
                cost = seconds if overlapped else seconds - phases.get("draft", 0.0)
                self.costs.observe(DECODE if overlapped else VERIFY, batch, 1, cost)
            return
        drafting = phases.get("draft", 0.0)
        if clean:
            width = max(self.tier.query_len, max(item.num_tokens for item in items))
            verify = seconds - drafting - settle
            self.costs.observe(VERIFY, batch, width, verify * self._eager_scale(items, width), steady)
        if self._budgets and drafting > 0:
            per = self.tier.num_steps if self.policy.draft_per_step else 1
            self.costs.observe(DRAFT, len(self._budgets), self.tier.topk, drafting / per, steady)

    def idle(self) -> None:
        """A step that scheduled nothing (it may have settled an overlapped one): the next step
        follows no step of its own shape."""
        self._previous = None

    def _record(self, batch: int, wall: float, cost: float, steady: bool) -> None:
        """For `diagnostics`: the whole step's wall, and what it cost beyond a settle, steady or not."""
        wall_sum = self._walls.setdefault((self.tier.name, batch), [0, 0.0])
        wall_sum[0] += 1
        wall_sum[1] += wall
        kept = self._steady_ms if steady else self._transition_ms
        kept.setdefault((self.tier.name, batch), deque(maxlen=DIAGNOSTIC_STEPS)).append(cost)

    def _eager_scale(self, items: Sequence[ScheduledItem], width: int) -> float:
        """1 for a pass padded to its bucket; for an eager one, what `width` tokens a request cost
        over what its tokens did (the table prices every request at one width; per-request depths
        make an eager pass narrower)."""
        batch, widest = len(items), max(item.num_tokens for item in items)
        shapes = self.policy.shapes
        if shapes is None or shapes.bucket(batch, widest) is not None or self.tier.topk > 1:
            return 1.0
        tokens = sum(item.num_tokens for item in items)
        actual = self.policy.verify_seconds(batch, tokens, widest - 1)
        return self.policy.verify_seconds(batch, batch * width, width - 1) / actual if actual > 0 else 1.0

    def forget(self, request_id: str) -> None:
        self.acceptance.forget(request_id)
        self.policy.forget(request_id)
        self._steps.pop(request_id, None)
        if self.shadow is not None:
            self.shadow.forget(request_id)

    def settings(self) -> SpecSettings:
        """The policy's standing tier (not a probe's), for the metrics."""
        return settings_of(self.policy.current or self.tier)

    def diagnostics(self, batch: int | None = None) -> dict:
        """For benchmark reports: the policy's cost table and pooled acceptance at `batch` (default:
        the last decision's), beside the mean wall ms of the steps each tier ran at that batch
        (`measured_step_ms`, settles included), the mean ms of its steady steps (`steady_step_ms`:
        what the predictions must match) and of its transitions (`transition_step_ms`: probes and
        first steps, settles left out), outliers left out as the cost tables leave them
        (`step_costs.robust_mean`), with their counts (`steady_steps`, `transition_steps`, of
        the last `DIAGNOSTIC_STEPS`), the probe record, and the predicted beside the measured
        goodput (tokens/s)."""
        costs, context = self.costs, self.costs.context
        costs.context = self._contexts.get(batch or self.policy.last_batch, context)
        try:  # priced over the contexts the policy last saw at that batch, not at the last decision's
            d = self.policy.diagnostics(batch)
        finally:
            costs.context = context
        at = d["batch"]
        measured = {
            name: round(total / steps * 1e3, 4)
            for (name, b), (steps, total) in self._walls.items()
            if b == at
        }

        def means(kept: dict[tuple[str, int], deque[float]]) -> dict[str, float]:
            return {
                t.name: round(robust_mean((ms, ms) for ms in kept[(t.name, at)]) * 1e3, 4)
                for t in self.tiers
                if kept.get((t.name, at))
            }

        def counts(kept: dict[tuple[str, int], deque[float]]) -> dict[str, int]:
            return {t.name: len(kept[(t.name, at)]) for t in self.tiers if kept.get((t.name, at))}

        return {
            **d,
            "measured_step_ms": {t.name: measured[t.name] for t in self.tiers if t.name in measured},
            "steady_step_ms": means(self._steady_ms),
            "transition_step_ms": means(self._transition_ms),
            "steady_steps": counts(self._steady_ms),
            "transition_steps": counts(self._transition_ms),
            "predicted_goodput": round(self.predicted_goodput, 1),
            "measured_goodput": round(self.policy.measured_goodput, 1),
        }

    def fill(self, stats: StepStats) -> None:
        stats.predicted_goodput = self.predicted_goodput
        stats.measured_goodput = self.policy.measured_goodput


def adaptive_hysteresis(spec: SpeculativeConfig) -> float:
    """`speculative.adaptive.hysteresis`, or the drafter's default where it is null."""
    given = spec.adaptive.hysteresis if spec.adaptive is not None else None
    if given is not None:
        return given
    return NGRAM_HYSTERESIS if spec.method == "ngram" else MODEL_HYSTERESIS
