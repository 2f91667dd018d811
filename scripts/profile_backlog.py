"""The host time of a head's plain step bookkeeping (`HeadDrafter.skip_target`: each request keeps its
target features for the head's next extend), at several batch sizes: the engine's form against the
per-request form it replaced (a copy of each request's rows, a gather, a concatenation with its
backlog). A forward's worth of device work is queued before each call, as in an engine step, so a
copy that waits for the device shows. On the GPU machine (or the CPU, where no copy waits):

    PYTHONPATH=... python3 -P scripts/profile_backlog.py [--batches 1,16,64] [--steps 31]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from specserve.spec.drafter import TargetFeed
from specserve.spec.head_drafter import Backlog, HeadDrafter


def per_request(feeds: list[TargetFeed], features: torch.Tensor) -> None:
    """skip_target as it was before the nineteenth session (within MAX_BACKLOG)."""
    for f in feeds:
        old = f.request.draft_backlog
        kept = features.index_select(0, torch.as_tensor(list(f.rows), device=features.device))
        if old is not None and old.end == f.start:
            whole = torch.cat([*old.features(), kept])
            f.request.draft_backlog = Backlog(old.start, old.tokens + f.tokens, [(whole, 0, whole.shape[0])])
        else:
            f.request.draft_backlog = Backlog(f.start, list(f.tokens), [(kept, 0, kept.shape[0])])


def batched(feeds: list[TargetFeed], features: torch.Tensor) -> None:
    HeadDrafter.skip_target(SimpleNamespace(after_target=None), feeds, features)


def median_us(form, batch: int, steps: int, device: torch.device, width: int) -> float:
    features = torch.randn(batch, width, device=device, dtype=torch.bfloat16)
    work = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16) if device.type == "cuda" else None
    reqs = [SimpleNamespace(draft_backlog=None) for _ in range(batch)]
    times = []
    for step in range(steps):
        feeds = [TargetFeed(r, 100 + step, [7], [i], False) for i, r in enumerate(reqs)]
        if work is not None:
            for _ in range(3):
                work @ work  # queued device work, as a forward's
        start = time.perf_counter()
        form(feeds, features)
        times.append(time.perf_counter() - start)
        if work is not None:
            torch.cuda.synchronize()
    kept = sorted(times[1:])  # the first call warms the allocator
    return kept[len(kept) // 2] * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=31, help="plain steps in a row (at most MAX_BACKLOG)")
    parser.add_argument("--width", type=int, default=1728, help="feature width (SmolLM2's EAGLE-3: 3 x 576)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for batch in (int(b) for b in args.batches.split(",")):
        old, new = (median_us(f, batch, args.steps, device, args.width) for f in (per_request, batched))
        print(
            f"batch {batch}: per request {old:.0f} us, batched {new:.0f} us (host, median of {args.steps - 1})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
