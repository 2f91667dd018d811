"""Launch overhead, per-step time at batch 1 and 64, and a torch.profiler table of a few decode steps (GPU)."""

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
a = torch.randn(4096, 4096)
t = time.perf_counter()
for _ in range(20):
    a @ a
print(
    f"host cpu matmul 4096^2: {(time.perf_counter() - t) / 20 * 1e3:.1f} ms (threads={torch.get_num_threads()})"
)

llm = LLM("smollm2-135m-instruct")
prompt = llm._chat_ids([{"role": "user", "content": "Tell me a story about a dragon."}])
p = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
llm.generate([prompt], p)
for bs in (1, 64):
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate([prompt] * bs, SamplingParams(max_new_tokens=128, temperature=0.0, ignore_eos=True))
    torch.cuda.synchronize()
    print(f"batch {bs}: {(time.perf_counter() - t) / 128 * 1e3:.2f} ms per step incl. prefill")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    llm.generate([prompt], SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=40))
