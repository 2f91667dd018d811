"""The device loop's cost on the GPU: one captured loop iteration against the verify bucket alone.

For each batch in LOOP_BATCHES (default 1,16,64) and chain length LOOP_STEPS (default 8), builds an
engine with the device loop (`specserve/engine/device_loop.py`), and times back-to-back replays of
the verify bucket's graph and of the loop's iteration graph (draft lookup, input, the same forward,
accept): the difference is the loop's glue on the device. Then a real run: MT-Bench prompts at
that batch, 256 new tokens, greedy, EOS ignored: the run's wall over the loop iterations it planned
(prefill and iterations planned past a request's end included: not an iteration's price, which
`scripts/trace_steps.py`'s fit by context gives) and tokens a verify.
LOOP_KERNELS=1 prints the kernels of batch 1's forward and loop iteration (torch.profiler over 20
replays; LOOP_KERNELS=64: batch 64's). LOOP_STEPS=0 profiles plain decoding's loop (`make_plain_loop`)
against the decode bucket. LOOP_HEAD=FOLDER profiles a head's loop instead (`specserve/engine/head_loop.py`: EAGLE-3 chains of LOOP_STEPS drafts;
LOOP_METHOD=mtp for an MTP head), whose "glue" is the head's drafting.

    LOOP_BATCHES=1,16 LOOP_STEPS=5,8 python3 -P scripts/profile_loop.py
    LOOP_HEAD=path/to/eagle3 LOOP_KERNELS=1 LOOP_BATCHES=1 LOOP_STEPS=5 python3 -P scripts/profile_loop.py
"""

import gc
import os
import sys
import time
from pathlib import Path

import torch

from specserve import LLM, SamplingParams
from specserve.bench_data import prompt_texts
from specserve.model.loader import load_model
from specserve.model.tokenizer import chat_prompt_ids

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ (python -P leaves it out)
from profile_verify import kernel_table, replay_us  # noqa: E402

BATCHES = [int(b) for b in os.environ.get("LOOP_BATCHES", "1,16,64").split(",")]
STEPS = [int(s) for s in os.environ.get("LOOP_STEPS", "8").split(",")]
HEAD = os.environ.get("LOOP_HEAD")
METHOD = os.environ.get("LOOP_METHOD", "eagle3")  # LOOP_HEAD's kind: eagle3 or mtp


KERNEL_BATCH = int(os.environ.get("LOOP_KERNELS") or 0)


def _spec(steps: int) -> dict | None:
    if steps == 0:
        return None
    if HEAD:
        return {"method": METHOD, "draft_model": HEAD, "num_steps": steps, "device_steps": 8}
    return {"method": "ngram", "num_steps": steps, "device_steps": 8}


def main() -> None:
    loaded = load_model("smollm2-135m-instruct", torch.device("cuda"), torch.bfloat16)
    texts = prompt_texts("mt-bench", seed=0)[: max(BATCHES)]
    prompts = [chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": t}]) for t in texts]
    print(
        "| batch | steps | verify replay us | loop iteration us | glue us | run wall us / planned iteration | tokens / verify | tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for steps in STEPS:
        for batch in BATCHES:
            llm = LLM(
                loaded,
                speculative=_spec(steps),
                cuda_graph_max_batch=max(BATCHES),
                max_total_tokens=1 << 17,
            )
            engine = llm.engine
            loop = engine.device_loop
            bucket = next(b for b in loop.batch_sizes if b >= batch)
            verify = replay_us(engine.runner.graphs.graphs[(bucket, steps + 1)].graph)
            iteration = replay_us(loop.loop_graphs[bucket])
            if batch == KERNEL_BATCH:
                kernel_table(engine.runner.graphs.graphs[(bucket, steps + 1)].graph, "  forward", top=20)
                kernel_table(loop.loop_graphs[bucket], "  loop step", top=40)
            params = SamplingParams(max_new_tokens=256, temperature=0.0, ignore_eos=True)
            llm.generate(prompts[:batch], params)  # warm-up
            launches = []
            original = loop.launch

            def counting(*args, original=original, launches=launches, **kwargs):
                launches.append(args[3])
                return original(*args, **kwargs)

            loop.launch = counting
            torch.cuda.synchronize()
            start = time.perf_counter()
            outs = llm.generate(prompts[:batch], params)
            wall = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outs)
            verifies = sum(o.meta.get("spec_verify_ct", len(o.token_ids)) for o in outs)
            per_iter = wall / max(1, sum(launches)) * 1e6
            print(
                f"| {batch} | {steps} | {verify:.0f} | {iteration:.0f} | {iteration - verify:.0f} | "
                f"{per_iter:.0f} | {tokens / max(1, verifies):.2f} | {tokens / wall:,.0f} |"
            )
            del llm, engine, loop, original, counting
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
