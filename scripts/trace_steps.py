"""Where a bench run's wall time goes, engine step by engine step.

Builds engines as `specserve bench offline` does (one model load, the bench's pool and batch
settings), runs TRACE_PROMPTS (default 1) batches of TRACE_BATCH (default 1) prompts each, 256 new
tokens, greedy, EOS ignored, and times every `Engine.step` on the host. Each step gets a kind:

- `prefill`: a request still had prompt tokens to compute;
- `loop-first`: the device loop launched a run and settled none (the host returns at once);
- `loop`: a run was settled (with or without the next one queued: `loop-last` when none was);
- `sync`: the synchronous path (plain decode, or a speculative step drafted on the host).

Prints per system the bench's tok/s, then the time and count per kind and its host phases summed (a loop
step's `target` is its wait for the device: what is left is host work; with adaptive speculation,
per kind and tier: `loop@3`, `sync@off`), and the gaps between steps; then, per chain length, what a
loop iteration cost against the requests' mean context (runs queued behind the one before: their
step's wall over their iterations; a least-squares line and the means by context quartile). The
collector is frozen after the warm-up, as the bench does.
TRACE_PROFILE=N also prints, for each system's first traced run, where the host spent its first N
steps (cProfile, top functions by cumulative time); TRACE_TORCH=N the same steps under the torch
profiler (operators by host time and by device time, so a slow step shows whether it waits on the
device or the host).

TRACE_CARRY=4,0 runs every batch once per share (`device_loop.CARRY_SHARE`: a chain of runs goes on
over finished requests' rows while more than 1/share of them run; 0 never), on the same engine.

TRACE_DATA names the data set (default mt-bench) or a prompts file, as `specserve bench --dataset`.

TRACE_SEQ=1 prints, for every traced run, its steps in order, run-length encoded as
kind@tier[running requests], and the adaptive policy's calibrated scores wherever its standing tier
changed (the first step of a row of plain steps while the tier stands is a plain-price probe,
`AdaptivePolicy._probe_off`, not a switch). TRACE_SCORES_EVERY=N adds the scores every N steps while
a tier stands, with each tier's step price in ms (why a tier held: issue 9's batch-64 off stint), its
uncorrected scores, the corrections, the pool's acceptance and each loop width's gap over its profile
at the batch (ms at a mean context, its slope per context token, its steady steps; TRACE_GAP_SAMPLES=1:
the kept samples, ms / gap ms / context). TRACE_STEP_MS=N prints each traced run's first N steps:
wall, the wait for the device (a loop step's "target") and the host's phases (read before
`Engine._end_step` starts the next step's stats: the per-kind phases printed nothing before).

    TRACE_SPECS="ngram:12;eagle3:3:HEAD;eagle3:5:HEAD" python3 -P scripts/trace_steps.py
"""

import argparse
import cProfile
import faulthandler
import gc
import os
import pstats
import time
from collections import defaultdict

import torch

from specserve import bench
from specserve.bench_data import prompt_texts
from specserve.cli_spec_args import parse_spec, spec_name
from specserve.engine import device_loop
from specserve.engine.adaptive_control import context_tokens
from specserve.model.loader import load_model
from specserve.model.tokenizer import chat_prompt_ids
from specserve.types import SamplingParams

SPECS = [s for s in os.environ.get("TRACE_SPECS", "ngram:12").split(";") if s]
PROMPTS = int(os.environ.get("TRACE_PROMPTS", "1"))
BATCH = int(os.environ.get("TRACE_BATCH", "1"))
TOKENS = int(os.environ.get("TRACE_TOKENS", "256"))
PROFILE_STEPS = int(os.environ.get("TRACE_PROFILE", "0"))
TORCH_STEPS = int(os.environ.get("TRACE_TORCH", "0"))
RUNS = int(os.environ.get("TRACE_RUNS", "2"))
SLOW_MS = float(os.environ.get("TRACE_SLOW_MS", "0"))
DATA = os.environ.get("TRACE_DATA", "mt-bench")
PRELUDE = [int(b) for b in os.environ.get("TRACE_PRELUDE", "").split(",") if b]
CARRY = [int(b) for b in os.environ.get("TRACE_CARRY", "").split(",") if b] or [device_loop.CARRY_SHARE]
SEQUENCE = os.environ.get("TRACE_SEQ", "0") != "0"
SCORES_EVERY = int(os.environ.get("TRACE_SCORES_EVERY", "0"))  # with TRACE_SEQ: scores while a tier stands
STEP_MS = int(os.environ.get("TRACE_STEP_MS", "0"))  # each of a run's first N steps: wall, device wait, host


# (mean context, seconds per iteration) of every loop run queued behind the one before, by chain length
ITERATIONS: dict[int, list[tuple[float, float]]] = defaultdict(list)
ACTIVITIES = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]


def _kind(engine, flight_before: bool, flight_after: bool) -> str:
    if any(not r.decoding for r in engine.scheduler.running) or engine.scheduler.waiting:
        return "prefill"
    if flight_before:
        return "loop" if flight_after else "loop-last"
    return "loop-first" if flight_after else "sync"


def _run_lengths(items: list[str]) -> str:
    out: list[list] = []
    for item in items:
        if out and out[-1][0] == item:
            out[-1][1] += 1
        else:
            out.append([item, 1])
    return " ".join(f"{item}x{n}" if n > 1 else item for item, n in out)


def _note_switch(policy, step: int, notes: list[str]) -> None:
    """Where the policy's standing tier changed (and every SCORES_EVERY steps while it stands): its
    calibrated scores (tokens/s) then, and with SCORES_EVERY each tier's step price (ms)."""
    current = policy.current.name if policy.current is not None else "-"
    changed = getattr(policy, "_traced_current", None) != current
    if not changed and not (SCORES_EVERY and step % SCORES_EVERY == 0):
        return
    policy._traced_current = current
    scored = policy._scored
    scores = policy._calibrated(scored) if scored is not None else {}
    cells = " ".join(f"{t.name}:{v:,.0f}" for t, v in sorted(scores.items()))
    how = "now" if changed else "still"
    note = f"  step {step}: {how} {current} at batch {policy.last_batch}; scores {cells}"
    if SCORES_EVERY and policy.last_batch:
        prices = " ".join(
            f"{t.name}:{policy.step_seconds(t, policy.last_batch) * 1e3:.2f}" for t in policy.tiers
        )
        note += f"; ms a step {prices}"
        if scored is not None and policy.calibration is not None:
            factors = policy.calibration.factors(policy._speculative, len(scored.ids))
            note += "; raw " + " ".join(f"{t.name}:{v:,.0f}" for t, v in sorted(scored.score.items()))
            note += "; x " + " ".join(f"{t.name}:{f:.3f}" for t, f in sorted(factors.items()))
        gaps = [
            f"w{w}:{g.gap * 1e3:.3f}@{g.context:.0f}/{g.slope * 1e6:.2f}us/{g.steps}"
            for (kind, w), row in sorted(policy.costs._loop_gap.items())
            for b, g in row.items()
            if kind == "verify" and b == policy.last_batch
        ]
        note += f"; context {policy.costs.context:.0f}; gaps " + " ".join(gaps)
        if os.environ.get("TRACE_GAP_SAMPLES"):  # each width's kept (ms, gap ms, context) at the batch
            for (kind, w, b), kept in sorted(policy.costs._loop_gaps.items()):
                if kind == "verify" and b == policy.last_batch:
                    cells = " ".join(f"{t * 1e3:.2f}/{g * 1e3:.2f}/{c:.0f}" for t, g, c in kept)
                    note += f"\n      w{w} samples {cells}"
        pooled = policy.acceptance.pooled(1)[:3] if any(t.topk == 1 for t in policy.tiers) else []
        note += "; accept " + " ".join(f"{r:.3f}" for r in pooled)
    notes.append(note)


def context_fit(samples: list[tuple[float, float]]) -> str:
    """ms per loop iteration against the requests' mean context: a least-squares line, and by quartile."""
    if len(samples) < 4:
        return f"{len(samples)} samples"
    xs, ys = [c for c, _ in samples], [s * 1e3 for _, s in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / spread if spread else 0.0
    order = sorted(samples)
    q = len(order) // 4 or 1
    bins = [order[i : i + q] for i in range(0, len(order), q)][:4]
    cells = " ".join(
        f"{sum(c for c, _ in b) / len(b):.0f}:{sum(s for _, s in b) / len(b) * 1e3:.3f}" for b in bins
    )
    return f"{len(samples)} runs, ms = {my - slope * mx:.3f} + {slope * 1e3:.4f}/1k tokens x context; by context {cells}"


def traced_run(
    llm, prompts: list[list[int]], profile: int = 0, torch_steps: int = 0
) -> tuple[float, dict, list[float], list[int], dict]:
    engine = llm.engine
    times: dict[str, list[float]] = defaultdict(list)
    # a profiled run's steps are slower by the profiler's overhead (cProfile made a 1-chain's
    # iterations at batch 64 look 3 ms against 1.4): only unprofiled runs feed the fits
    per_iter = ITERATIONS if not (profile or torch_steps) else defaultdict(list)
    stamps: list[tuple[float, float]] = []
    sequence: list[str] = []  # TRACE_SEQ: each step's kind@tier[running requests]
    phases: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # kind -> phase -> s
    notes: list[str] = []  # TRACE_SEQ: the policy's scores where its standing tier changed
    original = engine.step
    profiler = cProfile.Profile() if profile else None
    last_phases: dict[str, float] = {}  # the step's phases, read before `_end_step` resets them
    lines: list[str] = []  # TRACE_STEP_MS
    end_step = engine._end_step

    def kept_end_step(outputs):
        last_phases.clear()
        last_phases.update(engine._stats.phases)
        return end_step(outputs)

    engine._end_step = kept_end_step

    def step():
        before = engine._loop_flight is not None
        kind = _kind(engine, before, False)
        profiling = profiler is not None and len(stamps) < profile
        start = time.perf_counter()
        if len(stamps) < torch_steps:
            with torch.profiler.profile(activities=ACTIVITIES) as prof:
                out = original()
                torch.cuda.synchronize()
            tier = engine.adaptive.tier.name if engine.adaptive is not None else "-"
            ms = (time.perf_counter() - start) * 1e3
            print(
                f"\n### step {len(stamps)} ({kind}, tier {tier}, {ms:.1f} ms profiled) under the torch profiler"
            )
            for key in ("self_cpu_time_total", "self_device_time_total"):
                print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))
        else:
            if SLOW_MS:
                faulthandler.dump_traceback_later(SLOW_MS / 1e3)
            out = profiler.runcall(original) if profiling else original()
            if SLOW_MS:
                faulthandler.cancel_dump_traceback_later()
        end = time.perf_counter()
        if SLOW_MS and (end - start) * 1e3 > SLOW_MS:
            tier = engine.adaptive.tier.name if engine.adaptive is not None else "-"
            print(f"slow step {len(stamps)}: {(end - start) * 1e3:.1f} ms, tier {tier}", flush=True)
        if kind != "prefill":
            kind = _kind(engine, before, engine._loop_flight is not None)
        if engine.adaptive is not None:  # which tier each kind of step ran
            kind = f"{kind}@{engine.adaptive.tier.name}"
            if SEQUENCE:
                sequence.append(f"{kind}[{len(engine.scheduler.running)}]")
                _note_switch(engine.adaptive.policy, len(stamps), notes)
        times[kind].append(end - start)
        for phase, seconds in last_phases.items():  # the loop's wait for the device: "target"
            phases[kind][phase] += seconds
        if len(stamps) < STEP_MS:
            wait = last_phases.get("target", 0.0)
            lines.append(
                f"  step {len(stamps)} {kind}[{len(engine.scheduler.running)}]: {(end - start) * 1e3:.2f} ms, "
                f"device wait {wait * 1e3:.2f}, host {(end - start - wait) * 1e3:.2f} ("
                + " ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(last_phases.items()) if k != "target")
                + ")"
            )
        stamps.append((start, end))
        return out

    settled = []
    settle = engine._loop_settle

    def seen_settle(flight, chained):
        settled.append(flight)
        return settle(flight, chained)

    engine._loop_settle = seen_settle

    def timed_step():
        count = len(settled)
        start = time.perf_counter()
        out = step()
        seconds = time.perf_counter() - start
        if (
            len(settled) > count and settled[-1].resumed
        ):  # a run queued behind the one before: its device time
            flight = settled[-1]
            context = context_tokens(flight.reqs)
            per_iter[flight.loop.num_steps].append((context, seconds / flight.steps))
        return out

    engine.step = timed_step
    planned = []
    launch = engine._loop_launch

    def counted_launch(flight):
        new = launch(flight)
        if new is not None:
            planned.append(new.steps)
        return new

    engine._loop_launch = counted_launch
    params = SamplingParams(max_new_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    engine.flush_cache()
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    engine.step = original
    del engine._end_step
    if lines:
        print("\n".join(lines))
    del engine._loop_launch
    del engine._loop_settle
    if planned:  # launched loop iterations (against the verifies that made tokens)
        times["planned iterations"] = [0.0] * sum(planned)
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    if sequence:
        print("steps: " + _run_lengths(sequence))
        print("\n".join(notes))
    gaps = [b[0] - a[1] for a, b in zip(stamps[:-1], stamps[1:], strict=True)]
    verifies = [o.meta.get("spec_verify_ct", 0) for o in outs]
    return wall, times, [stamps[0][0] - start, stamps[-1][1] - start - wall] + gaps, verifies, phases


def report(name: str, p: int, batch: list, run: tuple[float, dict, list[float], list[int], dict]) -> None:
    wall, times, gaps, verifies, phases = run
    tokens, total = TOKENS * len(batch), sum(verifies)
    print(
        f"\n## {name} prompt {p} batch {len(batch)}: {tokens / wall:,.0f} tok/s, "
        f"wall {wall * 1e3:.1f} ms, {total} verifies ({tokens / max(1, total):.2f} tokens each; "
        f"a request's: {min(verifies)} to {max(verifies)}, the slowest's sets the batch's end)"
    )
    for kind, ts in sorted(times.items()):
        print(
            f"  {kind:11s} {len(ts):4d} steps {sum(ts) * 1e3:8.2f} ms  (mean {sum(ts) / len(ts) * 1e3:.3f})"
        )
        if kind in phases:  # its steps' host phases; in a loop step "target" is the wait for the device
            cells = " ".join(
                f"{phase} {seconds * 1e3:.2f}" for phase, seconds in sorted(phases[kind].items())
            )
            print(f"    ms by phase: {cells}")
    print(
        f"  before first step {gaps[0] * 1e3:.2f} ms, after last {gaps[1] * 1e3:.2f} ms, "
        f"between steps {sum(gaps[2:]) * 1e3:.2f} ms over {len(gaps) - 2}"
    )


def main() -> None:
    loaded = load_model("smollm2-135m-instruct", torch.device("cuda"), torch.bfloat16)
    texts = prompt_texts(DATA, seed=0)
    chats = [chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": t}]) for t in texts]
    specs = [None] + [parse_spec(s) for s in SPECS]
    args = argparse.Namespace(
        device="cuda", dtype="bfloat16", page_size=16, attention_backend="auto", max_new_tokens=TOKENS
    )
    if len(chats) < PROMPTS * BATCH:
        raise SystemExit(f"TRACE_PROMPTS x TRACE_BATCH: {PROMPTS} x {BATCH} prompts, {DATA} has {len(chats)}")
    pool = bench._pool_tokens(chats[:64], args, 16, 64)
    for spec in specs:
        llm = bench._engine(args, loaded, spec, 64, pool)
        llm.generate(chats[:2], SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
        gc.collect()
        gc.freeze()  # as the bench does: the collector never walks the load in a timed run
        for b in PRELUDE:
            llm.generate(chats[:b], SamplingParams(max_new_tokens=TOKENS, temperature=0.0, ignore_eos=True))
        totals: dict[str, float] = defaultdict(float)
        for p in range(PROMPTS):
            batch = chats[p * BATCH : (p + 1) * BATCH]
            for share in CARRY if spec is not None else CARRY[:1]:
                device_loop.CARRY_SHARE = share
                name = spec_name(spec) + (f" carry {share}" if len(CARRY) > 1 else "")
                runs = [traced_run(llm, batch) for _ in range(RUNS)]
                print(f"{name} runs (ms): " + " ".join(f"{r[0] * 1e3:.0f}" for r in runs), flush=True)
                if (PROFILE_STEPS or TORCH_STEPS) and p == 0:
                    traced_run(llm, batch, PROFILE_STEPS, TORCH_STEPS)
                best = min(runs, key=lambda r: r[0])
                totals[name] += best[0]
                report(name, p, batch, best)
        for name, wall in totals.items():
            print(f"total {name}: {wall * 1e3:.1f} ms over {PROMPTS} batches (each its fastest run)")
        for depth, samples in sorted(ITERATIONS.items()):
            print(f"  loop iterations, chain {depth}: {context_fit(samples)}")
        ITERATIONS.clear()
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
