"""On the lent GPU machine: what a head's tree search on the device costs (specserve/spec/tree_graphs.py).

Builds the default model with the shipped head (or HEAD) drafting trees of SPEC (`STEPSxTOPKxNODES`,
default 5x8x32), answers a few MT-Bench prompts so the head has real states, then per batch bucket
(BATCHES, default 1,16): the captured graph's replay time (CUDA events over REPLAYS replays, µs),
and an eager search under the torch profiler, its kernels by device time (where a replay's time
goes). Prints a short table last.

    python3 -P scripts/profile_tree_graph.py
"""

import os

import torch
from torch.profiler import ProfilerActivity, profile

from specserve import LLM, SamplingParams
from specserve.bench_data import prompt_texts
from specserve.model.loader import load_model

HEAD = os.environ.get("HEAD", "specserve/heads/smollm2-135m-instruct")
STEPS, TOPK, NODES = (int(x) for x in os.environ.get("SPEC", "5x8x32").split("x"))
BATCHES = [int(b) for b in os.environ.get("BATCHES", "1,16").split(",")]
REPLAYS = int(os.environ.get("REPLAYS", "200"))

loaded = load_model("smollm2-135m-instruct", torch.device("cuda"), torch.bfloat16)
spec = {"method": "eagle3", "draft_model": HEAD, "num_steps": STEPS, "topk": TOPK, "num_draft_tokens": NODES}
llm = LLM(loaded, speculative=spec, max_total_tokens=64 * 1500)
prompts = [llm._chat_ids([{"role": "user", "content": q}]) for q in prompt_texts("mt-bench")[:16]]
llm.generate(prompts, SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))
graphs = llm.engine.drafter.tree_graphs
rows = []
for batch in BATCHES:
    key = graphs.pick(batch, STEPS, TOPK, NODES)
    bucket = graphs.buckets[key]
    bucket.depth.fill_(STEPS)  # every row searches (the state's last run left real inputs)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        bucket.graph.replay()
    start.record()
    for _ in range(REPLAYS):
        bucket.graph.replay()
    end.record()
    torch.cuda.synchronize()
    replay_us = start.elapsed_time(end) * 1000 / REPLAYS
    graphs.search(bucket)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graphs.search(bucket)
        torch.cuda.synchronize()
    kernels = prof.key_averages()
    device_us = sum(k.self_device_time_total for k in kernels)
    print(f"== batch bucket {key[0]}, {key[1]}: replay {replay_us:.1f} us; eager kernels {device_us:.1f} us")
    print(kernels.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
    rows.append((key[0], replay_us, device_us, sum(k.count for k in kernels if k.self_device_time_total > 0)))
print("batch  replay us  eager kernels us  kernel launches")
for batch, replay, device, count in rows:
    print(f"{batch:5d}  {replay:9.1f}  {device:16.1f}  {count:15d}")
