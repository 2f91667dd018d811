"""Summaries of latency samples for `specserve bench online`: mean and percentiles, nothing else.

Percentiles interpolate linearly between the two nearest ranks (numpy's default method), so a p99
over a few hundred requests lies between real samples rather than snapping to the maximum.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Summary:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`, linear between closest ranks; NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q: must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float]) -> Summary | None:
    """Mean, p50/p90/p99 and max of `values`; None when there are none (nothing to report)."""
    if not values:
        return None
    p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
    return Summary(len(values), math.fsum(values) / len(values), p50, p90, p99, max(values))
