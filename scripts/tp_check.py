"""TP=2 over NCCL against TP=1 on two GPUs (run on the lent 2-GPU machine): greedy agreement, tokens/s
at batch 1 and 16, and the share of each step rank 0 spends drafting (the drafter is unsharded there).

    python3 -P scripts/tp_check.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch

from specserve.assets import dataset_path, pull
from specserve.config import EngineConfig, SpeculativeConfig
from specserve.engine.engine import Engine
from specserve.executor.local import local_tp_group
from specserve.llm import LLM
from specserve.model.head_checkpoint import random_head, save_head
from specserve.model.loader import load_model
from specserve.types import SamplingParams

NEW_TOKENS = 64
BATCHES = (1, 16)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _prompts(llm: LLM, n: int) -> list[list[int]]:
    lines = dataset_path("mt-bench").read_text().splitlines()
    questions = [json.loads(line)["turns"][0] for line in lines if line][:n]
    return [llm._chat_ids([{"role": "user", "content": q}]) for q in questions]


def _run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float, float]:
    """(outputs, seconds, seconds spent drafting on rank 0) of one greedy batch."""
    drafted = [0.0]
    if engine.drafter is not None:
        draft = engine.drafter.draft

        def timed(*args):
            _sync()
            start = time.perf_counter()
            draft(*args)
            _sync()
            drafted[0] += time.perf_counter() - start

        engine.drafter.draft = timed
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    _sync()
    start = time.perf_counter()
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    _sync()
    seconds = time.perf_counter() - start
    if engine.drafter is not None:
        engine.drafter.draft = draft
    engine.flush_cache()
    return [done[i] for i in ids], seconds, drafted[0]


def _configs(model: str, head: str, device: str) -> dict[str, EngineConfig]:
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    base = EngineConfig(model=model, device=device, dtype=dtype)
    base = replace(base, cache=replace(base.cache, max_total_tokens=200_000))
    return {
        "plain-fp32": replace(base, dtype="float32"),
        "plain": base,
        "ngram-4": replace(base, speculative=SpeculativeConfig(method="ngram", num_steps=4)),
        "eagle3-4 (random head)": replace(
            base, speculative=SpeculativeConfig(method="eagle3", num_steps=4, draft_model=head)
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--device", default="cuda:0", help="cuda:0 (NCCL) or cpu (gloo, a dry run)")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    args = parser.parse_args()
    model = str(pull("smollm2-135m-instruct"))
    arch = load_model(model, torch.device("cpu"), torch.float32).arch
    head = str(
        save_head(Path(tempfile.mkdtemp()) / "eagle3", *random_head("eagle3", arch, seed=3, init_std=0.02))
    )
    configs = _configs(model, head, args.device)
    llm = LLM(model, device=args.device, max_total_tokens=4096)
    prompts = _prompts(llm, 16)
    del llm
    rows, outputs = [], {}
    for tp in (1, 2):
        tp_configs = [replace(c, tp_size=tp) for c in configs.values()]
        with local_tp_group(tp_configs) if tp > 1 else nullcontext() as info:
            for name, config in zip(configs, tp_configs, strict=True):
                engine = Engine(config, tp=info)
                _run(engine, prompts[:2], 8)  # warm-up
                for batch in BATCHES:
                    outs, seconds, drafting = _run(engine, prompts[:batch], args.new_tokens)
                    outputs[(tp, name, batch)] = outs
                    rows.append(
                        {
                            "tp": tp,
                            "system": name,
                            "batch": batch,
                            "tok_s": batch * args.new_tokens / seconds,
                            "draft_share": drafting / seconds,
                        }
                    )
                engine.shutdown()
    for row in rows:
        same = [
            a == b
            for a, b in zip(
                outputs[(1, row["system"], row["batch"])],
                outputs[(row["tp"], row["system"], row["batch"])],
                strict=True,
            )
        ]
        row["identical_to_tp1"] = f"{sum(same)}/{len(same)}"
    Path(args.out, "tp_check.json").write_text(json.dumps(rows, indent=2))
    print(f"{'tp':>3} {'system':<24}{'batch':>6}{'tok/s':>9}{'draft share':>13}{'same as tp1':>13}")
    for r in rows:
        print(
            f"{r['tp']:>3} {r['system']:<24}{r['batch']:>6}{r['tok_s']:>9.1f}{r['draft_share']:>13.1%}"
            f"{r['identical_to_tp1']:>13}"
        )


if __name__ == "__main__":
    main()
