"""Adaptive speculation against a GPU-like clock, on the CPU: what the policy picks, and why.

The real control code (`AdaptiveSpeculation`: policy, acceptance estimates, cost tables) decides
every step for `batch` requests; the engine around it is a model with H100-like costs (issue 9's run:
a plain batch-1 step ~1.1 ms, overlapped with the host; a synchronous verify pays its host work on
top; n-gram drafting is host time per request) and n-gram-like acceptance, bimodal: a lookup finds a
match with a per-request chance (then each draft survives with `--follow`) or nothing. As the engine
does, a speculative step after an overlapped plain one first waits for it (`settle`), and the
step's phases are reported the way the engine at hand reports them (before the fix the wait was
charged to the draft phase). Prints tokens/s of every static tier and of adaptive, the steps per
tier, and the policy's diagnostics.

    PYTHONPATH=... python -P scripts/adaptive_sim.py [--batch 1] [--match 0.8,0.3] [--steps 400]
"""

from __future__ import annotations

import argparse
import bisect
import random
from types import SimpleNamespace

from specserve.config import SpeculativeConfig
from specserve.engine.adaptive_control import AdaptiveSpeculation
from specserve.engine.stats import StepStats
from specserve.spec.adaptive import OFF, Tier
from specserve.spec.step_costs import DRAFT, VERIFY

MS = 1e-3
# Device ms of a target pass over this many tokens (batch x query length): launch-bound up to ~16.
PASS_MS = {1: 1.0, 4: 1.05, 16: 1.3, 64: 2.2, 144: 3.5, 256: 5.0, 576: 10.0, 1024: 17.0}


def pass_ms(tokens: int) -> float:
    sizes = sorted(PASS_MS)
    i = min(bisect.bisect_left(sizes, tokens), len(sizes) - 1)
    if sizes[i] == tokens or i == 0:
        return PASS_MS[sizes[i]] * max(1.0, tokens / sizes[-1])
    lo, hi = sizes[i - 1], sizes[i]
    return PASS_MS[lo] + (PASS_MS[hi] - PASS_MS[lo]) * (tokens - lo) / (hi - lo)


def host_ms(batch: int) -> float:
    """Host work of a step (schedule, inputs, verify, postprocess): hidden when overlapped."""
    return 0.3 + 0.02 * batch


def lookup_ms(batch: int, per_request: float) -> float:
    return 0.05 + per_request * batch


class Clock:
    def __init__(self, batch: int, match: list[float], follow: float, lookup: float, seed: int) -> None:
        self.batch, self.follow, self.lookup = batch, follow, lookup
        self.rng = random.Random(seed)
        self.match = {f"r{i}": match[i % len(match)] for i in range(batch)}
        self.reqs = [SimpleNamespace(request_id=rid) for rid in self.match]

    def accepted(self, rid: str, budget: int) -> int:
        if self.rng.random() >= self.match[rid]:
            return 0  # no match: nothing drafted, position 1 rejected
        n = 0
        while n < budget and self.rng.random() < self.follow:
            n += 1
        return n

    def decode_ms(self) -> float:
        return max(pass_ms(self.batch), host_ms(self.batch))  # overlapped

    def spec_ms(self, width: int) -> tuple[float, float]:
        """(draft, verify) ms of a synchronous speculative step."""
        return lookup_ms(self.batch, self.lookup), pass_ms(self.batch * width) + host_ms(self.batch)


def profile(adaptive: AdaptiveSpeculation, clock: Clock) -> None:
    """As `cost_profile` does on the GPU: device passes of every tier's width (no host work) and
    the deepest tier's draft over its steps."""
    lens = sorted({t.query_len for t in adaptive.tiers})
    adaptive.costs.profile(VERIFY, [(clock.batch, q) for q in lens], lambda b, q: pass_ms(b * q) * MS)
    deepest = max(t.num_steps for t in adaptive.tiers)
    adaptive.costs.profile(
        DRAFT,
        [(clock.batch, 1)],
        lambda b, w: (
            lookup_ms(b, clock.lookup)
            / (deepest if adaptive.policy.__dict__.get("draft_per_step", True) else 1)
            * MS
        ),
    )


def run(args: argparse.Namespace, static: Tier | None) -> tuple[float, AdaptiveSpeculation]:
    spec = SpeculativeConfig.from_value({"method": "ngram", "num_steps": 8, "adaptive": {"profile": False}})
    adaptive = AdaptiveSpeculation(spec)
    adaptive.overlapped_off = True
    clock = Clock(args.batch, args.match, args.follow, args.lookup, args.seed)
    profile(adaptive, clock)
    new_settle = hasattr(adaptive, "diagnostics")  # the engine that laps its settle apart
    if static is not None:
        adaptive.policy.decide = lambda ids: SimpleNamespace(
            tier=static, steps=dict.fromkeys(ids, static.num_steps), predicted_goodput=0.0, switched=False
        )
    tokens, seconds, overlapped = 0, 0.0, False
    for _ in range(args.steps):
        settings = adaptive.decide(clock.reqs)
        stats = StepStats()
        if settings.num_steps == 0:
            ms = clock.decode_ms()
            emitted = clock.batch
            stats.phases = {"step": ms * MS, "draft": 0.0}
            widths = [1] * clock.batch
            overlapped = True
        else:
            settle = clock.decode_ms() * 0.9 if overlapped else 0.0  # the plain step still on the device
            overlapped = False
            emitted, widths = 0, []
            for req in clock.reqs:
                budget = adaptive.steps_for(req)
                adaptive.drafting(req, budget)
                accepted = clock.accepted(req.request_id, budget)
                adaptive.observe_verify(req, accepted)
                emitted += accepted + 1
                widths.append(budget + 1)
            draft, verify = clock.spec_ms(max(widths))
            ms = settle + draft + verify
            phases = {"step": ms * MS, "draft": draft * MS}
            if new_settle:
                phases["settle"] = settle * MS
            else:
                phases["draft"] += settle * MS
            stats.phases = phases
        stats.generation_tokens = emitted
        items = [SimpleNamespace(num_known=1, completes=True, num_tokens=w) for w in widths]
        adaptive.observe_step(items, stats)
        tokens += emitted
        seconds += ms * MS
    return tokens / seconds, adaptive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--match", default="0.8,0.3", help="per-request chances a lookup matches")
    parser.add_argument("--follow", type=float, default=0.85, help="chance each matched draft survives")
    parser.add_argument("--lookup", type=float, default=0.15, help="host ms of one n-gram lookup")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.match = [float(m) for m in args.match.split(",")]
    rates = {}
    for tier in (OFF, Tier.chain(1), Tier.chain(2), Tier.chain(4), Tier.chain(8)):
        rates[tier.name], _ = run(args, tier)
    best = max(rates, key=rates.get)
    rate, adaptive = run(args, None)
    print(
        f"batch {args.batch}, match {args.match}, follow {args.follow}, lookup {args.lookup} ms/request: "
        + " ".join(f"{name} {r:,.0f}" for name, r in rates.items())
        + f" tok/s | adaptive {rate:,.0f} = {rate / rates[best]:.2f}x best ({best}), {rate / rates['off']:.2f}x off"
    )
    print("  steps per tier:", {t.name: n for t, n in sorted(adaptive.tier_steps.items())})
    if hasattr(adaptive, "diagnostics"):
        print("  diagnostics:", adaptive.diagnostics())
    else:
        policy = adaptive.policy
        table = {t.name: round(policy.step_seconds(t, args.batch) * 1e3, 3) for t in policy.tiers}
        pooled = [round(r, 2) for r in adaptive.acceptance.pooled(1)]
        print("  step ms:", table, "pooled acceptance:", pooled)


if __name__ == "__main__":
    main()
