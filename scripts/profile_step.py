"""Launch overhead, per-step time at batch 1 and 64 for each attention backend, where a decode step's
host time goes (engine phases), and a torch.profiler table of a few batch-1 decode steps (GPU).

Environment: PROFILE_BACKENDS (default "torch,triton"), PROFILE_GRAPHS ("0,1": CUDA graphs off/on).
"""

import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specserve import LLM, SamplingParams

x = torch.zeros(16, device="cuda")
for _ in range(100):
    x.add_(1)
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(5000):
    x.add_(1)
torch.cuda.synchronize()
print(f"launch overhead: {(time.perf_counter() - t) / 5000 * 1e6:.1f} us per tiny kernel")


def per_step_ms(llm: LLM, prompt: list[int], batch: int, steps: int = 128) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate([prompt] * batch, SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True))
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1e3


rows = []
last = None
for backend in os.environ.get("PROFILE_BACKENDS", "torch,triton").split(","):
    for graphs in os.environ.get("PROFILE_GRAPHS", "0").split(","):
        graphed = graphs == "1" and backend != "torch"
        llm = LLM(
            "smollm2-135m-instruct", attention_backend=backend, cuda_graphs=graphed, max_total_tokens=65536
        )
        prompt = llm._chat_ids([{"role": "user", "content": "Tell me a story about a dragon."}])
        llm.generate([prompt], SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True))
        for bs in (1, 64):
            rows.append((backend, graphs, bs, per_step_ms(llm, prompt, bs)))
        last = (llm, prompt)
        del llm
print(f"{'backend':<10}{'graphs':>7}{'batch':>7}{'ms/step':>10}{'tok/s':>10}")
for backend, graphs, bs, ms in rows:
    print(f"{backend:<10}{graphs:>7}{bs:>7}{ms:>10.2f}{bs / ms * 1e3:>10.0f}")

llm, prompt = last
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    llm.generate([prompt], SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=48))
