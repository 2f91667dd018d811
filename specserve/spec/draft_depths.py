"""Per-request draft depths within a tier, and what a verify of differing depths costs.

A verify is one target pass over every decoding request's last token and its drafts. Run through a
CUDA graph (`specserve/executor/cuda_graphs.py`), the step is padded to the bucket of its batch and
its widest request (`GraphBuckets.pick`): every row is as wide as the widest, so a narrower row
costs nothing in the pass — the step costs its bucket, whatever the others draft. Run eagerly (no
graphs: the CPU, tensor parallelism, a batch past the largest bucket), the pass costs by its tokens:
the sum over requests of drafts + 1. `VerifyShapes` says which, per step shape; the policy
(`specserve/spec/adaptive.py`) prices a step with it and, where narrower rows are cheaper, gives
each request of a chain tier its own depth (0 .. the tier's), by one of two objectives:

- goodput (requests are waiting: a request that finishes early makes room for one): the depths that
  maximise the step's expected tokens per second, sum_r E_r(d_r) / seconds(d). With a per-token
  verify cost s and a per-drafting-request cost c (an n-gram lookup), Dinkelbach's iteration solves
  it: at the current ratio g, each request takes the depth maximising E_r(d) - g (s d + c [d > 0]),
  which is the last position whose reach (the chance that draft j and all before it survive, never
  rising with j) is at least g s, or none; then g becomes the ratio of those depths, priced exactly,
  until it stops rising. Predictable requests draft deep, those whose drafts keep failing draft
  nothing (a row of 1 token, as a decode), so the pass shrinks.
- drain (nobody waits): a request that gets ahead frees nothing, the batch only thins; the batch
  finishes when its slowest request does, after S = max_r R_r / E_r(d_r) steps (R_r: the tokens it
  has left). At the tier's full depth S is smallest; each request then takes the least depth that
  still keeps it within S (none where R_r <= S), which leaves S as it is and saves the others'
  tokens. Those S steps cost the whole batch's step each, or (`thinned_drain_seconds`, the policy's
  `drain_thinning`) each stretch between two requests' ends costs the step of those still running.

Only chains of a drafter whose cost does not grow with depth (n-gram) are cut this way: a model
drafter's requests are cut by their reach (`min_reach`), and a tree verifies its nodes as drawn.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class VerifyShapes:
    """The CUDA-graph buckets verify passes run in: batches up to `max_batch`, query lens
    `query_lens` (ascending), batch sizes `batch_sizes` (ascending; empty: priced at the batch as
    it is); a step outside them runs eagerly. `VerifyShapes()`: no graphs."""

    query_lens: tuple[int, ...] = ()
    max_batch: int = 0
    batch_sizes: tuple[int, ...] = ()

    def padded(self, batch: int) -> int:
        """The batch a step of `batch` requests costs as: its graph bucket's, else its own."""
        return next((b for b in self.batch_sizes if b >= batch), batch)

    def bucket(self, batch: int, query_len: int) -> int | None:
        """The query len a step of `batch` requests, the widest `query_len` tokens, is padded to
        (None: eager, priced by its tokens)."""
        if batch > self.max_batch:
            return None
        return next((q for q in self.query_lens if q >= query_len), None)


def goodput_depths(
    prefixes: Sequence[Sequence[float]],
    depth: int,
    seconds_of: Callable[[list[int]], float],
    per_token: float,
    per_request: float,
    rounds: int = 4,
) -> tuple[list[int], float]:
    """Each request's depth (0..`depth`) maximising sum_r prefixes[r][d_r] / seconds_of(depths), and
    that ratio. `prefixes[r][d]`: the tokens request r is expected to emit when drafting d;
    `per_token`, `per_request`: the linear costs the iteration weighs (seconds_of prices exactly)."""
    best = [depth] * len(prefixes)
    best_rate = sum(p[depth] for p in prefixes) / seconds_of(best)
    # Reach of draft j (1-based) is prefix[j] - prefix[j - 1]; negated, it ascends, for bisect.
    falls = [[p[j - 1] - p[j] for j in range(1, depth + 1)] for p in prefixes]
    rate = best_rate
    for _ in range(rounds):
        threshold = rate * per_token
        depths = []
        for p, fall in zip(prefixes, falls, strict=True):
            d = bisect.bisect_right(fall, -threshold)  # the positions worth their token
            keep = d > 0 and p[d] - rate * (per_token * d + per_request) > p[0]
            depths.append(d if keep else 0)
        new = sum(p[d] for p, d in zip(prefixes, depths, strict=True)) / seconds_of(depths)
        if new <= rate * (1 + 1e-9):
            break
        rate = new
        if new > best_rate:
            best, best_rate = depths, new
    return best, best_rate


def drain_depths(prefixes: Sequence[Sequence[float]], remaining: Sequence[int], depth: int) -> list[int]:
    """The least depth (0..`depth`) each request needs to finish within the steps the batch needs at
    full depth, S = max_r remaining[r] / prefixes[r][depth]."""
    steps = max(r / p[depth] for p, r in zip(prefixes, remaining, strict=True))
    # prefix never falls with depth: the first d whose prefix reaches remaining / steps
    return [
        min(bisect.bisect_left(p, r / steps - 1e-9, 0, depth + 1), depth)
        for p, r in zip(prefixes, remaining, strict=True)
    ]


def drain_steps(tokens: Sequence[float], remaining: Sequence[int]) -> float:
    """Steps until the last request finishes, each emitting `tokens[r]` a step."""
    return max(r / t for t, r in zip(tokens, remaining, strict=True))


def thinned_drain_seconds(
    tokens: Sequence[float],
    remaining: Sequence[int],
    step_seconds: Callable[[int], float],
    padded: Callable[[int], int] = lambda running: running,
) -> float:
    """Seconds until the last request finishes, each emitting `tokens[r]` a step, where a step over
    n requests still running costs `step_seconds(n)`: the batch thins as its requests end, and a
    tail of a few slow requests runs at a small batch's price, not the whole batch's. `padded`: the
    batch such a step costs as (a CUDA graph's); `step_seconds` is then asked once per padded size.

    The sum over stretches, sum_j (e_j - e_{j-1}) c(n - j) over the sorted ends e, is summed by parts
    as sum_j e_j (c(n - j) - c(n - j - 1)): only the first count of each padded size adds a term."""
    ends = sorted(r / t for t, r in zip(tokens, remaining, strict=True))
    count = len(ends)
    total, below, running = 0.0, 0.0, 1
    while running <= count:
        cost = step_seconds(running)
        total += ends[count - running] * (cost - below)
        below, running = cost, padded(running) + 1
    return total
