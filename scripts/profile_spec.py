"""Where a speculative step's time goes on the GPU, for one configuration: host ms per step by phase
(draft, target, postprocess) at batch 1 and 16, the Python functions that take the host's time
(cProfile, by own time), host-device synchronisations (CUDA sync debug mode, counted), and a
torch.profiler table of a few steps.

Environment: SPEC (a `--spec` string, default `ngram:4`; e.g. `eagle3:5x8x32:path/to/head`),
PROFILE_TOKENS (new tokens per request, default 64), PROFILE_BATCHES (default "1,16"), PROFILE_DEVICE
(default cuda; cpu checks the script, fp32, without the sync count), PROFILE_TEMPERATURE (every
request's, default 0: greedy).
"""

import cProfile
import io
import json
import os
import pstats
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from specserve import LLM, SamplingParams
from specserve.assets import dataset_path
from specserve.cli_spec_args import parse_spec
from specserve.engine.stats import PhaseTotals
from specserve.model.loader import load_model

TOKENS = int(os.environ.get("PROFILE_TOKENS", "64"))
TEMPERATURE = float(os.environ.get("PROFILE_TEMPERATURE", "0"))
DEVICE = torch.device(os.environ.get("PROFILE_DEVICE", "cuda"))
CUDA = DEVICE.type == "cuda"
spec = parse_spec(os.environ.get("SPEC", "ngram:4"))


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


questions = [
    json.loads(line)["turns"][0] for line in dataset_path("mt-bench").read_text().splitlines() if line
]
loaded = load_model("smollm2-135m-instruct", DEVICE, torch.bfloat16 if CUDA else torch.float32)
llm = LLM(loaded, speculative=spec, max_total_tokens=64 * 1500, max_batched_tokens=8192)
prompts = [llm._chat_ids([{"role": "user", "content": q}]) for q in questions[:64]]
params = SamplingParams(max_new_tokens=TOKENS, temperature=TEMPERATURE, ignore_eos=True)
llm.generate(prompts[:2], params)
print(f"speculative: {spec}")
for bs in [int(b) for b in os.environ.get("PROFILE_BATCHES", "1,16").split(",")]:
    llm.generate(prompts[:bs], params)  # warm-up over the same lengths: kernels compiled, graphs captured
    sink = PhaseTotals()
    llm.engine.attach_stats_sink(sink)
    llm.engine.flush_cache()
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts[:bs], params)
    sync()
    seconds = time.perf_counter() - start
    llm.engine.stats_sink = None
    steps = ", ".join(f"{k}={v:.2f}" for k, v in sorted({**sink.ms_per_step(), **sink.step_spread()}.items()))
    verifies = sum(o.meta.get("spec_verify_ct", 0) for o in outs)
    print(
        f"batch {bs}: {bs * TOKENS / seconds:.0f} tok/s, {sink.steps} steps, {verifies} verifies; ms/step {steps}"
    )
    llm.engine.flush_cache()
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts[:bs], params)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
    # Cumulative time of our own functions: which phase a slow call sits under.
    pstats.Stats(prof, stream=text).sort_stats("cumtime").print_stats("specserve", 25)
    print(text.getvalue()[-12000:])
    # Own time of the tree search and the step inputs (the host cost of draft trees).
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(r"tree\.py|step_input\.py", 20)
    print(text.getvalue()[-6000:])
llm.engine.flush_cache()
if CUDA:
    torch.cuda.set_sync_debug_mode("warn")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    llm.generate(prompts[:1], SamplingParams(max_new_tokens=16, temperature=TEMPERATURE, ignore_eos=True))
if CUDA:
    torch.cuda.set_sync_debug_mode(0)
syncs: dict[str, int] = {}
for w in caught:
    where = f"{w.filename}:{w.lineno}"  # the line that synchronised
    syncs[where] = syncs.get(where, 0) + 1
print(f"host-device syncs in 16 tokens at batch 1: {sum(syncs.values())}")
for where, n in sorted(syncs.items(), key=lambda kv: -kv[1])[:10]:
    print(f"  {n:5d}  {where}")
with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if CUDA else [])]) as tprof:
    llm.generate(prompts[:1], SamplingParams(max_new_tokens=8, temperature=TEMPERATURE, ignore_eos=True))
print(tprof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=50))
