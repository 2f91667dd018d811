"""Tok/s of batches whose requests ask for logprobs: in the device loop, against the synchronous
path such a request forced before the loop recorded logprobs (`loop_takes_logprobs` patched to
refuse every logprob request), beside the same batches asking none.

Per system (plain decoding, and each --spec) and batch size, one model load, MT-Bench prompts,
greedy, EOS ignored, the best of --repeats runs over --batches batches:
- `none`: no request asks;
- `one`: the first request of each batch asks for its tokens' logprobs and the top 5;
- `all`: every request does.

    python -P scripts/bench_loop_logprobs.py --batch-sizes 1,16,64 --spec eagle3:3:specserve/heads/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import torch

from specserve import bench
from specserve.bench_data import prompt_texts
from specserve.cli_spec_args import parse_spec
from specserve.engine import device_loop
from specserve.model.loader import load_model
from specserve.model.tokenizer import chat_prompt_ids
from specserve.types import SamplingParams

ASKS = {"none": 0, "one": 1, "all": None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--spec", action="append", default=[])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    loaded = load_model("smollm2-135m-instruct", torch.device("cuda"), torch.bfloat16)
    texts = prompt_texts("mt-bench", seed=0)
    chats = [chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": t}]) for t in texts]
    engine_args = argparse.Namespace(
        device="cuda", dtype="bfloat16", page_size=16, attention_backend="auto", max_new_tokens=args.tokens
    )
    most = max(sizes)
    pool = bench._pool_tokens(chats[: most * args.batches], engine_args, 16, most)
    rows = []
    for spec in [None, *(parse_spec(s) for s in args.spec)]:
        llm = bench._engine(engine_args, loaded, spec, most, pool)
        llm.generate(chats[:2], SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
        gc.collect()
        gc.freeze()
        name = "plain" if spec is None else f"{spec['method']}:{spec['num_steps']}"
        for batch in sizes:
            batches = [chats[i * batch : (i + 1) * batch] for i in range(args.batches)]
            for ask, count in ASKS.items():
                for path in ("loop", "host") if count != 0 else ("loop",):
                    seconds = min(_run(llm, batches, args.tokens, count, path) for _ in range(args.repeats))
                    tok_s = args.batches * batch * args.tokens / seconds
                    rows.append((name, batch, ask, path, tok_s))
                    print(f"{name:10} b{batch:<3} {ask:5} {path:5} {tok_s:10,.0f} tok/s", flush=True)
        del llm
        gc.unfreeze()
        gc.collect()
        torch.cuda.empty_cache()
    print("\nsystem     batch asks  loop tok/s  host tok/s  loop/host")
    for name, batch, ask, path, tok_s in rows:
        if path != "loop":
            continue
        host = next((t for n, b, a, p, t in rows if (n, b, a, p) == (name, batch, ask, "host")), None)
        ratio = f"{tok_s / host:9.2f}" if host else "        -"
        host_cell = f"{host:10,.0f}" if host else "         -"
        print(f"{name:10} {batch:5} {ask:5} {tok_s:10,.0f} {host_cell} {ratio}")


def _run(llm, batches: list[list[list[int]]], tokens: int, count: int | None, path: str) -> float:
    """Seconds for the batches, `count` requests of each asking for logprobs (None: all)."""
    plain = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    asking = dataclasses.replace(plain, return_logprob=True, top_logprobs_num=5)
    original = device_loop.loop_takes_logprobs
    if path == "host":  # as before: a logprob request kept its batch out of the loop
        device_loop.loop_takes_logprobs = lambda params: not params.return_logprob
    try:
        llm.engine.flush_cache()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for batch in batches:
            n = len(batch) if count is None else count
            outs = llm.generate(batch, [asking] * n + [plain] * (len(batch) - n))
            assert all(len(o.token_ids) == tokens for o in outs)
            assert all(len(o.meta["output_token_logprobs"]) == tokens for o in outs[:n])
        torch.cuda.synchronize()
        return time.perf_counter() - start
    finally:
        device_loop.loop_takes_logprobs = original


if __name__ == "__main__":
    main()
