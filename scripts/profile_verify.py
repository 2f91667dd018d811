"""The GPU floor of decode and verify steps: CUDA-graph replay time per (batch, query len) bucket.

A verify of k+1 tokens pays only if it costs about what one decode step costs. This captures the
engine's graphs for n-gram chains of each `VERIFY_STEPS` length (query lens k+1) at batches
`VERIFY_BATCHES` and times back-to-back replays of each bucket (inputs as captured: every request's
tokens over the dummy page, so attention reads a short context; the matmuls are what differ).
Which matmul path a bucket takes follows the environment (SPECSERVE_FUSED_LINEAR_TOKENS,
SPECSERVE_GEMV_ROWS, SPECSERVE_GEMV_SIZES), so runs under different settings compare paths.

    VERIFY_STEPS=5,8,15 VERIFY_BATCHES=1,2,4 python3 -P scripts/profile_verify.py

VERIFY_KERNELS=1 also prints, for batch 1, the kernels of a decode replay and of each verify
replay (torch.profiler over 20 replays: GPU us a replay by kernel), to see what a verify adds.
"""

import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specserve import LLM
from specserve.model.loader import load_model

STEPS = [int(s) for s in os.environ.get("VERIFY_STEPS", "5,8,15").split(",")]
BATCHES = [int(b) for b in os.environ.get("VERIFY_BATCHES", "1,2,4").split(",")]
REPLAYS = 200


def replay_us(graph: torch.cuda.CUDAGraph) -> float:
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(REPLAYS):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / REPLAYS * 1e6


def kernel_table(graph: torch.cuda.CUDAGraph, title: str, top: int = 12) -> None:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
    rows = sorted(
        ((e.key, e.self_device_time_total / 20, e.count // 20) for e in prof.key_averages()),
        key=lambda r: -r[1],
    )
    total = sum(us for _, us, _ in rows)
    launches = sum(count for *_, count in rows)
    print(f"{title}: {total:.1f} us of kernels a replay, {launches} launches")
    for name, us, count in rows[:top]:
        print(f"  {us:8.1f} us {count:4d}x  {name[:90]}")


def main() -> None:
    loaded = load_model("smollm2-135m-instruct", torch.device("cuda"), torch.bfloat16)
    settings = {
        k: os.environ.get(k, "-")
        for k in ("SPECSERVE_FUSED_LINEAR_TOKENS", "SPECSERVE_GEMV_ROWS", "SPECSERVE_GEMV_SIZES")
    }
    print(f"{torch.cuda.get_device_name()}; {settings}")
    measured: dict[tuple[int, int], float] = {}
    for steps in STEPS:
        llm = LLM(
            loaded,
            speculative={"method": "ngram", "num_steps": steps},
            cuda_graph_max_batch=max(BATCHES),
            max_total_tokens=16 * 1024,
        )
        graphs = llm.engine.runner.graphs.graphs
        for batch in BATCHES:
            for q in (1, steps + 1):
                bucket = (batch, q)
                if bucket in graphs and bucket not in measured:
                    measured[bucket] = replay_us(graphs[bucket].graph)
                    if os.environ.get("VERIFY_KERNELS") and batch == 1:
                        kernel_table(graphs[bucket].graph, f"batch 1, query len {q}")
        del llm
        torch.cuda.empty_cache()
    print(f"{'batch':>6}{'query len':>10}{'tokens':>8}{'replay us':>11}{'x decode':>10}")
    for (batch, q), us in sorted(measured.items()):
        decode = measured.get((batch, 1), float("nan"))
        print(f"{batch:>6}{q:>10}{batch * q:>8}{us:>11.1f}{us / decode:>10.2f}")


if __name__ == "__main__":
    main()
