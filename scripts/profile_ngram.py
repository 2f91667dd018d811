"""The host cost of n-gram drafting per request and step, on the CPU: the drafter against the
windowed search it replaced (`tests/ngram_reference.py`: the whole token list converted and every
window compared for each match length, each call).

Per (sequence length, batch, workload): `batch` requests of `length` tokens; each step appends one
token to every request (the steady state of decoding) and times one `draft` (chain) or `draft_tree`
(tree) call over the batch; the figure is the median over `--steps` steps, divided by the batch (µs
per request). "before" calls the reference's `propose` / `propose_tree` on each request's list, the
way the drafter did; "after" the drafter's `draft` / `draft_tree` on the requests (their token
mirrors caught up first, so the first step's full conversion is in the warm-up). Workloads: `text`:
Zipf-distributed ids over a 32k vocabulary with copied stretches (what prompt lookup is for);
`repeat`: a 61-token cycle, every position a match of every length (the most candidates).

    python -P scripts/profile_ngram.py [--lengths 200,600,2000] [--batches 1,16,64]
        [--chain 4] [--tree 6x8x64] [--match 1,4] [--steps 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ngram_reference import RefNgramDrafter  # noqa: E402

from specserve.engine.request import Request  # noqa: E402
from specserve.spec.ngram import NgramDrafter  # noqa: E402
from specserve.types import SamplingParams  # noqa: E402

VOCAB = 32000


def _tokens(kind: str, length: int, rng: np.random.Generator) -> list[int]:
    if kind == "repeat":
        return [(7 * i) % 61 for i in range(length)]
    out: list[int] = []
    while len(out) < length:
        if out and rng.random() < 0.3:  # copy an earlier stretch: a quote, a repeated name
            i = int(rng.integers(len(out)))
            out += out[i : i + int(rng.integers(4, 24))]
        else:
            out += (np.minimum(rng.zipf(1.3, 16), VOCAB) - 1).tolist()
    return out[:length]


def _time(kind: str, length: int, batch: int, steps: int, run, rng: np.random.Generator) -> float:
    """Median µs per request of `run(reqs)` over `steps` steps, one token appended before each."""
    reqs = [Request(f"r{i}", _tokens(kind, length, rng), SamplingParams(), seed=0) for i in range(batch)]
    feed = [_tokens(kind, length + steps + 1, rng)[length:] for _ in range(batch)]
    run(reqs)  # warm-up (and the mirrors' first fill)
    times = []
    for step in range(steps):
        for req, more in zip(reqs, feed, strict=True):
            req.token_ids.append(more[step])
        start = time.perf_counter()
        run(reqs)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / batch * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="200,600,2000")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--chain", type=int, default=4, help="chain draft tokens")
    ap.add_argument("--tree", default="6x8x64", help="tree DEPTHxTOPKxNODES")
    ap.add_argument("--match", default="1,4", help="MIN,MAX match length")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--workloads", default="text,repeat")
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.match.split(","))
    depth, topk, nodes = (int(x) for x in args.tree.split("x"))
    new, ref = NgramDrafter(lo, hi), RefNgramDrafter(lo, hi)
    k = args.chain

    def chain_before(reqs):
        for r in reqs:
            r.draft = ref.propose(r.token_ids, k)

    def tree_before(reqs):
        for r in reqs:
            r.draft_tree = ref.propose_tree(r.token_ids, depth, topk, nodes)

    runs = {
        f"chain {k}": (chain_before, lambda reqs: new.draft(reqs, [k] * len(reqs))),
        f"tree {args.tree}": (
            tree_before,
            lambda reqs: new.draft_tree(reqs, [depth] * len(reqs), topk, nodes),
        ),
    }
    print(f"match {lo}..{hi}; µs per request per step (median of {args.steps} steps)")
    print(f"{'workload':8} {'draft':12} {'length':>6} {'batch':>5} {'before':>9} {'after':>8} {'x':>6}")
    for kind in args.workloads.split(","):
        for name, (before, after) in runs.items():
            for length in (int(x) for x in args.lengths.split(",")):
                for batch in (int(x) for x in args.batches.split(",")):
                    rng = np.random.default_rng(length * 100 + batch)
                    b = _time(kind, length, batch, args.steps, before, rng)
                    rng = np.random.default_rng(length * 100 + batch)
                    a = _time(kind, length, batch, args.steps, after, rng)
                    print(
                        f"{kind:8} {name:12} {length:6} {batch:5} {b:9.1f} {a:8.1f} {b / a:6.1f}", flush=True
                    )


if __name__ == "__main__":
    main()
