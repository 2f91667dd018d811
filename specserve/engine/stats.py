"""What one engine step did, counted on the host where it happens, for an optional metrics sink.

The engine fills a `StepStats` from data it already holds on the host (verify results are copied
there anyway, the scheduler and KV manager are host code) and times its phases with host clocks,
so measuring costs no GPU sync. At the end of each step it hands the stats to its `StatsSink`, if
it has one (`specserve.metrics.EngineMetrics` under a server), and starts afresh: the offline
`LLM` API has no sink and never touches Prometheus.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol


class SpecSettings(NamedTuple):
    """The speculation shape a step ran with (all 0 when speculation is off)."""

    num_steps: int = 0
    topk: int = 0
    num_draft_tokens: int = 0


@dataclass
class StepStats:
    prompt_tokens: int = 0  # of requests added since the last step
    generation_tokens: int = 0  # output tokens this step added
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    retracted: int = 0
    prefix_queries: int = 0  # tokens looked up in the prefix cache by admitted requests
    prefix_hits: int = 0  # of those, tokens whose KV came from the cache
    queue_times: list[float] = field(default_factory=list)  # arrival -> first scheduling, seconds
    draft_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [p]: verifies accepting draft p
    accept_lengths: list[int] = field(default_factory=list)  # accepted drafts + 1, one per verify
    phases: dict[str, float] = field(default_factory=dict)  # host seconds per step phase
    spec: SpecSettings = SpecSettings()
    # Adaptive speculation: tokens per second the chosen tier was predicted to make, and the
    # moving average of what steps made (None without adaptation).
    predicted_goodput: float | None = None
    measured_goodput: float | None = None
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    _start: float = 0.0
    _mark: float = 0.0

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted_per_position)

    def count_verify(self, drafted: int, accepted: int) -> None:
        """A decoding request's verify: `accepted` of its `drafted` tokens survived (a chain, so
        positions 0..accepted-1)."""
        self.draft_tokens += drafted
        self.accept_lengths.append(accepted + 1)
        per_position = self.accepted_per_position
        per_position.extend([0] * (accepted - len(per_position)))
        for position in range(accepted):
            per_position[position] += 1

    def start_clock(self) -> None:
        self.phases.clear()  # times of a step that raised midway are not this step's
        self._start = self._mark = time.perf_counter()

    def stop_clock(self) -> None:
        """The whole step's host time, as phase `step`."""
        self.phases["step"] = time.perf_counter() - self._start

    def lap(self, phase: str | None) -> None:
        """Charge the host time since the last mark to `phase` (None: to no phase)."""
        now = time.perf_counter()
        if phase is not None:
            self.phases[phase] = self.phases.get(phase, 0.0) + now - self._mark
        self._mark = now


class StatsSink(Protocol):
    def record_step(self, stats: StepStats) -> None:
        """Called on the engine's thread at the end of every step (and once when attached)."""
        ...


class PhaseTotals:
    """A StatsSink that sums each phase's host seconds over the steps that ran a batch, for
    benchmarks and profiles: where a step's time goes (draft, target, postprocess)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.steps = 0
        self.step_seconds: list[float] = []  # each step's whole host time: are slow steps rare or all?

    def record_step(self, stats: StepStats) -> None:
        if "step" in stats.phases:
            self.steps += 1
            self.step_seconds.append(stats.phases["step"])
            for name, seconds in stats.phases.items():
                self.totals[name] = self.totals.get(name, 0.0) + seconds

    def step_spread(self) -> dict[str, float]:
        """Median, 90th percentile and largest step time, ms (empty before any step)."""
        if not self.step_seconds:
            return {}
        ms = sorted(s * 1e3 for s in self.step_seconds)
        return {"p50": ms[len(ms) // 2], "p90": ms[int(len(ms) * 0.9)], "max": ms[-1]}

    def ms_per_step(self) -> dict[str, float]:
        return (
            {name: seconds / self.steps * 1e3 for name, seconds in self.totals.items()} if self.steps else {}
        )
