"""What a step costs, by shape: measured at start-up where the shapes are known, refined while serving.

Three kinds of step cost feed the adaptive policy: a target pass over `batch` requests of `query_len`
tokens each in a synchronous step (a verify of query_len - 1 drafts; a decode when query_len is 1),
one draft step over `batch` requests at `topk` branches (a model drafter's forward; n-gram lookup's
host time), and a plain decode step as the engine runs it with speculation off, overlapped with the
host work of the step before (`DECODE`, measured only: its host work hides behind the device's, so
it costs less than a synchronous pass of one token); and beside them what a switch of tier costs
(`SETTLE` and `SETUP`, measured only). Each is a table of seconds keyed by (batch,
width), filled by start-up profiling of the CUDA-graph buckets and kept current by what steady
live steps measured (a robust mean of the last few, below). Shapes never measured are interpolated
linearly in batch between the nearest measured ones of the same width (past the largest, scaled in
proportion; below the smallest, its cost: small batches are bound by launches, not by size), so one
profile of the buckets covers every batch in between.

A profile times the device pass alone (input building, launch, sync); a live step adds its host
work (verify, compaction, postprocess), which grows with the batch but hardly with the draft length.
So each live measurement of a profiled shape also updates that kind's residual at its batch
(measured minus profiled, a robust mean of its last gaps, so whole from the first ones, not grown
from 0: issue 9's H100 run had the policy price a 64-request verify at a fifth of its host work for
its first steps), and a
profiled shape not yet measured live is estimated as its profile plus the residual, interpolated
in batch between the batches that measured one (past them: along the slope of all of them, not
the last segment's, which joins two neighbours of a bench row's tail; host work grows with the
batch, so the nearest batch's residual alone priced a 64-request verify like a 16-request one). Otherwise the shapes the engine never ran would look cheaper than those it did,
and the policy would wander from tier to tier, each disappointing once tried (issue 9, batch 4).

A device loop's step (`observe`'s `rows`) has no host work between its forwards: what it costs beyond
its profile is the attention over the requests' real contexts (the profile's rows hold one token),
so its gap is kept with the requests' mean context (`context`: the engine passes it, and sets
`StepCosts.context` to the mean of the step it prices), per width and batch (between measured
batches linear, past them the nearest one's), and priced at today's contexts along a slope per
context token read from the steps: a width's own where their contexts spread by `CONTEXT_SPREAD`
of their mean, else that of the widths measured at the batch that do, never below 0 nor above all
of the gap per token; with no slope to read, in proportion to the context. A gap as it was lagged
the contexts' growth; in proportion, it priced what does not grow: on the H200 (eighteenth session,
`scripts/trace_steps.py`, MT-Bench, batch 16 and 64) a loop iteration cost the same over contexts of
150 as of 330 tokens, and the proportional price of a chain measured at a batch's start rose to
1.3-1.5x its steady steps by the batch's end (the 3-chain above the 4-chain measured later). Per token of all the
requests' contexts instead, the gap measured at batch 4 (where the attention is bound by latency,
not by the tokens) priced a loop step at batch 16 at 4 times its gap, and no loop tier ran there to
correct it (the H200, mixed prompts: off for 160 engine steps where every static chain made 1.14-1.17x
plain). A measured width is priced so too (its profile and its gap at today's contexts), not at its
last steps' mean. A width not measured is priced from those that were: linear in the width through
them, past the widest along their slope (never falling), so a fixed part per request and a part per
query row. That split differs by device and text: on the H100 (eleventh session, MT-Bench, batch
64) the 8-chain's 9 rows cost ~1.65x the 2-chain's 3 beyond their profiles, while on the H200
(fifteenth session, MT-Bench, batch 64, `scripts/trace_steps.py`) the gaps of the 1-, 2-, 4- and
8-chains were 0.33, 0.31, 0.29 and 0.24 ms: all per request (the attention reads a request's KV
once for all its rows); charged per row from the 1-chain, the 2-chain was priced 2.4 ms on mixed
prompts where its few steps cost ~1.9 (fourteenth session), and it never ran. Where the measured widths do not settle the split, a
width gets the least it could make it: past the one width measured, that width's gap (all fixed);
below the narrowest, in proportion (all per row). A tier priced too dear is never run to correct
it, while one priced too cheap is run, measured, and priced by the fit through its own width.
A width measured only at other batches takes the nearest batch's gap plus what the gaps of the
widths measured both there and at this batch grew between the two (`_grown_to`); with none, the
nearest batch's gap as it is; plain decoding's never less than that of the narrowest width measured
at this batch (`_floored`: its loop reads each request's KV as the chains' do). Kept flat, it
priced plain decoding at batch 64 by its batch-16 gap beside chains measured at 64: on the H200
(twenty-ninth session, mixed prompts) the policy went off for 11 engine steps of a batch of 64,
where plain loop iterations cost 1.83-2.00 ms and the 1-chain's 1.59-1.95, and the static 2-chain
made 1.7 tokens a verify at that cost. Grown, it still
went off there (thirtieth session): plain decoding's own gap grows with the batch faster than the
chains' (a plain iteration at 64 costs about what a 2-chain's does), so growth alone is not its
price. Hence the floor of the narrowest chain measured there (thirty-first session; not yet run on
the GPU): at batch 64 a plain iteration's cost beyond its replay was about the 2-chain's.
At one batch the measured widths' prices are then made non-decreasing in width, adjacent ones out of
order pooled, weighted by the steps that measured them (`isotonic`): a width tried over a few steps
early in a batch was priced above a wider one measured over most of it, and a wider one below a
narrower (`StepCosts._monotone_gaps`).

A kind measured only live (`DECODE`: an overlapped step cannot be profiled alone) borrows the batch
shape of a profiled kind (`shape_of`, width 1): past its measured batches, the nearest measured
cost plus what the profile adds from there. Scaled in proportion to the batch instead, the plain
step measured at 16 requests priced the one at 64 at 2.1x what it costs, and every speculative
tier looked cheap beside it (issue 9, batch 64: adaptive at 0.49x plain). Before any of its steps
was measured, it costs the borrowed kind's profile alone: an overlapped plain step hides its host
work behind the device pass, so a synchronous one-token pass with the verify's host work on top
priced it at up to 1.7x its cost (the policy at batch 1 and 4 had never run a plain step).

What a live shape costs is the mean of its last `window` steady measurements less those over
`OUTLIER` times their median (and a residual likewise of its last gaps), not a moving average: one
step that paid for something else (a prefill settled inside the first plain step of a run, a
first-time cost, a host hiccup) drops out, where it lifted an average with alpha 0.2 by a fifth of
its excess and took ten steps to fade (issue 9's H100 run, MT-Bench batch 16: a plain step priced
4.11 ms against 1.19 real, never corrected because the policy, believing it, stopped running plain
steps there). Not their median: a chain tier's steps differ by what its lookups found (a step
whose drafts came out short runs a narrower CUDA-graph bucket), and its cost is their mean; the
median priced it at its dearer steps. `window` is the EMA's span, 2 / alpha - 1 (alpha 0.2: 9). Which steps are steady is the engine's call
(`specserve/engine/adaptive_control.py`); a measurement marked not steady (a transition: the first
step of a tier, a probe) never sets a price where there is a profile or a steady one: it fills in
only a shape nothing else prices. Pricing a tier from its probes is how the H100 run priced the
8-chain at batch 1 at 1.5x what its steady steps cost, and never ran it to learn better.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple

VERIFY, DRAFT, DECODE = "verify", "draft", "decode"
# The host's settle of a device-loop run (width 1), hidden behind the next run while the tier stands
# and exposed by a switch: measured only, priced linearly in batch, past the measured ones along their
# slope (host work per request), never from a default (`AdaptivePolicy.switch_seconds`).
SETTLE = "settle"
# The host's setup of a fresh device-loop run (width 1: histories, page tables, the head's seeds
# copied over, the run queued), which a switch exposes after the settle: measured only, as SETTLE.
SETUP = "setup"
# Steady measurements a shape's live price (and a batch's residual) waits for: with three, one
# outlier is told by their median. One is not enough: the bench's warm-up verifies at batch 2 a few
# steps only, and a one-off cost in one of them, taken as that batch's residual, priced every tier
# at batch 1 at 4-6x (the batch next to it), so no tier ran there to correct it
# (`scripts/adaptive_sim.py`).
MIN_SAMPLES = 3
OUTLIER = 2.0  # a measurement over this many times its window's median is not the shape's cost
# A loop gap's slope in context is read from its steps only where their contexts spread by at least
# this part of their mean (standard deviation); closer, measurement noise would set it.
CONTEXT_SPREAD = 0.05


class StepCosts:
    """`alpha`: how fast measurements replace each other, as an EMA's weight (0: keep the profile):
    a live shape costs the robust mean of its last 2 / alpha - 1 steady measurements, once it has
    `MIN_SAMPLES` of them (before, its profile and the residual, or what it is derived from).
    `default`: seconds a kind's unmeasured shape is assumed to cost per token (batch * width) when no
    shape of its width was measured at all; an engine replaces it within the first steps."""

    def __init__(
        self, alpha: float = 0.2, default: float = 1e-3, shape_of: dict[str, str] | None = None
    ) -> None:
        self.alpha, self.default = alpha, default
        self.window = max(1, round(2.0 / alpha - 1.0)) if alpha > 0 else 0
        self.min_samples = min(MIN_SAMPLES, self.window)
        self.shape_of = {DECODE: VERIFY} if shape_of is None else shape_of
        self._table: dict[tuple[str, int], dict[int, float]] = {}
        self._profiled: dict[tuple[str, int], dict[int, float]] = {}
        self._live: set[tuple[str, int, int]] = set()  # (kind, width, batch) measured steady while serving
        self._live_batches: dict[tuple[str, int], set[int]] = {}  # (kind, width) -> those batches
        # (seconds, value) of the last steady measurements, newest last: the value is the seconds, or
        # for a residual the seconds beyond the profile (an outlier is told by its seconds)
        self._samples: dict[tuple[str, int, int], deque[tuple[float, float]]] = {}
        self._loose: dict[
            tuple[str, int, int], deque[tuple[float, float]]
        ] = {}  # transitions' (unpriced shapes)
        self._gaps: dict[
            tuple[str, int], deque[tuple[float, float]]
        ] = {}  # (kind, batch) -> live minus profiled
        self._residual: dict[str, dict[int, float]] = {}  # kind -> batch -> robust mean of its gaps
        # device-loop steps' gaps over their profile and the contexts they were measured at (module
        # docstring): (kind, width, batch) -> the last (seconds, gap, context), and (kind, width) ->
        # batch -> what prices them (`_ContextGap`)
        self._loop_gaps: dict[tuple[str, int, int], deque[tuple[float, float, float]]] = {}
        self._loop_gap: dict[tuple[str, int], dict[int, _ContextGap]] = {}
        self._loop_steps: dict[tuple[str, int, int], int] = {}  # steady steps each was measured over
        # the mean context (tokens) of the requests of the step being priced; 1: unknown, and loop
        # gaps are then kept and priced as measured
        self.context = 1.0
        # kind -> the widths the engine runs in a device loop: priced by their profile and loop gaps
        # alone, never with the residual of synchronous steps, whose host work a loop step has not
        self.loop_widths: dict[str, frozenset[int]] = {}

    def observe(
        self,
        kind: str,
        batch: int,
        width: int,
        seconds: float,
        steady: bool = True,
        rows: bool = False,
        context: float = 1.0,
    ) -> None:
        """A live step of this shape took `seconds`. `steady`: a step like its neighbours (no
        transition's extra cost in it); one that is not only fills in a shape nothing else prices.
        `rows`: a step with no host work (a device loop's), whose gap over its profile is the
        attention over its requests' contexts, `context` tokens each on average (the module
        docstring)."""
        if batch < 1 or width < 1 or not seconds > 0 or self.alpha == 0:
            return  # an empty or untimed step says nothing about cost; alpha 0 keeps the profile
        key = (kind, width, batch)
        row = self._table.setdefault((kind, width), {})
        if not steady:
            if self._profiled.get((kind, width)) or key in self._live:
                return  # priced by its profile (plus steady steps' residual) or its steady steps
            loose = self._loose.setdefault(key, deque(maxlen=self.window))
            loose.append((seconds, seconds))
            row[batch] = robust_mean(loose)
            return
        samples = self._samples.setdefault(key, deque(maxlen=self.window))
        samples.append((seconds, seconds))
        if len(samples) >= self.min_samples:
            self._loose.pop(key, None)
            row[batch] = robust_mean(samples)
            self._live.add(key)
            self._live_batches.setdefault((kind, width), set()).add(batch)
        profiled = self._profiled.get((kind, width))
        if not profiled:
            return
        gap = seconds - _interpolate(profiled, batch)
        if rows:
            self._observe_loop_gap(kind, width, batch, (seconds, gap, max(context, 1.0)))
            return
        gaps = self._gaps.setdefault((kind, batch), deque(maxlen=self.window))
        gaps.append((seconds, gap))
        if len(gaps) >= self.min_samples:
            self._residual.setdefault(kind, {})[batch] = robust_mean(gaps)

    def _observe_loop_gap(
        self, kind: str, width: int, batch: int, sample: tuple[float, float, float]
    ) -> None:
        """A loop step's (seconds, gap, context): its width's price at this batch. A width's slope in
        context is read from its own steps where their contexts spread, else from those of the
        widths measured here that do (one measured at one context says nothing of it)."""
        gaps = self._loop_gaps.setdefault((kind, width, batch), deque(maxlen=self.window))
        gaps.append(sample)
        self._loop_steps[(kind, width, batch)] = self._loop_steps.get((kind, width, batch), 0) + 1
        if len(gaps) < self.min_samples:
            return
        measured = {
            w: _kept(self._loop_gaps[(k, w, b)])
            for (k, w, b) in self._loop_gaps
            if k == kind and b == batch and len(self._loop_gaps[(k, w, b)]) >= self.min_samples
        }
        own = {w: _context_slope([kept]) for w, kept in measured.items()}
        pooled = _context_slope([measured[w] for w, slope in own.items() if slope is not None])
        for w, kept in measured.items():
            slope = own[w] if own[w] is not None else pooled
            steps = self._loop_steps[(kind, w, batch)]
            self._loop_gap.setdefault((kind, w), {})[batch] = _ContextGap.of(kept, slope, steps)

    def samples(self, kind: str, batch: int, width: int) -> int:
        """How many steady measurements of this shape are kept (at most `window`; its price counts
        from `min_samples` on)."""
        return len(self._samples.get((kind, width, batch), ()))

    def profile(self, kind: str, shapes: Iterable[tuple[int, int]], run: Callable[[int, int], float]) -> None:
        """Measure each (batch, width) with `run` (seconds) and take it as is."""
        for batch, width in shapes:
            seconds = run(batch, width)
            if seconds > 0:
                self._table.setdefault((kind, width), {})[batch] = seconds
                self._profiled.setdefault((kind, width), {})[batch] = seconds
                self._live.discard((kind, width, batch))
                self._live_batches.get((kind, width), set()).discard(batch)
                self._samples.pop((kind, width, batch), None)
                self._loose.pop((kind, width, batch), None)

    def profiled(self, kind: str, batch: int, width: int) -> float | None:
        """What the start-up profile timed this shape at (interpolated in batch), the device pass
        alone; None where its width was not profiled. A price less this is what live steps added."""
        row = self._profiled.get((kind, width))
        return _interpolate(row, batch) if row else None

    def measured_live(self, kind: str, batch: int, width: int) -> bool:
        """Whether this very shape has a steady measurement from serving (not only profiled, derived or
        seen in transitions)."""
        return (kind, width, batch) in self._live

    def live_batches(self, kind: str, width: int) -> set[int]:
        """The batches at which this width has a steady measurement from serving."""
        return self._live_batches.get((kind, width), set())

    def measures(self, kind: str) -> bool:
        """Whether any shape of `kind` has a cost (profiled or measured)."""
        return any(k == kind and row for (k, _), row in self._table.items())

    def knows(self, kind: str) -> bool:
        """Whether `kind` has a cost of its own: measured, or the profile whose shape it borrows."""
        borrowed = self.shape_of.get(kind)
        return self.measures(kind) or any(k == borrowed and row for (k, _), row in self._profiled.items())

    def estimate(self, kind: str, batch: int, width: int) -> float:
        row = self._table.get((kind, width))
        if not row:
            shape = self._profiled.get((self.shape_of.get(kind, ""), width))
            if shape and not self.measures(kind):  # a live-only kind not yet run: the device pass
                return _interpolate(shape, batch)
            return self._unmeasured(kind, batch, width)
        looped = bool(self._loop_gap.get((kind, width)))  # priced at today's contexts, not its last steps'
        if (kind, width, batch) in self._live and not looped:
            return row[batch]
        profiled = self._profiled.get((kind, width))
        if profiled:  # the profile, and what live steps of this kind cost beyond their profile
            beyond = self.loop_gap(kind, batch, width)
            if not looped and width not in self.loop_widths.get(kind, ()):
                beyond += self.residual(kind, batch)
            return max(_interpolate(profiled, batch) + beyond, 1e-9)
        return self._borrow_shape(kind, width, row, batch)

    def residual(self, kind: str, batch: int) -> float:
        """Seconds live steps of `kind` took beyond their profile: linear in batch between the
        batches that measured one, past them along their least-squares slope (never falling there)."""
        residuals = self._residual.get(kind)
        if not residuals:
            return 0.0
        return _interpolate(residuals, batch, affine=True)

    def loop_gap(self, kind: str, batch: int, width: int) -> float:
        """Seconds a device-loop step of this shape takes beyond its profile over contexts of
        `self.context` tokens: each measured width's gap at those contexts at `batch` (linear in batch
        between the batches that measured it, past them `_grown_to`), their prices made
        non-decreasing in width (`_monotone_gaps`), and between widths linear; past the widest
        along their slope (never falling: one width alone, its gap), below the narrowest in
        proportion to the width (the module docstring)."""
        rows = {w: row for (k, w), row in self._loop_gap.items() if k == kind and row}
        if not rows:
            return 0.0
        spans = {w: (min(row), max(row)) for w, row in rows.items()}  # the batches each width measured
        gaps = {w: {b: gap.at(self.context) for b, gap in row.items()} for w, row in rows.items()}
        at = _floored(batch, _grown_to(batch, gaps, spans), spans)
        steps = {
            w: _clamped({b: float(gap.steps) for b, gap in row.items()}, batch) for w, row in rows.items()
        }
        at = self._monotone_gaps(kind, batch, at, steps)
        narrowest = min(at)
        if width < narrowest:  # the least a part per request and one per row could make it
            return at[narrowest] * width / narrowest
        return max(_interpolate(at, width, affine=True), 0.0)

    def _monotone_gaps(
        self, kind: str, batch: int, gaps: dict[int, float], steps: dict[int, float]
    ) -> dict[int, float]:
        """The measured widths' gaps with their prices (profile plus gap) made non-decreasing in
        width: adjacent widths priced out of order pooled into their mean weighted by the steps
        that measured them (`isotonic`). A step of more rows over the same requests never costs
        less, while a width's gap measured over few steps (a tier tried briefly, early in a batch)
        can be well off: at MT-Bench batch 64 on the H200 the policy priced the 1-chain at 1.99 ms
        and the 2-chain at 1.82 beside the 4-chain's 1.26, the chain that ran 113 of the row's 127
        engine steps (docs/benchmarks.md, twenty-sixth session). The well-measured width then
        prices the others."""
        profiled = self._profiled.get
        widths = sorted(w for w in gaps if profiled((kind, w)))
        prices = [_interpolate(profiled((kind, w)), batch) + gaps[w] for w in widths]
        fitted = isotonic(prices, [steps[w] for w in widths])
        out = dict(gaps)
        for w, price, fit in zip(widths, prices, fitted, strict=True):
            out[w] = gaps[w] + fit - price
        return out

    def _borrow_shape(self, kind: str, width: int, row: dict[int, float], batch: int) -> float:
        """A live-only shape: between measured batches linear; outside them the nearest measured cost
        plus the difference `shape_of[kind]`'s profile (width 1) makes, else the affine extrapolation."""
        sizes = sorted(row)
        shape = self._profiled.get((self.shape_of.get(kind, ""), 1))
        if sizes[0] <= batch <= sizes[-1] or not shape:
            return _interpolate(row, batch, affine=True)
        nearest = sizes[0] if batch < sizes[0] else sizes[-1]
        return max(row[nearest] + _interpolate(shape, batch) - _interpolate(shape, nearest), 1e-9)

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


def robust_mean(samples: Iterable[tuple[float, float]]) -> float:
    """The mean value of the (seconds, value) samples whose seconds are within `OUTLIER` times their
    median: a step that paid for something else (a prefill, a one-off cost: several times a step)
    drops out, while the spread of a tier's own steps stays in (a chain step whose lookups found
    short drafts runs a narrower bucket, ~0.7x a full one: their median alone priced the tier at
    its dearer steps, their mean is what it costs)."""
    kept = [value for _, value in _kept(samples)]
    return sum(kept) / len(kept)


def _kept(samples: Iterable[tuple]) -> list[tuple]:
    """The samples (seconds first) within `OUTLIER` times their median seconds."""
    samples = list(samples)
    cut = OUTLIER * statistics.median(sample[0] for sample in samples)
    return [sample for sample in samples if sample[0] <= cut]


def isotonic(values: list[float], weights: list[float]) -> list[float]:
    """The non-decreasing sequence nearest `values` in weighted least squares (pool adjacent
    violators: a run of values out of order becomes their weighted mean)."""
    blocks: list[list[float]] = []  # [weighted sum, weight, count]
    for value, weight in zip(values, weights, strict=True):
        weight = max(weight, 1e-9)
        blocks.append([value * weight, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, mass, count = blocks.pop()
            blocks[-1] = [blocks[-1][0] + total, blocks[-1][1] + mass, blocks[-1][2] + count]
    return [total / mass for total, mass, count in blocks for _ in range(count)]


class _ContextGap(NamedTuple):
    """A loop width's gap at one batch: its mean over the kept steps, the mean context they were
    measured at, how much it grows per context token (module docstring), and how many steady steps
    measured it (its weight beside other widths, `StepCosts._monotone_gaps`)."""

    gap: float
    context: float
    slope: float
    steps: int = 1

    @classmethod
    def of(cls, kept: list[tuple[float, float, float]], slope: float | None, steps: int = 1) -> _ContextGap:
        gap = sum(g for _, g, _ in kept) / len(kept)
        context = sum(c for _, _, c in kept) / len(kept)
        proportional = max(gap, 0.0) / context  # all of it per context token: the most it could grow
        slope = proportional if slope is None else min(max(slope, 0.0), proportional)
        return cls(gap, context, slope, steps)

    def at(self, context: float) -> float:
        return self.gap + self.slope * (context - self.context)


def _context_slope(groups: list[list[tuple[float, float, float]]]) -> float | None:
    """The least-squares slope of the gap in context, each group (a width's kept steps) about its own
    means; None where their contexts spread too little (`CONTEXT_SPREAD`) to tell it from noise."""
    n, cov, var, level = 0, 0.0, 0.0, 0.0
    for kept in groups:
        mean_c = sum(c for _, _, c in kept) / len(kept)
        mean_g = sum(g for _, g, _ in kept) / len(kept)
        cov += sum((c - mean_c) * (g - mean_g) for _, g, c in kept)
        var += sum((c - mean_c) ** 2 for _, _, c in kept)
        level += mean_c * len(kept)
        n += len(kept)
    if n == 0 or var <= n * (CONTEXT_SPREAD * level / n) ** 2:
        return None
    return cov / var


def _slope(row: dict[int, float], sizes: list[int]) -> float:
    """The least-squares slope of `row` in batch (never below 0). Not the last segment's: a bench
    row's tail measures every batch below its own, so the last segment joins two neighbours (15 and
    16) whose noise, carried 48 requests on, can price a batch-64 step many times over (the likeliest
    cause of the H100 mixed run's 50 ms for a ~5 ms batch-64 verify, never run there to correct it)."""
    if len(sizes) < 2:
        return 0.0
    mean_b = sum(sizes) / len(sizes)
    mean_v = sum(row[b] for b in sizes) / len(sizes)
    spread = sum((b - mean_b) ** 2 for b in sizes)
    return max(sum((b - mean_b) * (row[b] - mean_v) for b in sizes) / spread, 0.0)


def _grown_to(
    batch: int, gaps: dict[int, dict[int, float]], spans: dict[int, tuple[int, int]]
) -> dict[int, float]:
    """Each width's gap at `batch` from its row (batch -> gap): linear between the batches that
    measured it; past them the nearest one's, plus what the gaps of the widths measured at both that
    batch and this one grew between them (their mean), else the nearest one's as it is. A loop gap
    is mostly attention over the requests' contexts, read once a request whatever its rows, so it
    grows with the batch alike for every width; kept flat, plain decoding's batch-16 gap priced it at
    batch 64 beside chains measured there, and the policy went off (the module docstring). `spans`:
    each width's least and greatest measured batch."""
    out = {}
    for width, row in gaps.items():
        lo, hi = spans[width]
        nearest = min(max(batch, lo), hi)
        out[width] = _interpolate(row, nearest)
        growth = [
            _interpolate(gaps[w], batch) - _interpolate(gaps[w], nearest)
            for w, (a, b) in spans.items()
            if nearest != batch and a <= min(nearest, batch) and max(nearest, batch) <= b
        ]
        if growth:
            out[width] += sum(growth) / len(growth)
    return out


def _floored(batch: int, gaps: dict[int, float], spans: dict[int, tuple[int, int]]) -> dict[int, float]:
    """Each width's gap at `batch`; plain decoding's (width 1) where it was measured only at other
    batches raised to at least the gap of the narrowest width measured around this one. Its loop reads
    each request's KV as a chain's does, and that attention is most of a gap: on the H200 (thirty-first
    session, MT-Bench, batch 64, `scripts/trace_steps.py`) a plain loop iteration took 1.30-1.45 ms
    and the 2-chain's 1.28-1.72 over the same contexts, their replays 0.91 and 0.99 ms; the attention
    took 13.5-17 us a layer in both, 3.5 in the replays. Grown from batch 16, plain decoding's gap at
    64 stayed under the chains' measured there, and the policy went off for a batch of 64 (thirtieth
    session). Only plain decoding's: where the rows add to the gap (the H100's 8-chain: 1.65x the
    2-chain's), a wider width's gap would price a narrower one too dear, and a tier priced too dear is
    never run."""
    here = sorted(w for w, (lo, hi) in spans.items() if lo <= batch <= hi)
    if 1 not in gaps or not here or here[0] == 1:
        return gaps
    return {**gaps, 1: max(gaps[1], gaps[here[0]])}


def _clamped(row: dict[int, float], batch: int) -> float:
    """Linear between measured batches; outside them the nearest one's value."""
    sizes = sorted(row)
    return _interpolate(row, min(max(batch, sizes[0]), sizes[-1]))


def _interpolate(row: dict[int, float], batch: int, affine: bool = False) -> float:
    """Linear between measured batches; below the smallest its value (a smaller batch is bound by
    launches as the smallest measured one is); past the largest in proportion to the batch (a
    profile's passes: by then compute-bound), or with `affine` from the largest on along the
    measured batches' least-squares slope, never falling (host work and live steps: a fixed part
    and a part per request)."""
    if batch in row:
        return row[batch]
    sizes = sorted(row)
    i = bisect.bisect_left(sizes, batch)
    if i == 0:
        return row[sizes[0]]
    if i == len(sizes):
        last = row[sizes[-1]]
        if not affine:
            return last * batch / sizes[-1]
        return last + _slope(row, sizes) * (batch - sizes[-1])
    lo, hi = sizes[i - 1], sizes[i]
    return row[lo] + (row[hi] - row[lo]) * (batch - lo) / (hi - lo)
