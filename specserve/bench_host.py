"""What the host did during one timed bench run: when it started, the process's CPU time, and the
machine's stolen and idle time.

Repeats of one system at one batch size have spread 10% apart on the H200 machine (a Firecracker
microVM) even after a warm-up round, the first systems of a round slow in one call and fast in the
next. These figures sit beside each repeat's seconds (`BenchRow.repeat_host`), so a slow repeat can
be told apart: a host that lost its CPU to other guests (`steal_seconds` up), one that was busy
elsewhere (`cpu_seconds` over the wall), or the device (neither moved; `scripts/bench_rounds.py`
sets the GPU's logged clocks beside them). Steal and idle come from `/proc/stat` and are None where
it cannot be read (not Linux).

Python's own pauses count too: the bench freezes what its warm-up left (`gc.freeze`), but every run
makes new objects, and a full collection (generation 2) walks all of them that are not frozen. Each
sample reads the full collections so far and the seconds every collection took, clocked by a
`gc.callbacks` hook installed with the first sample: a slow repeat that ran one shows it.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
# /proc/stat's aggregate `cpu` line: user nice system idle iowait irq softirq steal ...
_IDLE, _STEAL = 3, 7


class _GcClock:
    """Seconds spent in the collector and full collections since installed (`gc.callbacks`)."""

    def __init__(self) -> None:
        self.seconds, self.full, self._started = 0.0, 0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._started
        self.full += info.get("generation") == 2


_GC_CLOCK: _GcClock | None = None


def _gc_clock() -> _GcClock:
    global _GC_CLOCK
    if _GC_CLOCK is None:
        _GC_CLOCK = _GcClock()
        gc.callbacks.append(_GC_CLOCK)
    return _GC_CLOCK


@dataclass(frozen=True)
class HostSample:
    wall: float  # Unix seconds
    cpu: float  # this process's CPU seconds, every thread
    idle: float | None  # the machine's idle seconds summed over its CPUs
    steal: float | None  # the machine's stolen seconds summed over its CPUs
    gc_seconds: float = 0.0  # this process's seconds in the garbage collector since the first sample
    gc_full: int = 0  # its full (generation 2) collections since then

    @classmethod
    def now(cls, stat: Path = PROC_STAT) -> HostSample:
        idle, steal = _machine_times(stat)
        clock = _gc_clock()
        return cls(time.time(), time.process_time(), idle, steal, clock.seconds, clock.full)

    def until(self, later: HostSample) -> dict[str, float | None]:
        """The run from this sample to `later`: its start (Unix seconds) and what each clock spent."""
        return {
            "started_at": round(self.wall, 3),
            "cpu_seconds": round(later.cpu - self.cpu, 4),
            "idle_seconds": _spent(self.idle, later.idle),
            "steal_seconds": _spent(self.steal, later.steal),
            "gc_seconds": round(later.gc_seconds - self.gc_seconds, 4),
            "gc_full": later.gc_full - self.gc_full,
        }


def _spent(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else round(after - before, 4)


def _machine_times(stat: Path) -> tuple[float | None, float | None]:
    """(idle, steal) seconds of the whole machine from `stat`'s `cpu` line; None where unreadable."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
    except OSError:
        return None, None
    if len(fields) <= 1 + _STEAL or fields[0] != "cpu":
        return None, None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return int(fields[1 + _IDLE]) / tick, int(fields[1 + _STEAL]) / tick
