"""Where a decode step's time goes on the GPU: per-step time at batch 1 and 64 with CUDA graphs off and
on, the host phases of a step (engine StepStats), the pure replay time of a graph bucket (the GPU
floor), and a torch.profiler table of a few batch-1 steps.

Environment: PROFILE_CONFIGS (default "00,10,11": CUDA graphs then overlap scheduling, each 0/1),
PROFILE_TOKENS (new tokens, default 256), PROFILE_CPROFILE=1 (each timed run again under cProfile),
PROFILE_BATCHES (default "1,64"), PROFILE_TABLE=0 (no torch.profiler table).
"""

import cProfile
import json
import os
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specserve import LLM, SamplingParams
from specserve.assets import dataset_path
from specserve.engine.stats import PhaseTotals
from specserve.model.loader import load_model

TOKENS = int(os.environ.get("PROFILE_TOKENS", "256"))
BATCHES = [int(b) for b in os.environ.get("PROFILE_BATCHES", "1,64").split(",")]


def timed(llm: LLM, prompts: list[list[int]]) -> tuple[float, dict[str, float]]:
    """Seconds for TOKENS new tokens per prompt, and host ms per step by phase with the spread of
    whole steps (p50 / p90 / max: one slow outlier, a compile say, against every step slow)."""
    sink = PhaseTotals()
    llm.engine.attach_stats_sink(sink)
    llm.engine.flush_cache()
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_new_tokens=TOKENS, temperature=0.0, ignore_eos=True))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    llm.engine.stats_sink = None
    return seconds, {**sink.ms_per_step(), **{f"step_{k}": v for k, v in sink.step_spread().items()}}


def replay_us(llm: LLM, bucket: tuple[int, int], n: int = 200) -> float:
    graph = llm.engine.runner.graphs.graphs[bucket].graph
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


questions = [
    json.loads(line)["turns"][0] for line in dataset_path("mt-bench").read_text().splitlines() if line
]
loaded = load_model("smollm2-135m-instruct", torch.device("cuda"), torch.bfloat16)
rows = []
graphed_llm = None
for graphs, overlap in os.environ.get("PROFILE_CONFIGS", "00,10,11").split(","):
    llm = LLM(
        loaded,
        cuda_graphs=graphs == "1",
        overlap_schedule=overlap == "1",
        max_total_tokens=64 * 1500,
        max_batched_tokens=8192,
    )
    prompts = [llm._chat_ids([{"role": "user", "content": q}]) for q in questions[:64]]
    llm.generate(prompts[:2], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    for bs in BATCHES:
        timed(llm, prompts[:bs])  # warm-up over the same lengths: kernels compiled, graphs captured
        seconds, phases = timed(llm, prompts[:bs])
        rows.append((graphs, overlap, bs, seconds, phases))
        if os.environ.get("PROFILE_CPROFILE"):  # the same run again under cProfile: the host's functions
            prof = cProfile.Profile()
            prof.runcall(timed, llm, prompts[:bs])
            print(f"cProfile, graphs={graphs} overlap={overlap} batch {bs}:")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if graphs == "1":
        graphed_llm = llm
print(f"{'graphs':>7}{'overlap':>8}{'batch':>7}{'tok/s':>10}  host ms per step by phase")
for graphs, overlap, bs, seconds, phases in rows:
    shown = " ".join(f"{k}={v:.3f}" for k, v in sorted(phases.items()))
    print(f"{graphs:>7}{overlap:>8}{bs:>7}{bs * TOKENS / seconds:>10.0f}  {shown}")
if graphed_llm is not None:
    for bucket in ((1, 1), (8, 1), (64, 1)):
        if bucket not in graphed_llm.engine.runner.graphs.graphs:
            continue
        print(f"graph replay {bucket}: {replay_us(graphed_llm, bucket):.1f} us (GPU floor of a step)")
if graphed_llm is not None and os.environ.get("PROFILE_TABLE", "1") != "0":
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        graphed_llm.generate(prompts[:1], SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=40))
if os.environ.get("PROFILE_KERNELS"):
    # Every kernel of an eager decode step (a graph replays the same list): count and GPU time.
    eager = LLM(loaded, cuda_graphs=False, overlap_schedule=False, max_total_tokens=64 * 1500)
    for bs in (1, 64):
        params = SamplingParams(max_new_tokens=11, temperature=0.0, ignore_eos=True)
        eager.generate(prompts[:bs], params)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eager.generate(prompts[:bs], params)
        print(f"eager kernels, batch {bs}, prefill + 10 decode steps:")
        print(
            prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70)
        )
