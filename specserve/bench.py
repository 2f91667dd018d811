"""`specserve bench [offline]`: output throughput on MT-Bench or ShareGPT prompts, beside HF `generate`.

The model is loaded once; plain decoding and every speculative configuration asked for run as engines
over those same weights. With `--peer hf`, HF transformers `generate` runs the same model on the same
device in the same dtype (plain greedy, and prompt lookup at batch 1), so each figure is also a
ratio. Greedy (or sampled at `--temperature`), a fixed number of new tokens (EOS ignored), wall time
from submission to the last token, the prefix cache flushed before each run. With `--url` the same batches also go to a running
server over HTTP (`specserve.bench_http`). Output: JSON, a table, and a PNG of tok/s vs batch size.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from specserve.bench_data import add_dataset_arguments, cycle, prompt_texts
from specserve.bench_host import HostSample
from specserve.bench_plot import plot_throughput
from specserve.bench_report import format_table, run_info, write_json
from specserve.cli_spec_args import (
    DEFAULT_NUM_STEPS,
    add_speculative_arguments,
    count,
    counts,
    draft_slots,
    parse_spec,
    spec_name,
    speculative_from_args,
)
from specserve.config import ATTENTION_BACKENDS
from specserve.engine.stats import PhaseTotals
from specserve.types import SamplingParams

PLAIN = spec_name(None)
HF = "hf-generate"
PLAIN_SYNC = "specserve-sync"  # plain decoding without the device loop (`--plain-sync`)
HF_PROMPT_LOOKUP = "hf-generate-prompt-lookup"
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class BenchRow:
    system: str
    batch_size: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    accept_length: float | None = None  # tokens a verify step emitted (accepted drafts + 1), with speculation
    # host ms per engine step by phase (`step`: the whole step; `draft`, `target`, `postprocess`)
    step_ms: dict[str, float] | None = None
    tier_steps: dict[str, int] | None = None  # adaptive speculation: steps per tier (`Tier.name`)
    # adaptive speculation, after the run: the policy's predicted step ms per tier at this batch (and
    # the measured wall ms of the steps each tier ran at it, `measured_step_ms`; the mean ms of its
    # steady steps, which prices it, and of its transitions, `steady_step_ms`, `transition_step_ms`), the
    # pooled per-position acceptance (and its evidence), probes, predicted vs measured goodput
    adaptive: dict | None = None
    batches: int = 1  # batches of `batch_size` distinct prompts run back to back (`--min-prompts`)
    # every repeat's seconds in the order run (`--repeats`; rounds over the systems): their spread
    # shows a slow spell of the machine that one repeat caught
    repeat_seconds: list[float] | None = None
    # beside each repeat, what the host did meanwhile (`bench_host.HostSample.until`): its start,
    # the process's CPU seconds, the machine's idle and stolen seconds
    repeat_host: list[dict[str, float | None]] | None = None
    # adaptive speculation: beside each repeat, the engine steps each tier ran in it (`tier_steps` is
    # the median repeat's): a slow repeat shows whether the policy held another tier there
    repeat_tier_steps: list[dict[str, int] | None] | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="smollm2-135m-instruct", help="asset name, .gguf file or HF folder"
    )
    add_dataset_arguments(parser)
    parser.add_argument(
        "--batch-sizes", type=counts, default=[1, 64], help="comma-separated batch sizes (default: 1,64)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=count(),
        default=256,
        help="tokens each request generates, EOS ignored (default: 256)",
    )
    parser.add_argument(
        "--device", default="auto", help="auto (CUDA when there is a GPU), cpu, cuda or cuda:N"
    )
    parser.add_argument(
        "--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on the CPU), or a torch dtype name"
    )
    parser.add_argument("--page-size", type=count(), default=1, help="KV page size in tokens (default: 1)")
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="auto (Triton kernels on CUDA, torch on the CPU), torch, triton or flash (vllm-flash-attn "
        "where it imports; needs --page-size a multiple of 16)",
    )
    parser.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV pool size in tokens per engine (default: what the largest batch needs)",
    )
    parser.add_argument(
        "--spec",
        action="append",
        default=[],
        type=parse_spec,
        metavar="METHOD[:SHAPE[:DRAFT_MODEL]]",
        help="a speculative configuration to run besides plain decoding (repeatable); SHAPE is "
        "NUM_STEPS (a chain) or NUM_STEPSxTOPK[xNUM_DRAFT_TOKENS] (a tree), "
        "e.g. ngram:4, ngram:6x8x64 or eagle3:5x4x16:path/to/head; adaptive[-SHAPE] with its "
        "settings after commas, e.g. ngram:adaptive-8,patience=8",
    )
    add_speculative_arguments(parser)  # one more configuration, the older way
    parser.add_argument(
        "--peer",
        default="none",
        choices=("none", "hf"),
        help="hf: also time HF transformers generate on the same model, device and dtype",
    )
    parser.add_argument("--hf", dest="peer", action="store_const", const="hf", help="same as --peer hf")
    parser.add_argument(
        "--plain-sync",
        action="store_true",
        help=f"also time plain decoding with every step from the host ({PLAIN_SYNC}: decode_steps 0), "
        "beside the default, whose greedy steps run in the device loop where graphs are captured",
    )
    parser.add_argument(
        "--url",
        default=None,
        help="also send the workload to a running server (native /generate) at this URL",
    )
    parser.add_argument(
        "--repeats",
        type=count(),
        default=3,
        help="timed runs per engine and batch size (the lower median is reported: of two, the faster; default: 3)",
    )
    parser.add_argument(
        "--warmup-rounds",
        type=count(0),
        default=1,
        help="untimed rounds over every engine at each batch size before its timed ones: the first "
        "run of a batch size ran 1.3-5x slower in the first engines of a round (H200, batch 64), a cost "
        "of the shape, not of the system that happened to run first (default: 1)",
    )
    parser.add_argument(
        "--min-prompts",
        type=count(),
        default=16,
        help="distinct prompts each batch size covers at least: batch size B runs ceil(N / B) batches "
        "of B prompts back to back (so batch 1 is a mean over N prompts, not one prompt's text); "
        "HF generate runs the first batch only (default: 16)",
    )
    parser.add_argument(
        "--min-batches",
        type=count(),
        default=1,
        help="batches each batch size runs back to back at least (prompts cycle where the data set is "
        "shorter): a large batch's run of one batch lasts a fraction of a second, so its figure is "
        "noisy and an adaptive policy's moves after the batch size changed weigh in it (default: 1)",
    )
    parser.add_argument(
        "--temperature",
        type=_temperature,
        default=0.0,
        help="sampling temperature of every request (default 0: greedy); HF generate samples at it too",
    )
    parser.add_argument(
        "--out", default="bench.json", help="where to write the JSON results (default: bench.json)"
    )
    parser.add_argument("--plot", default=None, help="where to write the PNG (default: --out with .png)")


def _temperature(text: str) -> float:
    """An argparse type: a finite temperature >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: a temperature is a number >= 0")
    return value


def run(args: argparse.Namespace) -> int:
    from specserve.config import CacheConfig, EngineConfig
    from specserve.engine.engine import attention_backend
    from specserve.model.loader import load_model
    from specserve.model.tokenizer import chat_prompt_ids

    try:
        specs = _specs(args)
        batch_sizes = args.batch_sizes
        where = EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            attention_backend=args.attention_backend,
            cache=CacheConfig(page_size=args.page_size),
        )
        attention_backend(where)  # before the model loads: e.g. "flash" where it does not import
        texts = prompt_texts(args.dataset, seed=args.seed, max_chars=args.max_prompt_chars)
        loaded = load_model(args.model, where.torch_device(), where.torch_dtype())  # once, for every engine
    except ValueError as err:
        print(f"specserve bench: error: {err}", file=sys.stderr)
        return 2
    room = loaded.arch.max_position - args.max_new_tokens - _max_steps(specs) - 1
    chats = [chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": text}]) for text in texts]
    fitting = [ids for ids in chats if len(ids) <= room]
    if not fitting:
        print(f"specserve bench: error: no {args.dataset} prompt fits {room} tokens", file=sys.stderr)
        return 2
    prompts = cycle(fitting, max(b * _batch_count(b, args) for b in batch_sizes))
    pool = args.max_total_tokens or _pool_tokens(
        prompts, args, max(map(draft_slots, specs)), max(batch_sizes)
    )
    engines = {spec_name(spec): _engine(args, loaded, spec, max(batch_sizes), pool) for spec in specs}
    if args.plain_sync:
        engines[PLAIN_SYNC] = _engine(args, loaded, None, max(batch_sizes), pool, decode_steps=0)
    plain = engines[PLAIN]
    hf = _load_hf(plain) if args.peer == "hf" else None
    lookup = _prompt_lookup_tokens(specs, args.num_steps or DEFAULT_NUM_STEPS)
    for engine in engines.values():
        _time_engine(engine, [prompts[:2]], WARMUP_TOKENS, args.temperature)
    if hf is not None:
        _time_hf(hf, plain, prompts[:1], WARMUP_TOKENS, temperature=args.temperature)
    # Everything loaded so far (HF's model and modules among it) is old: keep the collector from
    # walking it in the middle of a timed run.
    gc.collect()
    gc.freeze()
    rows: list[BenchRow] = []
    for b in batch_sizes:
        batches = [prompts[i : i + b] for i in range(0, b * _batch_count(b, args), b)]
        batch = batches[0]
        # Repeats in rounds over the systems, not back to back: a slow spell of the machine (the
        # H200's plain decoding at batch 64 made 27k tok/s for a few seconds of a call where it
        # made 37k otherwise) then falls on one repeat of several systems, not on every repeat of one.
        runs: dict[str, list[tuple]] = {name: [] for name in engines}
        for _ in range(args.warmup_rounds):
            for engine in engines.values():
                _time_engine(engine, batches, args.max_new_tokens, args.temperature)
        hosts: dict[str, list[dict[str, float | None]]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                before = HostSample.now()
                runs[name].append(_time_engine(engine, batches, args.max_new_tokens, args.temperature))
                hosts[name].append(before.until(HostSample.now()))
        for name, timed in runs.items():
            # The lower median: of two runs the faster, as a late kernel compile lands in one run only.
            run = sorted(timed, key=lambda run: run[0])[(len(timed) - 1) // 2]
            repeats = [round(t[0], 6) for t in timed]
            row = _row(name, b, args.max_new_tokens, *run, batches=len(batches), repeats=repeats)
            tiers = [t[3] for t in timed]
            tiers = tiers if any(t is not None for t in tiers) else None
            rows.append(replace(row, repeat_host=hosts[name], repeat_tier_steps=tiers))
        if hf is not None:
            seconds = _time_hf(hf, plain, batch, args.max_new_tokens, temperature=args.temperature)
            rows.append(_row(HF, b, args.max_new_tokens, seconds))
            if b == 1:
                seconds = _time_hf(
                    hf, plain, batch, args.max_new_tokens, prompt_lookup=lookup, temperature=args.temperature
                )
                rows.append(_row(HF_PROMPT_LOOKUP, b, args.max_new_tokens, seconds))
    if args.url:
        from specserve.bench_http import http_rows

        rows += http_rows(args.url, prompts, batch_sizes, args.max_new_tokens)
    gpu = torch.cuda.get_device_name(plain.engine.device) if plain.engine.device.type == "cuda" else None
    report = {
        "mode": "offline",
        **run_info(getattr(args, "argv", sys.argv[1:])),
        "model": args.model,
        "device": str(plain.engine.device),
        "gpu": gpu,
        "dtype": str(plain.engine.dtype).removeprefix("torch."),
        "attention_backend": plain.engine.backend.name,
        "dataset": args.dataset,
        "distinct_prompts": len({tuple(p) for p in prompts}),
        "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "warmup_rounds": args.warmup_rounds,
        "systems": {
            **{spec_name(spec): {"speculative": spec} for spec in specs},
            **({PLAIN_SYNC: {"speculative": None, "decode_steps": 0}} if args.plain_sync else {}),
            **({HF: {"peer": "hf"}, HF_PROMPT_LOOKUP: {"prompt_lookup_num_tokens": lookup}} if hf else {}),
        },
        "rows": [asdict(r) for r in rows],
    }
    write_json(args.out, report)
    print(format_table(*_table(rows)))
    for line in _adaptive_lines(rows):
        print(line)
    plot = Path(args.plot) if args.plot else Path(args.out).with_suffix(".png")
    title = f"{Path(args.model).name} on {gpu or report['device']} ({report['dtype']}), {args.dataset}, "
    title += f"{args.max_new_tokens} new tokens"
    if plot_throughput([(r.system, r.batch_size, r.tokens_per_s) for r in rows], plot, title):
        print(f"plot: {plot}")
    return 0


def _specs(args: argparse.Namespace) -> list[dict | None]:
    """Plain decoding first (the baseline of every ratio), then each configuration once."""
    specs: list[dict | None] = [None]
    for spec in [*args.spec, speculative_from_args(args)]:
        if spec is not None and spec_name(spec) in {spec_name(s) for s in specs}:
            raise ValueError(f"{spec_name(spec)} is configured twice")
        if spec is not None:
            specs.append(spec)
    return specs


def _max_steps(specs: list[dict | None]) -> int:
    return max((s["num_steps"] for s in specs if s), default=0)


def _prompt_lookup_tokens(specs: list[dict | None], default: int) -> int:
    """HF's prompt lookup drafts as many tokens as our n-gram drafter, when one runs."""
    return next((s["num_steps"] for s in specs if s and s["method"] == "ngram"), default)


def _pool_tokens(prompts: list[list[int]], args: argparse.Namespace, slots: int, batch: int) -> int:
    """KV slots for the largest batch with every request at full length (draft slots and page
    rounding included): engines share the GPU, so none may size its pool from free memory and
    starve the next."""
    longest = max(len(p) for p in prompts)
    new = max(args.max_new_tokens, WARMUP_TOKENS)  # the warm-up's requests too
    return batch * (longest + new + slots + 1 + 2 * args.page_size)


def _engine(
    args: argparse.Namespace,
    loaded,
    speculative: dict | None,
    max_batch: int,
    pool: int,
    decode_steps: int | None = None,
):
    from specserve import LLM

    return LLM(
        loaded,
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        attention_backend=args.attention_backend,
        max_total_tokens=pool,
        max_running_requests=max_batch,
        max_batched_tokens=8192,
        speculative=speculative,
        decode_steps=decode_steps,
    )


def _row(
    system: str,
    batch: int,
    new_tokens: int,
    seconds: float,
    accept: float | None = None,
    step_ms: dict[str, float] | None = None,
    tiers: dict[str, int] | None = None,
    adaptive: dict | None = None,
    batches: int = 1,
    repeats: list[float] | None = None,
) -> BenchRow:
    tokens_per_s = batches * batch * new_tokens / seconds
    return BenchRow(
        system, batch, new_tokens, seconds, tokens_per_s, accept, step_ms, tiers, adaptive, batches, repeats
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch_count(batch_size: int, args: argparse.Namespace) -> int:
    return max(-(-args.min_prompts // batch_size), args.min_batches)


def _time_engine(
    llm, batches: list[list[list[int]]], new_tokens: int, temperature: float = 0.0
) -> tuple[float, float | None, dict[str, float], dict[str, int] | None, dict | None]:
    """Seconds of one run (the batches one after another), its accept length (None without
    speculation), host ms per step by phase, and with adaptive speculation the steps each tier ran
    and the policy's diagnostics after the run. The adaptive policy keeps what it learnt from run to
    run, as a server would."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=temperature, ignore_eos=True)
    adaptive = llm.engine.adaptive
    before = dict(adaptive.tier_steps) if adaptive is not None else {}
    llm.engine.flush_cache()  # no prefix reuse between runs
    phases = PhaseTotals()
    llm.engine.attach_stats_sink(phases)
    _sync(llm.engine.device)
    start = time.perf_counter()
    try:
        outs = [out for batch in batches for out in llm.generate(batch, params)]
        _sync(llm.engine.device)
    finally:
        llm.engine.stats_sink = None
    seconds = time.perf_counter() - start
    assert all(len(o.token_ids) == new_tokens for o in outs)
    # Tokens a verify step emitted (its accepted drafts and one more): counting every output token
    # instead put an adaptive engine's plain steps' tokens over its verify steps (accept 15 of 8).
    verify_steps = sum(o.meta.get("spec_verify_ct", 0) for o in outs)
    accepted = sum(o.meta.get("spec_accepted_tokens", 0) for o in outs)
    accept = (accepted + verify_steps) / verify_steps if verify_steps else None
    if adaptive is None:
        return seconds, accept, phases.ms_per_step(), None, None
    tiers = {t.name: n - before.get(t, 0) for t, n in sorted(adaptive.tier_steps.items())}
    used = {name: n for name, n in tiers.items() if n}
    return seconds, accept, phases.ms_per_step(), used, adaptive.diagnostics(len(batches[0]))


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
    model,
    llm,
    prompts: list[list[int]],
    new_tokens: int,
    prompt_lookup: int | None = None,
    temperature: float = 0.0,
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
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_p=None,
            top_k=None,
            pad_token_id=pad,
            **extra,
        )
    _sync(llm.engine.device)
    assert out.shape[1] == width + new_tokens
    return time.perf_counter() - start


def _table(rows: list[BenchRow]) -> tuple[list[str], list[list[str]]]:
    """One line per run; the last column is each run's speed over plain specserve at that batch size."""
    plain = {r.batch_size: r.tokens_per_s for r in rows if r.system == PLAIN}
    header = [
        "system",
        "batch",
        "new tok",
        "seconds",
        "tok/s",
        "accept len",
        "x plain",
        "ms/step (draft/target)",
        "steps per tier",
    ]
    body = [
        [
            r.system,
            str(r.batch_size),
            str(r.new_tokens),
            f"{r.seconds:.2f}",
            f"{r.tokens_per_s:.1f}",
            f"{r.accept_length:.2f}" if r.accept_length else "-",
            f"{r.tokens_per_s / plain[r.batch_size]:.2f}",
            _step_cell(r.step_ms),
            " ".join(f"{name}:{n}" for name, n in r.tier_steps.items()) if r.tier_steps else "-",
        ]
        for r in rows
    ]
    return header, body


def _adaptive_lines(rows: list[BenchRow]) -> list[str]:
    """One line per adaptive run: the policy's step ms per tier beside the mean ms of its steady
    steps (what prices it) and of its transitions (probes, first steps after plain ones; settles
    left out), with their counts; pooled acceptance per position, probes (won), the switches at
    the batch and what one costs there, predicted vs
    measured goodput, each tier's made/promised tokens: why it chose what it did."""
    lines = []
    for r in rows:
        d = r.adaptive
        if not d:
            continue
        cost = " ".join(_cost_cell(d, name, ms) for name, ms in d["step_ms"].items())
        accept = " ".join(f"{a:.2f}" for a in next(iter(d["pooled_acceptance"].values()), []))
        lines.append(
            f"adaptive {r.system} b{r.batch_size}: now {d['current']}; ms/step at b{d['batch']} "
            f"(predicted/steady/transitions (steps)) {cost}; accept/pos {accept}; "
            f"probes {d['probes_won']}/{d['probes']} won (every {d['probe_interval']}); "
            f"switches {d.get('switches_at_batch', 0)} (a switch {d.get('switch_ms', 0.0):.2f} ms); "
            f"goodput pred {d['predicted_goodput']:,.0f} meas {d['measured_goodput']:,.0f} tok/s"
            + (f"; made/promised {_corrections(d['calibration'])}" if d.get("calibration") else "")
        )
    return lines


def _corrections(calibration: dict[str, float]) -> str:
    """`TIER@BATCH:RATIO ...`: each tier's tokens made over those its predictions promised."""
    return " ".join(f"{key}:{ratio:.2f}" for key, ratio in calibration.items())


def _cost_cell(d: dict, name: str, ms: float) -> str:
    """`NAME:PREDICTED/STEADY/TRANSITIONS (STEADY STEPS/TRANSITION STEPS)`, `-` where none ran."""
    steady, transition = d.get("steady_step_ms", {}), d.get("transition_step_ms", {})
    if name not in steady and name not in transition:
        return f"{name}:{ms:.2f}"
    seen = "/".join(f"{kept[name]:.2f}" if name in kept else "-" for kept in (steady, transition))
    counts = "/".join(str(d.get(key, {}).get(name, 0)) for key in ("steady_steps", "transition_steps"))
    return f"{name}:{ms:.2f}/{seen} ({counts})"


def _step_cell(step_ms: dict[str, float] | None) -> str:
    """A step's host ms, with its draft and target phases (`-` for a peer, which has no steps)."""
    if not step_ms or "step" not in step_ms:
        return "-"
    return f"{step_ms['step']:.2f} ({step_ms.get('draft', 0.0):.2f}/{step_ms.get('target', 0.0):.2f})"
