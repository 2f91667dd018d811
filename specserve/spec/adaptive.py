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
predictable: every `probe_every` steps off, one step runs the best speculative tier as a probe
(not a switch). The measured goodput (tokens emitted per second of step, an EMA) sits beside the
predicted one for the metrics.

Scoring every tier for every request costs a few hundred microseconds at batch 64, as much as a
decode step's GPU time there; while nothing was verified since (speculation off) and the batch is
the same, the scores change only as the cost tables drift, so they are kept for up to
`rescore_every` decisions.

Within the chosen tier a request drafts fewer tokens when its own estimates say the later drafts are
hopeless (the chance to reach them below `min_reach`): the verify is padded to the tier's shape
anyway, but fewer drafts mean less draft work and less KV written for nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specserve.config import SpeculativeConfig
from specserve.spec.acceptance import AcceptanceTracker, expected_tokens, reach
from specserve.spec.step_costs import DRAFT, VERIFY, StepCosts


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
    ) -> None:
        if not tiers:
            raise ValueError("tiers: at least one")
        self.tiers = tuple(sorted(set(tiers)))
        self.costs, self.acceptance = costs, acceptance
        self.hysteresis, self.patience, self.min_reach = hysteresis, patience, min_reach
        self.probe_every, self.goodput_alpha = probe_every, goodput_alpha
        self.rescore_every = rescore_every
        self._scored: tuple | None = None  # (request ids, tracker version, rates, scores, steps by tier)
        self._scored_age = 0
        self.current: Tier | None = None
        self.switches = 0
        self.measured_goodput = 0.0
        self._since_probe = 0
        self._challenger: Tier | None = None
        self._streak = 0

    def goodput(self, tier: Tier, request_ids: Sequence[str]) -> float:
        """Predicted tokens per second of one step of `tier` over these requests."""
        return self._goodput(tier, self._rates(request_ids))

    def _rates(self, request_ids: Sequence[str]) -> dict[int, dict[str, list[float]]]:
        """Each request's rates at every topk a tier uses, read once per decision."""
        topks = {t.topk for t in self.tiers if not t.off}
        rates = {k: self.acceptance.rates_of(request_ids, k) for k in topks}
        return rates or {1: dict.fromkeys(request_ids, [])}

    def _goodput(self, tier: Tier, rates: dict[int, dict[str, list[float]]]) -> float:
        by_request = next(iter(rates.values())) if tier.off else rates[tier.topk]
        if not by_request:
            return 0.0
        if tier.off:
            tokens = float(len(by_request))
        else:
            tokens = sum(expected_tokens(r, self._steps_for(tier, r)) for r in by_request.values())
        return tokens / self.step_seconds(tier, len(by_request))

    def step_seconds(self, tier: Tier, batch: int) -> float:
        seconds = self.costs.estimate(VERIFY, batch, tier.query_len)
        if not tier.off:
            seconds += tier.num_steps * self.costs.estimate(DRAFT, batch, tier.topk)
        return seconds

    def decide(self, request_ids: Sequence[str]) -> Decision:
        """The tier for this step's decoding requests, and each one's draft steps."""
        ids, version = tuple(request_ids), self.acceptance.version
        scored = self._scored
        if scored is None or scored[:2] != (ids, version) or self._scored_age >= self.rescore_every:
            rates = self._rates(ids)
            scored = self._scored = (
                ids,
                version,
                rates,
                {t: self._goodput(t, rates) for t in self.tiers},
                {},
            )
            self._scored_age = 0
        self._scored_age += 1
        _, _, rates, scores, steps_by_tier = scored
        best = max(self.tiers, key=lambda t: (scores[t], -t.num_steps))
        switched = self._update(best, scores)
        tier = self._probe(scores) or self.current
        steps = steps_by_tier.get(tier)
        if steps is None:
            own = rates.get(tier.topk, {})
            steps = steps_by_tier[tier] = {r: 0 if tier.off else self._steps_for(tier, own[r]) for r in ids}
        return Decision(tier, steps, scores[tier], switched)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step emitted `tokens` in `seconds` (draft and target): the measured goodput's EMA."""
        if seconds > 0:
            rate = tokens / seconds
            old = self.measured_goodput
            self.measured_goodput = rate if old == 0 else old + self.goodput_alpha * (rate - old)

    def _probe(self, scores: dict[Tier, float]) -> Tier | None:
        """The best speculative tier, once every `probe_every` steps with speculation off."""
        if not self.current.off:
            self._since_probe = 0
            return None
        self._since_probe += 1
        speculative = [t for t in self.tiers if not t.off]
        if self._since_probe < self.probe_every or not speculative:
            return None
        self._since_probe = 0
        return max(speculative, key=lambda t: scores[t])

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
        self.switches += 1
        return True

    def _steps_for(self, tier: Tier, rates: Sequence[float]) -> int:
        """A request's draft steps in `tier`: those it reaches with odds of at least `min_reach`."""
        steps = sum(1 for p in reach(rates[: tier.num_steps]) if p >= self.min_reach)
        return max(1, steps)  # one draft always: without it the request could never show better odds


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
