"""Phase 3 of draft training: how often the target accepts a head's drafts, measured through the engine.

Each configuration runs the prompts to completion with speculative decoding and sums the engine's
per-request accept histograms (`meta_info.spec_accept_histogram`: verify steps by accepted draft
count). Reported: the accept length (accepted drafts + 1 per verify step, the figure SGLang and
the EAGLE papers report) and the per-position acceptance (the share of verify steps whose draft at
position i was accepted; a chain accepts position i only if it accepted 0..i-1, and a tree counts
by depth).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from specserve.types import SamplingParams


@dataclass(frozen=True)
class AcceptReport:
    speculative: dict
    temperature: float
    prompts: int
    output_tokens: int
    verify_steps: int
    accept_length: float
    per_position: tuple[float, ...]
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def accept_report(
    speculative: dict, temperature: float, outputs: Sequence, seconds: float, num_steps: int
) -> AcceptReport:
    """Sum the outputs' accept histograms into one report."""
    hist = [0] * (num_steps + 1)
    for out in outputs:
        for accepted, count in enumerate(out.meta.get("spec_accept_histogram", [])):
            hist[accepted] += count
    steps = sum(hist)
    length = sum((a + 1) * c for a, c in enumerate(hist)) / steps if steps else 0.0
    per_position = tuple(sum(hist[i + 1 :]) / steps if steps else 0.0 for i in range(num_steps))
    return AcceptReport(
        speculative,
        temperature,
        len(outputs),
        sum(len(o.token_ids) for o in outputs),
        steps,
        length,
        per_position,
        seconds,
    )


def measure_acceptance(
    llm,
    prompts: Sequence[Sequence[int]],
    temperature: float,
    max_new_tokens: int,
    seed: int = 0,
) -> AcceptReport:
    """Run `prompts` (token ids) on `llm` (speculative) and report its acceptance."""
    spec = llm.engine.config.speculative
    params = [
        SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i)
        for i in range(len(prompts))
    ]
    llm.engine.flush_cache()
    start = time.perf_counter()
    outputs = llm.generate([list(p) for p in prompts], params)
    seconds = time.perf_counter() - start
    described = {k: v for k, v in asdict(spec).items() if v is not None and not k.startswith("ngram")}
    return accept_report(described, temperature, outputs, seconds, spec.num_steps)
