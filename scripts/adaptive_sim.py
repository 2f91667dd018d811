"""Adaptive speculation against the H100's measured step costs, on the CPU: what the policy picks, and why.

The real control code (`AdaptiveSpeculation`: policy, acceptance estimates, cost tables) decides
every step; the engine around it is a model whose clock is issue 9's H100 run (`scripts/adaptive_gpu.sh`
at commit c274891 + SPECSERVE_FUSED_LINEAR_TOKENS=4): per batch size, the wall ms of a plain
(overlapped) step and of each static n-gram chain's step by phase (draft, target, postprocess), from
the bench rows' `step_ms`, interpolated in batch. A step of adaptive runs the chain whose CUDA-graph
bucket fits its widest draft. The start-up profile sees only a device pass (`PROFILE_SHARE` of a
live target phase: verify and compaction are host work it misses) and a lookup, as
`engine/cost_profile.py` does. As in `specserve bench offline`: one engine for every batch size in
turn (the policy keeps what it learnt), each request makes `--tokens` tokens and leaves, so the
batch thins in the tail; of `--repeats` runs the faster counts.

Acceptance is n-gram-like, bimodal: each request's lookup matches with its chance (then each draft
survives with `follow`) or drafts nothing; a request may fall into a loop (greedy small models do)
after some tokens, where nearly every draft survives. Prints, per batch, tokens/s of plain and each
static chain (beside the H100's), of adaptive, issue 9's verdict, the steps per tier and the
policy's predicted step ms beside the clock's.

    PYTHONPATH=... python -P scripts/adaptive_sim.py [--workload mixed|mt-bench] [--batches 1,4,16,64]
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
CHAINS = (1, 2, 4, 8)
GRAPH_BATCHES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
PROFILE_SHARE = 0.7  # of a live target phase, the device pass a start-up profile times

# H100 step ms by batch: plain = (wall step,), chain k = (draft, target, postprocess); and the
# measured tok/s of plain and each chain (for comparison). From the H100 run in docs/benchmarks.md
# (fifth session, `adaptive_gpu.sh` before the cost-model fix).
H100 = {
    "mt-bench": {
        "plain": {1: 0.741, 4: 1.156, 16: 1.194, 64: 2.213},
        1: {1: (0.024, 1.056, 0.035), 4: (0.056, 1.482, 0.085), 16: (0.119, 1.546, 0.219), 64: (0.424, 2.253, 0.832)},
        2: {1: (0.023, 1.141, 0.037), 4: (0.054, 1.475, 0.098), 16: (0.110, 1.552, 0.229), 64: (0.400, 2.259, 0.903)},
        4: {1: (0.023, 1.289, 0.042), 4: (0.046, 1.456, 0.091), 16: (0.110, 1.645, 0.255), 64: (0.362, 2.366, 0.945)},
        8: {1: (0.024, 1.304, 0.049), 4: (0.049, 1.486, 0.097), 16: (0.105, 1.675, 0.265), 64: (0.309, 2.448, 0.863)},
        "tok/s": {
            "off": {1: 1324, 4: 3397, 16: 13166, 64: 28451},
            "1": {1: 1338, 4: 2946, 16: 9443, 64: 19368},
            "2": {1: 1468, 4: 3086, 16: 9582, 64: 19063},
            "4": {1: 1665, 4: 3321, 16: 9177, 64: 19140},
            "8": {1: 1910, 4: 3048, 16: 9063, 64: 19180},
            "adaptive": {1: 2210, 4: 4358, 16: 8515, 64: 17494},
        },
    },
    "mixed": {
        "plain": {1: 0.751, 4: 0.965, 16: 1.336, 64: 2.518},
        1: {1: (0.027, 1.090, 0.040), 4: (0.048, 1.342, 0.078), 16: (0.138, 1.707, 0.248), 64: (0.555, 3.063, 1.176)},
        2: {1: (0.025, 1.203, 0.044), 4: (0.046, 1.385, 0.087), 16: (0.120, 1.706, 0.265), 64: (0.411, 2.806, 1.025)},
        4: {1: (0.025, 1.378, 0.052), 4: (0.039, 1.338, 0.081), 16: (0.119, 1.750, 0.289), 64: (0.509, 3.060, 1.464)},
        8: {1: (0.026, 1.417, 0.061), 4: (0.044, 1.430, 0.095), 16: (0.107, 1.774, 0.275), 64: (0.488, 3.318, 1.585)},
        "tok/s": {
            "off": {1: 1306, 4: 4079, 16: 11790, 64: 24816},
            "1": {1: 1345, 4: 3156, 16: 8817, 64: 14210},
            "2": {1: 1561, 4: 3414, 16: 9202, 64: 16192},
            "4": {1: 2066, 4: 3482, 16: 9313, 64: 13653},
            "8": {1: 2545, 4: 3302, 16: 9326, 64: 13806},
            "adaptive": {1: 2170, 4: 3748, 16: 9171, 64: 12233},
        },
    },
}
# Per workload: each request's lookup-match chance (cycled over requests), the chance a matched
# draft survives, and the token after which a request may loop (None: never), chosen so that the
# static chains' accept lengths and ratios to plain land near the H100's.
TEXT = {
    "mt-bench": {"match": (0.35, 0.1, 0.2, 0.05), "follow": 0.75, "loop_at": (120, None, None, None)},
    "mixed": {"match": (0.5, 0.15, 0.3, 0.05), "follow": 0.8, "loop_at": (80, None, None, None)},
}


def by_batch(row: dict[int, float], batch: int) -> float:
    """`row` linear in batch between its measured sizes (past the last: along its last segment)."""
    sizes = sorted(row)
    i = min(max(bisect.bisect_left(sizes, batch), 1), len(sizes) - 1)
    lo, hi = sizes[i - 1], sizes[i]
    return max(row[lo] + (row[hi] - row[lo]) * (batch - lo) / (hi - lo), min(row.values()))


class Clock:
    """The H100's step ms for `workload`, and its requests' text."""

    def __init__(self, workload: str, seed: int) -> None:
        self.table, self.text, self.seed = H100[workload], TEXT[workload], seed

    def plain_ms(self, batch: int) -> float:
        return by_batch(self.table["plain"], batch)

    def chain_ms(self, drafts: int, batch: int) -> tuple[float, float, float]:
        """(draft, target, postprocess) ms of a step whose widest draft is `drafts` deep (its bucket's chain)."""
        chain = next((c for c in CHAINS if c >= drafts), CHAINS[-1])
        rows = self.table[chain]
        return tuple(by_batch({b: rows[b][i] for b in rows}, batch) for i in range(3))  # type: ignore[return-value]

    def profile_pass_ms(self, batch: int, query_len: int) -> float:
        return PROFILE_SHARE * self.chain_ms(max(query_len - 1, 1), batch)[1]

    def requests(self, batch: int, tokens: int, run: int) -> list[SimpleNamespace]:
        """Request i's text is the same in every run (common random numbers: every system, static or
        adaptive, meets the same matches): per output position, the drafts a lookup there would get
        right, None where it finds nothing."""
        m, loops, follow = self.text["match"], self.text["loop_at"], self.text["follow"]
        reqs = []
        for i in range(batch):
            rng = random.Random(f"{self.seed}-{i}")
            matches: list[int | None] = []
            for pos in range(tokens):
                looping = loops[i % len(loops)] is not None and pos >= loops[i % len(loops)]
                chance, survive = (0.98, 0.97) if looping else (m[i % len(m)], follow)
                n = None
                if rng.random() < chance:
                    n = 0
                    while n < 16 and rng.random() < survive:
                        n += 1
                matches.append(n)
            reqs.append(SimpleNamespace(request_id=f"run{run}-r{i}", matches=matches, left=tokens))
        return reqs

    @staticmethod
    def accepted(req: SimpleNamespace, budget: int, made: int) -> int | None:
        """Drafts of `budget` that survive; None: the lookup found nothing (no draft at all)."""
        n = req.matches[min(made, len(req.matches) - 1)]
        return None if n is None else min(n, budget)


def profile(adaptive: AdaptiveSpeculation, clock: Clock) -> None:
    """As `cost_profile` does on the GPU: device passes of every tier's width at every graph batch
    (no host work) and the deepest tier's lookup (once per draft, whatever its depth)."""
    lens = sorted({t.query_len for t in adaptive.tiers})
    shapes = [(b, q) for b in GRAPH_BATCHES for q in lens]
    adaptive.costs.profile(VERIFY, shapes, lambda b, q: clock.profile_pass_ms(b, q) * MS)
    adaptive.costs.profile(DRAFT, [(b, 1) for b in GRAPH_BATCHES], lambda b, w: clock.chain_ms(8, b)[0] * MS)


def run(adaptive: AdaptiveSpeculation, clock: Clock, batch: int, tokens: int, static: Tier | None, tag: int) -> float:
    """One bench run: `batch` requests of `tokens` tokens each; tokens/s."""
    reqs = clock.requests(batch, tokens, tag)
    made = {r.request_id: 0 for r in reqs}
    total, seconds, inflight = 0, 0.0, False
    while reqs:
        if static is None:
            settings = adaptive.decide(reqs)
            tier = adaptive.tier
        else:
            tier = static
            adaptive.tier, adaptive._steps = tier, dict.fromkeys((r.request_id for r in reqs), tier.num_steps)
            settings = SimpleNamespace(num_steps=tier.num_steps)
        n, stats, emitted_of = len(reqs), StepStats(), {}
        if settings.num_steps == 0:
            ms = clock.plain_ms(n)
            stats.phases = {"step": ms * MS, "draft": 0.0}
            emitted_of = dict.fromkeys((r.request_id for r in reqs), 1)
            items = [SimpleNamespace(num_known=1, completes=True, num_tokens=1) for _ in reqs]
            inflight = True
        else:
            settle = 0.05 if inflight else 0.0  # the plain step still in flight: mostly done by now
            inflight, deepest, items = False, 0, []
            for req in reqs:
                budget = min(adaptive.steps_for(req), req.left - 1)
                accepted, proposed = 0, 0
                if budget > 0:
                    adaptive.drafting(req, budget)
                    found = clock.accepted(req, budget, made[req.request_id])
                    proposed = budget if found is not None else 0
                    accepted = found or 0
                    adaptive.observe_verify(req, accepted)
                deepest = max(deepest, proposed)
                emitted_of[req.request_id] = accepted + 1
                items.append(SimpleNamespace(num_known=1, completes=True, num_tokens=proposed + 1))
            draft, target, post = clock.chain_ms(max(deepest, 1), n)
            ms = settle + draft + target + post
            stats.phases = {
                "step": ms * MS, "draft": draft * MS, "settle": settle * MS, "target": target * MS, "postprocess": post * MS
            }
        for req in reqs:
            got = min(emitted_of[req.request_id], req.left)
            req.left -= got
            made[req.request_id] += got
            total += got
        stats.generation_tokens = sum(emitted_of.values())
        if static is None:
            adaptive.observe_step(items, stats)
        seconds += ms * MS
        for req in [r for r in reqs if r.left <= 0]:
            adaptive.forget(req.request_id)
        reqs = [r for r in reqs if r.left > 0]
    return total / seconds


def new_adaptive(clock: Clock) -> AdaptiveSpeculation:
    spec = SpeculativeConfig.from_value({"method": "ngram", "num_steps": 8, "adaptive": {"profile": False}})
    adaptive = AdaptiveSpeculation(spec)
    adaptive.overlapped_off = True
    profile(adaptive, clock)
    return adaptive


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(H100), default="mixed")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    clock = Clock(args.workload, args.seed)
    gpu = H100[args.workload]["tok/s"]
    statics = (OFF, *(Tier.chain(c) for c in CHAINS))
    adaptive = new_adaptive(clock)  # one engine for every batch size, as the bench runs it
    missed, tag = 0, 0
    for batch in [int(b) for b in args.batches.split(",")]:
        rates = {}
        for tier in statics:
            tag += 1
            rates[tier.name] = run(new_adaptive(clock), clock, batch, args.tokens, tier, tag)
        before = dict(adaptive.tier_steps)
        runs = []
        for _ in range(args.repeats):
            tag += 1
            runs.append(run(adaptive, clock, batch, args.tokens, None, tag))
        rate = max(runs)
        best = max(rates, key=rates.get)
        ratio, plain = rate / rates[best], rate / rates["off"]
        ok = ratio >= 0.97 and (batch != 64 or plain >= 0.95) and (args.workload != "mixed" or ratio > 1.0)
        missed += not ok
        used = {t.name: n - before.get(t, 0) for t, n in sorted(adaptive.tier_steps.items()) if n - before.get(t, 0)}
        print(
            f"b{batch}: " + " ".join(f"{k} {v:,.0f} (H100 {gpu[k][batch]:,})" for k, v in rates.items())
            + f"\n  adaptive {rate:,.0f} (H100 {gpu['adaptive'][batch]:,}) = {ratio:.2f}x best ({best}), "
            + f"{plain:.2f}x plain  {'ok' if ok else 'MISSED'}; steps per tier {used}"
        )
        d = adaptive.policy.diagnostics(batch)
        real = {"off": clock.plain_ms(batch), **{str(c): sum(clock.chain_ms(c, batch)) for c in CHAINS}}
        print(
            f"  predicted ms/step at b{batch}: {d['step_ms']}; the clock's: "
            + str({k: round(v, 3) for k, v in real.items()})
        )
    print("all targets met" if not missed else f"{missed} target(s) missed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
