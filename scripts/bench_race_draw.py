"""On the lent GPU machine: sampling's race draw, the torch statement against the one-pass kernel
(`kernels/race_draw.py`), at SmolLM2's vocabulary and the row counts a batch's plain steps and
verifies draw (µs per call in CUDA graphs of 20 calls; with and without a dropped token).

    python -P scripts/bench_race_draw.py [--rows 1,16,64,256] [--vocab 49152]
"""

from __future__ import annotations

import argparse

import torch

from specserve_kernels.race_draw import race_draw, race_draw_ref

CALLS = 20


def _time(fn) -> float:
    """µs per call: CALLS calls captured in one graph, replayed."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (10 * CALLS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args()
    print(f"{'rows':>5} {'drop':>5} {'torch us':>9} {'kernel us':>10} {'same':>5}")
    for rows in (int(r) for r in args.rows.split(",")):
        g = torch.Generator(device="cuda").manual_seed(rows)
        probs = torch.softmax(torch.randn(rows, args.vocab, device="cuda", generator=g) * 3, dim=-1)
        keys = torch.randint(0, 2**32, (rows,), device="cuda", generator=g)
        for drop in (None, probs.argmax(dim=-1)):
            call = (probs, keys, drop)
            same = torch.equal(race_draw(*call), race_draw_ref(*call))
            ref = _time(lambda call=call: race_draw_ref(*call))
            fused = _time(lambda call=call: race_draw(*call))
            print(f"{rows:>5} {drop is not None!s:>5} {ref:>9.1f} {fused:>10.1f} {same!s:>5}")


if __name__ == "__main__":
    main()
