"""`specserve bench`: offline output throughput on MT-Bench prompts, beside HF transformers `generate`.

Every batch size runs the same chat prompts through our engine and, in the same process on the same
device, through HF `generate` (plain greedy, and prompt lookup at batch 1), so each figure is also a
ratio. Greedy, a fixed number of new tokens (EOS ignored), wall time from submission to the last token.
With `--url` the same batches also go to a running server over HTTP (`specserve.bench_http`).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specserve.cli_spec_args import add_speculative_arguments, speculative_from_args
from specserve.config import ATTENTION_BACKENDS
from specserve.types import SamplingParams


@dataclass(frozen=True)
class BenchRow:
    system: str
    batch_size: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    accept_length: float | None = None  # completion tokens per verify step, with speculation


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="smollm2-135m-instruct", help="asset name, .gguf file or HF folder"
    )
    parser.add_argument("--batch-sizes", default="1,64", help="comma-separated batch sizes")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="auto (Triton kernels on CUDA, torch on the CPU), torch or triton",
    )
    parser.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens")
    add_speculative_arguments(parser)  # with --speculative, runs with and without it
    parser.add_argument(
        "--hf", action="store_true", help="also time HF transformers generate in this process"
    )
    parser.add_argument(
        "--url",
        default=None,
        help="also send the workload to a running server (native /generate) at this URL",
    )
    parser.add_argument("--out", default="bench.json", help="where to write the JSON results")


def run(args: argparse.Namespace) -> int:
    from specserve.assets import dataset_path

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = _engine(args, args.model, None, max(batch_sizes))
    questions = [
        json.loads(line)["turns"][0] for line in dataset_path("mt-bench").read_text().splitlines() if line
    ]
    prompts = [llm._chat_ids([{"role": "user", "content": q}]) for q in questions]
    engines = {"specserve": llm}
    spec = speculative_from_args(args)
    if spec:
        name = f"specserve-{args.speculative}-{args.num_steps}"
        engines[name] = _engine(args, llm.engine.loaded, spec, max(batch_sizes))
    hf = _load_hf(llm) if args.hf else None
    rows: list[BenchRow] = []
    for engine in engines.values():
        _time_engine(engine, prompts[:2], 8)  # warm-up
    for b in batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(b)]
        for name, engine in engines.items():
            seconds, accept = _time_engine(engine, batch, args.max_new_tokens)
            rows.append(_row(name, b, args.max_new_tokens, seconds, accept))
        if hf is not None:
            rows.append(
                _row("hf-generate", b, args.max_new_tokens, _time_hf(hf, llm, batch, args.max_new_tokens))
            )
            if b == 1:
                seconds = _time_hf(hf, llm, batch, args.max_new_tokens, prompt_lookup=args.num_steps)
                rows.append(_row("hf-generate-prompt-lookup", b, args.max_new_tokens, seconds))
    if args.url:
        from specserve.bench_http import http_rows

        rows += http_rows(args.url, prompts, batch_sizes, args.max_new_tokens)
    report = {
        "model": args.model,
        "device": str(llm.engine.device),
        "dtype": str(llm.engine.dtype),
        "attention_backend": llm.engine.backend.name,
        "gpu": torch.cuda.get_device_name() if llm.engine.device.type == "cuda" else None,
        "rows": [asdict(r) for r in rows],
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    _print_table(rows)
    return 0


def _engine(args: argparse.Namespace, model, speculative: dict | None, max_batch: int):
    from specserve import LLM

    return LLM(
        model,
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        attention_backend=args.attention_backend,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=max_batch,
        max_batched_tokens=8192,
        speculative=speculative,
    )


def _row(system: str, batch: int, new_tokens: int, seconds: float, accept: float | None = None) -> BenchRow:
    return BenchRow(system, batch, new_tokens, seconds, batch * new_tokens / seconds, accept)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_engine(llm, prompts: list[list[int]], new_tokens: int) -> tuple[float, float | None]:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.engine.flush_cache()  # no prefix reuse between runs
    _sync(llm.engine.device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync(llm.engine.device)
    seconds = time.perf_counter() - start
    assert all(len(o.token_ids) == new_tokens for o in outs)
    verify_steps = sum(o.meta.get("spec_verify_ct", 0) for o in outs)
    return seconds, (len(outs) * new_tokens / verify_steps if verify_steps else None)


def _load_hf(llm):
    from transformers import AutoModelForCausalLM

    location = llm.engine.loaded.location
    if location.kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(
            location.path.parent, gguf_file=location.path.name, dtype=llm.engine.dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(location.path, dtype=llm.engine.dtype)
    return model.to(llm.engine.device).eval()


def _time_hf(
    model, llm, prompts: list[list[int]], new_tokens: int, prompt_lookup: int | None = None
) -> float:
    pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=llm.engine.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=llm.engine.device)
    extra = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    _sync(llm.engine.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=pad,
            **extra,
        )
    _sync(llm.engine.device)
    assert out.shape[1] == width + new_tokens
    return time.perf_counter() - start


def _print_table(rows: list[BenchRow]) -> None:
    """One line per run; the last column is each run's speed over plain specserve at that batch size."""
    plain = {r.batch_size: r.tokens_per_s for r in rows if r.system == "specserve"}
    print(
        f"{'system':<28}{'batch':>6}{'new tok':>9}{'seconds':>10}{'tok/s':>11}{'accept len':>12}{'x plain':>9}"
    )
    for r in rows:
        accept = f"{r.accept_length:.2f}" if r.accept_length else "-"
        speedup = r.tokens_per_s / plain[r.batch_size]
        print(
            f"{r.system:<28}{r.batch_size:>6}{r.new_tokens:>9}{r.seconds:>10.2f}{r.tokens_per_s:>11.1f}"
            f"{accept:>12}{speedup:>9.2f}"
        )
