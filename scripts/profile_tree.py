"""The host cost of one draft-tree round (EAGLE-2 search, forest feeds, final trees) on the CPU.

No model: each search step gets random draft logits [rows, vocab] (made before the clock starts),
the way a drafter's forward would hand them over. A round is what a model drafter does per engine
step: `TreeSearch`, the roots' expansion, then per step the frontier, its forest feed (`tree_feed`)
and the drafter's forest input (`build_forest_input`: slots, positions, tree mask), the expansion,
and at the end `trees()`. Requests have 600 context tokens on shuffled pages of 16.

Each configuration (batch x depth/topk/nodes x greedy|sampling) runs `--rounds` rounds. Every torch
operator (log-softmax, top-k, the sampling noise over the whole vocabulary: what the GPU does while
the host works; operators written as `a / b` included) is timed on its own through a
`TorchFunctionMode` and left out, and so is what that timer itself adds per operator (measured on a
trivial operator first): "host ms" is the rest of a round, the Python and numpy work, next to the
torch time (with each operator's dispatch, a kernel launch on a GPU), the operator count and the
plain wall time. With the full vocabulary on the CPU, freeing the [rows, vocab] temporaries
(log-softmax, q, the noise: about 6 ms per 100 MB here; a GPU's caching allocator frees them for
nothing) lands outside the operators and inflates "host ms"; `--vocab 256` keeps them small. `--top N` also prints cProfile's top N entries by own time.

    python -P scripts/profile_tree.py [--batches 16,64] [--shapes 5x8x32,6x8x64] [--rounds 10]
        [--vocab 49152] [--top 0]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from specserve.engine import step_input
from specserve.engine.request import Request
from specserve.spec import tree
from specserve.types import SamplingParams

PAGE_SIZE = 16
CONTEXT = 600


def make_requests(batch: int, greedy: bool, rng: np.random.Generator) -> list[Request]:
    params = SamplingParams(temperature=0.0 if greedy else 0.8)
    reqs = []
    pages = rng.permutation(batch * 64).tolist()
    for i in range(batch):
        req = Request(f"r{i}", rng.integers(0, 1000, CONTEXT).tolist(), params, seed=i)
        req.token_ids.extend([1, 2, 3])
        req.pages = [pages.pop() for _ in range(-(-(CONTEXT + 3 + 128) // PAGE_SIZE))]
        req.spec_verify_ct = 2
        reqs.append(req)
    return reqs


def forest_input(search: tree.TreeSearch, where: tree.Expansion) -> step_input.DraftInput:
    """The drafter's input over the paths to the expanded nodes (what `StandaloneDrafter` builds)."""
    fed = tree.tree_feed(search, where)
    if hasattr(step_input, "build_forest_input"):
        reqs = [search.reqs[b] for b in fed.requests.tolist()]
        starts = [len(r.token_ids) for r in reqs]
        tokens = search.token[fed.request, fed.node]
        return step_input.build_forest_input(
            reqs, starts, tokens, fed.lens, fed.forest, fed.rows, PAGE_SIZE, torch.device("cpu")
        )
    # The per-node code before the search became array code (commit 12916bb), for before/after figures.
    feeds = [
        (search.reqs[b], len(search.reqs[b].token_ids), [search.nodes[b][n].token for n in nodes])
        for b, nodes in zip(fed.requests, fed.nodes, strict=True)
    ]
    return step_input.build_draft_input(feeds, PAGE_SIZE, torch.device("cpu"), fed.forest, fed.rows)


def one_round(reqs: list[Request], depth: int, topk: int, nodes: int, vocab: int, logits: torch.Tensor):
    search = tree.TreeSearch(reqs, [depth] * len(reqs), topk, nodes, vocab)
    search.expand(search.roots(), logits[: len(reqs)])
    step = 1
    while len(where := search.frontier(step)):
        forest_input(search, where)
        search.expand(where, logits[: len(where)])
        step += 1
    return search.trees()


class OpTimer(TorchFunctionMode):
    """Times every torch operator called from Python (nested calls run outside the mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds, self.calls = 0.0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out


def timer_overhead(calls: int = 5000) -> float:
    """Seconds `OpTimer` adds to one operator call beyond the call itself (its Python wrapper)."""
    x = torch.zeros(1)

    def run() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            x.add(1)
        return time.perf_counter() - start

    plain = min(run() for _ in range(3))
    with OpTimer():
        timed = min(run() for _ in range(3))
    return max(timed - plain, 0.0) / calls


def profile(args, batch: int, shape: tuple[int, int, int], greedy: bool, overhead: float) -> None:
    depth, topk, nodes = shape
    rng = np.random.default_rng(0)
    reqs = make_requests(batch, greedy, rng)
    logits = torch.randn(batch * topk, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    trees = one_round(reqs, depth, topk, nodes, args.vocab, logits)  # warm-up

    def rounds(ops: OpTimer | None = None) -> tuple[float, float]:
        """Median seconds per round, and of them outside torch operators."""
        times, host = [], []
        for _ in range(args.rounds):
            before = ops.seconds if ops else 0.0
            start = time.perf_counter()
            one_round(reqs, depth, topk, nodes, args.vocab, logits)
            times.append(time.perf_counter() - start)
            host.append(times[-1] - (ops.seconds - before if ops else 0.0))
        return float(np.median(times)), float(np.median(host))

    wall, _ = rounds()
    with OpTimer() as ops:
        timed, host = rounds(ops)
    torch_calls = ops.calls / args.rounds
    host -= torch_calls * overhead
    kind = "greedy" if greedy else "sampling"
    size = sum(t.num_nodes for t in trees if t is not None) / batch
    print(
        f"batch {batch:3d} {depth}x{topk}x{nodes:<3d} {kind:8s} | host ms {1e3 * host:7.2f} | "
        f"torch ms {1e3 * (timed - host):7.1f} ({torch_calls:4.0f} ops) | wall ms {1e3 * wall:7.1f} | "
        f"nodes/tree {size:.1f}",
        flush=True,
    )
    if args.top:
        prof = cProfile.Profile()
        prof.enable()
        rounds()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--shapes", default="5x8x32,6x8x64", help="depth x topk x nodes, comma-separated")
    parser.add_argument("--kinds", default="greedy,sampling")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--top", type=int, default=0, help="print cProfile's top N entries per configuration")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: no spinning workers)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    overhead = timer_overhead()
    print(
        f"ms per draft round (vocab {args.vocab}, median of {args.rounds} rounds; host: torch operators "
        f"left out, and the timer's {1e6 * overhead:.1f} us per operator)"
    )
    for batch in [int(b) for b in args.batches.split(",")]:
        for text in args.shapes.split(","):
            shape = tuple(int(x) for x in text.split("x"))
            for kind in args.kinds.split(","):
                profile(args, batch, shape, kind == "greedy", overhead)


if __name__ == "__main__":
    main()
