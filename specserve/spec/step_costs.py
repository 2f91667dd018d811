"""What a step costs, by shape: measured at start-up where the shapes are known, refined while serving.

Two kinds of cost feed the adaptive policy: a target pass over `batch` requests of `query_len`
tokens each (a decode when query_len is 1, a verify of query_len - 1 drafts otherwise), and one
draft step over `batch` requests at `topk` branches (a model drafter's forward; n-gram lookup's
host time). Each is a table of seconds keyed by (batch, width), filled by start-up profiling of the
CUDA-graph buckets and kept current by an exponential moving average of what steps measured.
Shapes never measured are interpolated linearly in batch between the nearest measured ones of the
same width (past the largest, scaled in proportion; below the smallest, its cost: small batches
are bound by launches, not by size), so one profile of the buckets covers every batch in between.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable

VERIFY, DRAFT = "verify", "draft"


class StepCosts:
    """`alpha`: weight of a new measurement in its shape's average. `default`: seconds a kind's
    unmeasured shape is assumed to cost per token (batch * width) when no shape of its width was
    measured at all; an engine replaces it within the first steps."""

    def __init__(self, alpha: float = 0.2, default: float = 1e-3) -> None:
        self.alpha, self.default = alpha, default
        self._table: dict[tuple[str, int], dict[int, float]] = {}

    def observe(self, kind: str, batch: int, width: int, seconds: float) -> None:
        if batch < 1 or width < 1 or not seconds > 0:
            return  # an empty or untimed step says nothing about cost
        row = self._table.setdefault((kind, width), {})
        old = row.get(batch)
        row[batch] = seconds if old is None else old + self.alpha * (seconds - old)

    def profile(self, kind: str, shapes: Iterable[tuple[int, int]], run: Callable[[int, int], float]) -> None:
        """Measure each (batch, width) with `run` (seconds) and take it as is."""
        for batch, width in shapes:
            seconds = run(batch, width)
            if seconds > 0:
                self._table.setdefault((kind, width), {})[batch] = seconds

    def estimate(self, kind: str, batch: int, width: int) -> float:
        row = self._table.get((kind, width))
        if not row:
            return self._unmeasured(kind, batch, width)
        if batch in row:
            return row[batch]
        sizes = sorted(row)
        i = bisect.bisect_left(sizes, batch)
        if i == 0:  # a smaller batch is bound by launches as the smallest measured one is
            return row[sizes[0]]
        if i == len(sizes):
            return row[sizes[-1]] * batch / sizes[-1]
        lo, hi = sizes[i - 1], sizes[i]
        return row[lo] + (row[hi] - row[lo]) * (batch - lo) / (hi - lo)

    def _unmeasured(self, kind: str, batch: int, width: int) -> float:
        """From the nearest measured width of the same kind, in proportion to tokens; else the default."""
        widths = [w for (k, w) in self._table if k == kind and self._table[(k, w)]]
        if not widths:
            return self.default * batch * width
        nearest = min(widths, key=lambda w: abs(w - width))
        return self.estimate(kind, batch, nearest) * width / nearest

    def measured(self) -> dict[tuple[str, int, int], float]:
        """Every measured shape: (kind, batch, width) -> seconds."""
        return {(k, b, w): s for (k, w), row in self._table.items() for b, s in row.items()}
