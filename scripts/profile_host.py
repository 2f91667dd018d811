"""The host (CPU/Python) cost of the engine loop, per request and step, on the CPU.

The real engine runs a tiny random-weight Llama that has the default model's vocabulary and
tokenizer (so detokenisation is real) at batch 64 for a few hundred decode steps. The forward and the
sampling kernels (what a GPU runs while the host works) are timed apart and left out; what remains is
the host's share of a step, split by phase and divided by the batch: scheduling, input building, the
rest of the launch (sampling rows, bookkeeping), settling (tokens, detokenisation, stop checks,
outputs), the end of the step (stats, metrics sink) and the caller's loop. With `--cprofile` the
same steps run again under cProfile and its top entries are printed (by own time, or by
`PROFILE_SORT`, e.g. cumulative; `PROFILE_FILTER`: a regex of the paths to print). `--count`: host-to-device copies and the engine's
`.tolist()` reads (host syncs on a GPU) per step.

By default the lm_head scores only the first `--logit-vocab` ids (the tokens drawn are real
tokens of the vocabulary all the same): on the CPU a full vocabulary means 12 MB of logits written
and read again by the argmax every step, which evicts the caches between the host phases and makes
every one of them read 3-5x slower than on a GPU host, where that work runs on the device.
`--logit-vocab 0` keeps the full vocabulary.

With `--adaptive` the engine runs adaptive n-gram speculation (tiers off, 1, 2, 4, 8) over text no
drafter predicts (every lookup finds nothing), so the policy stays off: the figures are the policy's
host cost on the off path (deciding, bookkeeping, probes) beside plain decoding's; the phase
`adaptive` is what its own calls cost, and the steps each tier ran are printed. Where the CPU's cost
tables leave no tier able to win whatever the acceptance (the policy's `_hopeless`), the policy
stays off without scoring the batch; on the H100 at batch 16 and 64 a tier could (were every draft
accepted) and the policy scores: `--score` makes it do so here too, which is the figure to compare.

With `--spec ngram:N` or `--spec eagle3:N` the engine speculates with a chain of N drafts (n-gram
lookup, or a seeded random EAGLE-3 head whose draft vocabulary is the `--logit-vocab` ids the target
scores) through the bucketed static-buffer path the GPU captures as CUDA graphs (run eagerly here):
the figures are per step, by phase (drafting, verify, the draft extend, postprocess, ...), with the
forwards of the target and the head (on the GPU: graph replays) and the sampling kernels left out.
A random target and head accept little (the accept length is printed); the fixed cost of a step is
what this measures. `under the forward` is host work a step does after launching its forward and
before waiting for it (`Engine._while_device_works`), hidden on a GPU: `HOST EXPOSED` leaves it out.
Requests are aborted, not finished: the detokenising of requests nobody streams, which the engine
does under the forward as it goes, used to wait for their end and is not in the earlier figures.

    python scripts/profile_host.py [--batch 64] [--steps 300] [--stop] [--server] [--cprofile 30]
        [--adaptive] [--spec ngram:5|eagle3:5]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

import specserve.engine.engine as engine_module
import specserve.spec.verify as verify_module
from specserve import LLM, SamplingParams
from specserve.assets import dataset_path, pull
from specserve.engine.scheduler import Scheduler
from specserve.model.head_checkpoint import random_head, save_head
from specserve.model.loader import load_model
from specserve.model.tokenizer import chat_prompt_ids, load_tokenizer
from specserve.spec.head_drafter import HeadDrafter


def tiny_model(folder: Path, tokenizer=None, layers: int = 1):
    """A `layers`-layer, 16-wide random Llama saved in `folder` and loaded (CPU, fp32), with SmolLM2's
    tokenizer unless given another: its forward costs next to nothing beside the lm_head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tokenizer or load_tokenizer(pull("smollm2-135m-instruct"))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return load_model(str(folder), torch.device("cpu"), torch.float32)


# CPU time of this thread (the device work runs in it too, with one torch thread): time the machine
# gave to other processes is not counted, so a shared machine blurs the figures less.
clock = time.thread_time


class Timers:
    """Seconds per named phase, accumulated by wrapping the functions that own each phase (each
    phase's own time: a wrapped call inside another is its own phase, not the caller's); and the
    cyclic garbage collector's passes, whichever phase they interrupt."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.enabled = False
        self._gc_start = 0.0
        self._inner = [0.0]  # per open wrapped call: the time of the wrapped calls inside it
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = clock()
        elif self.enabled:
            self.seconds[f"gc:{info['generation']}"] += clock() - self._gc_start

    def wrap(self, owner, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.enabled:
                return original(*args, **kwargs)
            start = clock()
            self._inner.append(0.0)
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = clock() - start
                self.seconds[phase] += elapsed - self._inner.pop()
                self._inner[-1] += elapsed
                self.calls[phase] += 1

        setattr(owner, name, timed)


def instrument(llm: LLM, timers: Timers) -> None:
    engine = llm.engine
    timers.wrap(engine.runner, "execute", "device:forward")
    for name in ("sample", "greedy_tokens"):
        if hasattr(engine_module, name):
            timers.wrap(engine_module, name, "device:sample")
    if engine.drafter is not None and engine.adaptive is None:
        instrument_spec(engine, timers)
    timers.wrap(engine_module, "build_step_input", "build_input")
    timers.wrap(Scheduler, "schedule", "schedule")
    for name in ("_launch", "_settle_step", "_run_batch", "_end_step"):
        if hasattr(engine, name):
            timers.wrap(engine, name, name.strip("_"))
    if hasattr(engine, "_while_device_works"):  # host work done while a launched forward runs
        timers.wrap(engine, "_while_device_works", "under_forward")
    if engine.adaptive is not None:  # the policy's own calls (a probe's settle is `settle_step`'s)
        for name in ("decide", "observe_step", "observe_verify", "drafting"):
            timers.wrap(engine.adaptive, name, "adaptive")


def instrument_spec(engine, timers: Timers) -> None:
    """A speculative step's phases; the head's forwards (graph replays on the GPU) left out."""
    for name in ("sample", "greedy_tokens"):
        if hasattr(verify_module, name):
            timers.wrap(verify_module, name, "device:sample")
    for name, phase in (
        ("_propose_drafts", "draft"),
        ("_verify", "verify"),
        ("_postprocess", "postprocess"),
        ("_compact_accepted_paths", "verify"),
    ):
        timers.wrap(engine, name, phase)
    drafter = engine.drafter
    if isinstance(drafter, HeadDrafter):
        timers.wrap(drafter, "after_target", "extend")
        timers.wrap(drafter.head, "run", "device:draft")
        timers.wrap(drafter.head, "logits", "device:draft")
        if drafter.graphs is not None:
            timers.wrap(drafter.graphs, "chain_forward", "device:draft")
            timers.wrap(drafter.graphs, "_extend_forward", "device:draft")
            timers.wrap(drafter.graphs, "greedy_tokens", "device:draft")  # the seeds' top-1 kernel


def count_transfers(llm: LLM, steps: int) -> None:
    """Per step: host-to-device copies (`host_copy.to_device`) and the engine's `.tolist()` reads
    (each a host sync on a GPU; the kernels' torch references, which run inside graphs there, are
    left out), over `steps` steps."""
    import sys

    import specserve.engine.host_copy as host_copy

    counts: dict[str, int] = defaultdict(int)
    original_copy, original_read = host_copy.to_device, torch.Tensor.tolist

    def to_device(host, device):
        counts["host->device copies"] += 1
        return original_copy(host, device)

    def tolist(tensor):
        where = sys._getframe(1).f_code.co_filename
        if not any(part in where for part in ("specserve_kernels", "/attention/", "/model/")):
            counts[f"reads ({Path(where).name})"] += 1
        return original_read(tensor)

    modules = [m for name, m in list(sys.modules.items()) if name.startswith("specserve.")]
    patched = [m for m in modules if getattr(m, "to_device", None) is original_copy]
    for module in patched:
        module.to_device = to_device
    torch.Tensor.tolist = tolist
    try:
        run_steps(llm, steps)
    finally:
        torch.Tensor.tolist = original_read
        for module in patched:
            module.to_device = original_copy
    print("per step:", {name: round(n / steps, 2) for name, n in sorted(counts.items())})


def spec_config(spec: str, loaded, folder: Path, logit_vocab: int) -> dict:
    """The speculative config of `--spec METHOD:N`; an EAGLE-3 head is made (seeded, random) in
    `folder`, its draft vocabulary the first `logit_vocab` ids (those the target scores)."""
    method, _, steps = spec.partition(":")
    config = {"method": method, "num_steps": int(steps or 5)}
    if method == "eagle3":
        size = logit_vocab or loaded.arch.vocab_size
        head_config, tensors = random_head("eagle3", loaded.arch, seed=0, draft_vocab_size=size)
        if "d2t" in tensors:  # draft id i is target id i
            tensors["d2t"] = torch.zeros(size, dtype=torch.int64)
            tensors["t2d"] = torch.arange(loaded.arch.vocab_size) < size
        config["draft_model"] = str(save_head(folder, head_config, tensors))
    elif method != "ngram":
        raise SystemExit(f"--spec: ngram:N or eagle3:N, not {spec!r}")
    return config


def run_steps(llm: LLM, steps: int) -> None:
    """`steps` engine steps, their outputs consumed as `LLM.generate` consumes them."""
    engine, done = llm.engine, {}
    for _ in range(steps):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out


def start_batch(llm: LLM, prompts: list[list[int]], params: SamplingParams, stream: bool) -> list[str]:
    """Add the requests and step until every one is decoding (prefill done, first token out)."""
    add = llm.engine.add_request
    # The offline LLM reads only each request's last output; a server streams every step's.
    ids = [add(p, params) if stream else _add_offline(add, p, params) for p in prompts]
    reqs = [llm.engine._requests[i] for i in ids]
    while not all(r.num_output - r.num_pending >= 1 for r in reqs):
        llm.engine.step()
    return ids


def _add_offline(add, prompt: list[int], params: SamplingParams) -> str:
    try:
        return add(prompt, params, stream=False)
    except TypeError:  # an engine from before `stream` (the baseline): it streams every request
        return add(prompt, params)


def finish(llm: LLM, ids: list[str]) -> None:
    for request_id in ids:
        llm.engine.abort(request_id)
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine.check_kv_accounting()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300, help="decode steps timed")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs; each figure is its least")
    parser.add_argument("--stop", action="store_true", help="give every request two stop strings")
    parser.add_argument(
        "--server", action="store_true", help="as a server runs it: streamed requests, metrics sink"
    )
    parser.add_argument("--no-overlap", action="store_true", help="synchronous steps")
    parser.add_argument("--logit-vocab", type=int, default=2048, help="ids the lm_head scores (0: all)")
    parser.add_argument("--page-size", type=int, default=1, help="1: as the offline bench; serve: 16")
    parser.add_argument("--cprofile", type=int, default=0, help="top cProfile entries to print")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument(
        "--adaptive", action="store_true", help="adaptive n-gram speculation that finds no match: off"
    )
    parser.add_argument(
        "--score", action="store_true", help="with --adaptive: never take the off path that skips scoring"
    )
    parser.add_argument("--count", action="store_true", help="count host-device copies and reads per step")
    parser.add_argument("--spec", help="speculate: ngram:N or eagle3:N (a random head), a chain of N drafts")
    args = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        eagle3 = bool(args.spec) and args.spec.startswith("eagle3")
        loaded = tiny_model(Path(tmp) / "model", layers=4 if eagle3 else 1)
        speculative = None
        if args.adaptive:
            speculative = {"method": "ngram", "num_steps": 8, "adaptive": {"profile": False}}
        elif args.spec:
            speculative = spec_config(args.spec, loaded, Path(tmp) / "head", args.logit_vocab)
        llm = LLM(
            loaded,
            device="cpu",
            dtype="float32",
            # Speculation: the GPU's path (Triton backend, its torch references here; the static
            # buffers of CUDA graphs, run eagerly).
            attention_backend="triton" if args.spec else "torch",
            cuda_graphs=bool(args.spec),
            cuda_graph_max_batch=max(args.batch, 1),
            overlap_schedule=False if args.no_overlap else (None if args.adaptive or args.spec else True),
            page_size=args.page_size,
            max_running_requests=args.batch,
            max_total_tokens=args.batch * (2048 if args.spec else 1024),
            max_batched_tokens=8192,
            speculative=speculative,
        )
    if args.adaptive:  # text no drafter predicts: every probe verifies nothing
        llm.engine.drafter.propose = lambda token_ids, max_tokens: []
        policy = llm.engine.adaptive.policy
        if args.score and hasattr(policy, "_hopeless"):  # as the H100 runs it (see the docstring)
            policy._hopeless = lambda batch: False
    if args.logit_vocab:
        head = llm.engine.model.lm_head.weight[: args.logit_vocab].detach()
        llm.engine.model.compute_logits = lambda hidden: torch.nn.functional.linear(hidden, head).float()
    if args.server:
        from specserve.metrics import EngineMetrics

        llm.engine.attach_stats_sink(EngineMetrics("profile", "profile"))
    lines = dataset_path("mt-bench").read_text().splitlines()
    questions = [json.loads(line)["turns"][0] for line in lines if line.strip()]
    prompts = [chat_prompt_ids(llm.tokenizer, [{"role": "user", "content": q}]) for q in questions]
    prompts = (prompts * (args.batch // len(prompts) + 1))[: args.batch]
    params = SamplingParams(
        # A speculative step may emit num_steps + 1 tokens: no request may end while timed.
        max_new_tokens=(args.steps + 16) * (1 + (speculative or {}).get("num_steps", 0) if args.spec else 1),
        temperature=0.0,
        ignore_eos=True,
        stop=("<|im_end|>\n\n\n", "STOP HERE") if args.stop else (),
    )
    timers = Timers()
    instrument(llm, timers)
    gc.collect()
    gc.freeze()  # as the bench and the replicas do

    runs, tokens = [], 0
    for _ in range(args.repeats):
        ids = start_batch(llm, prompts, params, args.server)
        reqs = [llm.engine._requests[i] for i in ids]
        before = sum(r.num_output for r in reqs)
        timers.seconds.clear()
        timers.enabled = True
        start = clock()
        run_steps(llm, args.steps)
        wall = clock() - start
        timers.enabled = False
        tokens = sum(r.num_output for r in reqs) - before
        runs.append(phase_seconds(wall, dict(timers.seconds)))
        if llm.engine.adaptive is not None:
            print(
                "  steps per tier so far:",
                {t.name: n for t, n in sorted(llm.engine.adaptive.tier_steps.items())},
            )
        finish(llm, ids)
    # Each figure is its least over the runs (noise only ever adds).
    report(args, {k: min(run[k] for run in runs) for k in runs[0]}, tokens)

    if args.count:
        ids = start_batch(llm, prompts, params, args.server)
        count_transfers(llm, min(args.steps, 50))
        finish(llm, ids)

    if args.cprofile:
        ids = start_batch(llm, prompts, params, args.server)
        profiler = cProfile.Profile()
        profiler.enable()
        run_steps(llm, args.steps)
        profiler.disable()
        finish(llm, ids)
        stats = pstats.Stats(profiler).sort_stats(os.environ.get("PROFILE_SORT", "tottime"))
        # PROFILE_FILTER: a regex the printed entries' paths must match (e.g. specserve/).
        stats.print_stats(os.environ.get("PROFILE_FILTER", ""), args.cprofile)


def phase_seconds(wall: float, seconds: dict[str, float]) -> dict[str, float]:
    """Host seconds per phase of one timed run (device work taken out), and their total."""
    device = sum(v for k, v in seconds.items() if k.startswith("device:"))
    # Each phase's own time (`Timers`). Synchronous steps (all of them with --no-overlap or
    # speculation, an adaptive policy's probes): what is left of `run_batch` counts with the launches.
    phases = {
        "device (left out)": device,
        "schedule": seconds.get("schedule", 0.0),
        "build_input": seconds.get("build_input", 0.0),
        "launch (rest; sync steps)": seconds.get("launch", 0.0) + seconds.get("run_batch", 0.0),
        "settle/postprocess": seconds.get("settle_step", 0.0),
        "end_step (stats)": seconds.get("end_step", 0.0),
        "adaptive (policy calls)": seconds.get("adaptive", 0.0),
    }
    for name in ("draft", "verify", "extend", "postprocess"):  # speculative steps' phases
        if name in seconds:
            phases[f"spec: {name}"] = seconds[name]
    phases["settle/postprocess"] += phases.pop("spec: postprocess", 0.0)
    # Host work done after a forward is launched and before its results are waited for: on a GPU
    # it runs while the device works (a speculative step's only overlap).
    phases["under the forward"] = seconds.get("under_forward", 0.0)
    phases["other (step, caller loop)"] = wall - sum(phases.values())
    phases["HOST TOTAL"] = wall - device
    phases["HOST EXPOSED (sync steps)"] = phases["HOST TOTAL"] - phases["under the forward"]
    for generation in range(3):  # included in the phases above
        phases[f"  of which GC gen {generation}"] = seconds.get(f"gc:{generation}", 0.0)
    return phases


def report(args: argparse.Namespace, phases: dict[str, float], tokens: int) -> None:
    per = 1e6 / (args.steps * args.batch)  # seconds -> µs per request-step
    print(
        f"batch {args.batch}, {args.steps} decode steps, least of {args.repeats} runs; "
        f"overlap={not args.no_overlap and not args.spec} page_size={args.page_size} stop={args.stop} server={args.server} "
        f"logit_vocab={args.logit_vocab or 'all'} spec={args.spec} "
        f"tokens/request-step={tokens / (args.steps * args.batch):.2f}"
    )
    for name, value in phases.items():
        step = f"{value / args.steps * 1e6:9.1f} µs/step"
        if name.startswith("HOST"):
            print(
                f"  {name:<28}{value * per:8.2f} µs/request-step {step}  ({value / args.steps * 1e3:.3f} ms/step)"
            )
        else:
            print(f"  {name:<28}{value * per:8.2f} µs/request-step {step}")
    if args.json:
        Path(args.json).write_text(json.dumps({k: v * per for k, v in phases.items()}, indent=2))


if __name__ == "__main__":
    main()
