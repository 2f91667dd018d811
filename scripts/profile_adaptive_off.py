"""On the CPU: the adaptive control's host cost per plain step (µs) while the policy is off: its
decision (scoring, probes), shadow drafts and the step's bookkeeping (`AdaptiveSpeculation.decide`
and `observe_step`), without an engine around it, so the figure moves little with the machine's load
(the least of several runs). The requests are fake: text no lookup matches (each shadow settles at
once, position 1 rejected), one token a step, nobody waiting (the drain). The cost tables are
H100-like in shape, a verify launch-bound at small batch and dearer per token at large, so that a
tier could win at every batch were its drafts accepted: the policy scores the batch rather than
taking the off path that reads no request (`AdaptivePolicy._hopeless`), as on issue 9's H100 run.

    PYTHONPATH=... python -P scripts/profile_adaptive_off.py [--batches 1,16,64] [--steps 300]
"""

from __future__ import annotations

import argparse
import random
import time
from types import SimpleNamespace

from specserve.config import SpeculativeConfig
from specserve.engine.adaptive_control import AdaptiveSpeculation
from specserve.engine.request import ListMirror
from specserve.engine.stats import StepStats
from specserve.spec.adaptive import OFF
from specserve.spec.ngram import NgramDrafter
from specserve.spec.step_costs import DRAFT, VERIFY

MS = 1e-3


def run(batch: int, steps: int, seed: int = 0) -> float:
    """Mean µs per step of `steps` plain steps over `batch` requests."""
    spec = SpeculativeConfig.from_value({"method": "ngram", "num_steps": 8, "adaptive": {"profile": False}})
    control = AdaptiveSpeculation(spec)
    control.overlapped_off = True
    control.use_shadow(NgramDrafter(1, 4).lookup)
    shapes = [(b, q) for b in (1, 4, 16, 64) for q in (1, 2, 3, 5, 9)]
    control.costs.profile(VERIFY, shapes, lambda b, q: (0.6 + 0.05 * q + 0.01 * b * q) * MS)
    control.costs.profile(DRAFT, [(b, 1) for b in (1, 4, 16, 64)], lambda b, w: 0.01 * b * MS)
    control.policy.current = OFF
    control.policy.probe_every = control.policy.probe_interval = 10**9  # no probe: the off path only
    rng = random.Random(seed)
    params = SimpleNamespace(max_new_tokens=10**6)
    reqs = [
        SimpleNamespace(
            request_id=f"r{i}",
            params=params,
            num_output=0,
            token_ids=[rng.randrange(10**6) for _ in range(300)],
            num_pending=0,
            prompt_len=300,
            token_mirror=ListMirror(),
        )
        for i in range(batch)
    ]
    for req in reqs:  # drafts that missed: off is the policy's choice, on evidence
        for _ in range(5):
            control.acceptance.observe(req.request_id, 1, 8, 0, batch)
    items = [SimpleNamespace(num_known=1, completes=True, num_tokens=1) for _ in reqs]
    total = 0.0
    for _ in range(steps):
        for req in reqs:
            req.token_ids.append(rng.randrange(10**6))
            req.num_output += 1
        start = time.perf_counter()
        settings = control.decide(reqs)
        stats = StepStats()
        stats.phases = {"step": (0.65 + 0.01 * batch) * MS}
        stats.generation_tokens = batch
        control.observe_step(items, stats)
        total += time.perf_counter() - start
        if settings.num_steps:
            raise SystemExit(f"batch {batch}: the policy switched on; the figures are of the off path only")
    return total / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5, help="each figure is the least of these runs")
    args = parser.parse_args()
    for batch in (int(b) for b in args.batches.split(",")):
        least = min(run(batch, args.steps) for _ in range(args.repeats))
        print(f"batch {batch:>3}: {least:7.1f} µs per plain step (decide + observe_step + shadows)")


if __name__ == "__main__":
    main()
