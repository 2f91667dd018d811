"""Start-up profiling of step costs for adaptive speculation: dummy target passes and draft steps.

Dummy requests hold nothing but the dummy page (page 0, the padding target), so profiling writes no
real KV and takes nothing from the pool. A target pass of `batch` requests of `query_len` tokens
goes through the same input builder and runner as a real verify (a CUDA-graph bucket replay where one
fits, so every tier's bucket is timed); a draft step through the drafter's own `draft` or
`draft_tree` (after a head's extend over one position), its time divided by the tier's steps as the
engine charges a live step's draft phase (not an n-gram lookup's, whose cost does not grow with
depth). Host wall time around a device sync, the median of a few runs after a warm-up: on the CPU one run of two batch sizes, enough for the policy to start from.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from specserve.engine.request import Request
from specserve.engine.scheduler import ScheduledItem
from specserve.spec.adaptive import Tier
from specserve.spec.drafter import TargetFeed
from specserve.spec.step_costs import DRAFT, VERIFY
from specserve.types import SamplingParams

if TYPE_CHECKING:
    from specserve.engine.adaptive_control import AdaptiveSpeculation
    from specserve.engine.device_loop import DeviceLoop
    from specserve.engine.engine import Engine

LOOP_PROFILE_STEPS = 8  # device-loop steps timed back to back, as a run queues them
LOOP_DRAFT_SECONDS = 1e-6  # a loop tier's draft step: on the device, inside its step's time
NGRAM_TOKENS = 512  # the sequence an n-gram lookup scans while profiled (a prompt plus an answer)
CPU_BATCH = 8
_PARAMS = SamplingParams(max_new_tokens=1, temperature=0.0)


def profile_step_costs(engine: Engine, adaptive: AdaptiveSpeculation) -> None:
    """Fill `adaptive.costs` for every tier's target pass and draft step at the profiled batch sizes.
    Not for a hybrid model: a dummy pass would need recurrent-state slots of its own; its costs are
    learnt from its first steps instead (as with `profile: false`)."""
    if engine.states is not None:
        return
    cuda = engine.device.type == "cuda"
    repeats = 5 if cuda else 1
    batches = profile_batches(engine)
    lens = sorted({t.query_len for t in adaptive.tiers})
    shapes = [(b, q) for b in batches for q in lens]
    adaptive.costs.profile(VERIFY, shapes, lambda b, q: time_pass(engine, b, q, repeats))
    deepest: dict[int, Tier] = {}
    for tier in adaptive.tiers:
        if not tier.off and tier.num_steps >= deepest.get(tier.topk, tier).num_steps:
            deepest[tier.topk] = tier
    if engine.device_loops:  # the loop drafts on the device, in its step: no host lookup to price
        deepest.pop(1, None)
        adaptive.costs.profile(DRAFT, [(b, 1) for b in batches], lambda b, _: LOOP_DRAFT_SECONDS)
    for topk, tier in deepest.items():
        adaptive.costs.profile(
            DRAFT, [(b, topk) for b in batches], lambda b, _, t=tier: time_draft(engine, b, t, repeats)
        )


def profile_batches(engine: Engine) -> list[int]:
    """Every CUDA-graph batch bucket; else powers of two on CUDA, and two sizes on the CPU."""
    most = engine.config.scheduler.max_running_requests
    buckets = engine.runner.graph_buckets
    if buckets is not None and engine.device.type == "cuda":
        return list(buckets.batch_sizes)
    if engine.device.type == "cuda":
        return sorted({min(1 << i, most) for i in range(most.bit_length() + 1)})
    return sorted({1, min(CPU_BATCH, most)})


def time_pass(engine: Engine, batch: int, query_len: int, repeats: int) -> float:
    """A verify's cost as the engine will run it: a device-loop step where a loop runs chains of
    that length (the loop's captured iteration, no host between steps), else a synchronous pass."""
    loop = engine.device_loops.get(query_len - 1)
    if loop is not None and batch <= loop.max_batch:
        return time_loop_step(loop, batch, repeats)
    return time_target(engine, batch, query_len, repeats)


def time_loop_step(loop: DeviceLoop, batch: int, repeats: int) -> float:
    """Seconds of one device-loop step over `batch` rows (the bucket's; inactive rows, the same
    kernels), from back-to-back steps as a run queues them."""
    bucket = next(b for b in loop.batch_sizes if b >= batch)
    loop.reset_rows(bucket)
    graph = loop.loop_graphs.get(bucket)

    def run() -> None:
        for _ in range(LOOP_PROFILE_STEPS):
            if graph is not None:
                graph.replay()
            else:
                loop.step_once(bucket)

    return median_seconds(run, repeats, loop.hist.device) / LOOP_PROFILE_STEPS


def time_target(engine: Engine, batch: int, query_len: int, repeats: int) -> float:
    """Seconds of one target pass over `batch` dummy requests of `query_len` tokens (logits on every row)."""
    reqs = dummy_requests(batch, 1, query_len, engine.kv.page_size)
    items = [ScheduledItem(r, 0, query_len, True, (0,) * (query_len - 1)) for r in reqs]
    capture = _capture(engine)

    def run() -> None:
        engine.runner.execute(engine.build_input(items), capture)

    return median_seconds(run, repeats, engine.device)


def time_draft(engine: Engine, batch: int, tier: Tier, repeats: int) -> float:
    """Seconds per draft step of `tier` over `batch` dummy requests: one whole draft (a head's extend
    included) over its steps."""
    drafter = engine.drafter
    model = drafter.needs_pages or drafter.capture is not None
    slots = (
        drafter.tree_slots(tier.num_steps, tier.topk, tier.num_draft_tokens)
        if tier.topk > 1
        else tier.num_steps
    )
    reqs = dummy_requests(batch, 2 if model else NGRAM_TOKENS, slots + 1, engine.kv.page_size)
    features = _features(engine, batch) if drafter.capture is not None else None

    def run() -> None:
        for req in reqs:
            req.draft, req.draft_probs, req.draft_tree = [], None, None
            req.draft_computed, req.draft_state, req.num_computed = 0, None, len(req.token_ids) - 1
        if features is not None:
            feeds = [TargetFeed(r, 0, [0], [i], True) for i, r in enumerate(reqs)]
            drafter.after_target(feeds, features)
        if tier.topk > 1:
            drafter.draft_tree(reqs, [tier.num_steps] * batch, tier.topk, tier.num_draft_tokens)
        else:
            drafter.draft(reqs, [tier.num_steps] * batch)

    per = tier.num_steps if adaptive_draft_per_step(engine) else 1  # an n-gram lookup: once a draft
    return median_seconds(run, repeats, engine.device) / per


def adaptive_draft_per_step(engine: Engine) -> bool:
    return engine.adaptive is None or engine.adaptive.policy.draft_per_step


def dummy_requests(count: int, tokens: int, slots: int, page_size: int) -> list[Request]:
    """Requests of `tokens` tokens (a repeating pattern, so lookups find matches) whose pages, enough
    for `slots` more, are all the dummy page."""
    pattern = [(7 * i) % 61 for i in range(tokens)]
    reqs = []
    for i in range(count):
        req = Request(f"profile-{i}", pattern, _PARAMS, seed=0)
        req.pages = [0] * -(-(tokens + slots) // page_size)
        reqs.append(req)
    return reqs


def median_seconds(run: Callable[[], None], repeats: int, device: torch.device) -> float:
    run()  # warm-up: kernels compiled, buffers allocated
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _features(engine: Engine, batch: int) -> torch.Tensor:
    """The captured target features of a one-token dummy pass (what a head's extend reads)."""
    reqs = dummy_requests(batch, 1, 1, engine.kv.page_size)
    items = [ScheduledItem(r, 0, 1, True) for r in reqs]
    hidden, aux, _ = engine.runner.execute(engine.build_input(items), _capture(engine))
    return (hidden if aux is None else aux)[:batch].clone()


def _capture(engine: Engine) -> tuple[int, ...]:
    capture = engine.drafter.capture if engine.drafter is not None else None
    return capture or ()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
