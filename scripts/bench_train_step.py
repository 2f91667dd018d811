"""Cost of one draft-head training step: wall time and aten ops dispatched, by phase (the target's
pass, the head's unrolled forward with its losses, backward, clipping + AdamW).

    # the real target (op counts as on the GPU with --autocast; CPU time is the matmuls')
    python scripts/bench_train_step.py --responses OUT/responses.npz --tokens-per-batch 2048
    # SmolLM2-135M's layout (30 layers, 9/3 heads) at tiny widths and a 1k vocabulary, random
    # samples: the same ops as the real target, each nearly free, so the time is the host's
    OMP_NUM_THREADS=1 python scripts/bench_train_step.py --mini --tokens-per-batch 2048
    # on the GPU: where a step's time goes (host- or device-bound; kernels by device time)
    python3 -P scripts/bench_train_step.py --responses R --device cuda --tokens-per-batch 32768 --profile

The op count is the host's work: each aten op is a Python -> C++ dispatch (plus an autograd node
when it records one), which is what bounds a step of a small head on a fast GPU. `--autocast`
counts under bf16 autocast as on CUDA (the casts it adds are ops too). `--top N` lists the N most
frequent ops. Under `--compile` the count is not meaningful (a dispatch mode sends compiled code
back to eager); the time is. On a shared CPU, OMP_NUM_THREADS=1 keeps OpenMP threads from spinning against other
processes (which made tiny ops take milliseconds).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specserve.model.loader import load_model
from specserve.train import unroll as unroll_module
from specserve.train.data import Samples, load_all
from specserve.train.dataset import epoch_batches, make_batch
from specserve.train.trainer import TrainConfig, compile_head, new_head
from specserve.train.unroll import unrolled_loss

PHASES = ("target", "head forward", "backward", "optimizer")
# aten ops that copy a device value to the host (a tensor's item, a data-dependent shape), so the
# host waits for every queued kernel: the GPU then idles while the host catches up.
SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "item")


class OpCounter(TorchDispatchMode):
    """aten ops dispatched, per phase (`phase` is set from outside)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = PHASES[0]
        self.counts: dict[str, collections.Counter[str]] = {p: collections.Counter() for p in PHASES}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.phase][str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def mini_target(folder: Path) -> Path:
    """A random Llama with SmolLM2-135M's layout (30 layers, 9 query / 3 KV heads, tied lm_head) at
    tiny widths (head_dim 8, MLP 64, vocabulary 1024)."""
    if (folder / "config.json").exists():
        return folder
    from transformers import LlamaConfig, LlamaForCausalLM

    from specserve.assets import pull
    from specserve.model.tokenizer import load_tokenizer

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=72,
        intermediate_size=64,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    load_tokenizer(pull("smollm2-135m-instruct")).save_pretrained(folder)
    return folder


def random_samples(count: int, vocab: int, seed: int = 0) -> Samples:
    """Short chat-like samples (prompts of 16-64 tokens, answers of 32-160), so that attention stays
    cheap on a CPU and the step's time is mostly the host's."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(16, 64, count)
    lengths = prompts + rng.integers(32, 160, count)
    tokens = rng.integers(3, vocab, int(lengths.sum())).astype(np.int32)
    return Samples(tokens, lengths.astype(np.int64), prompts.astype(np.int64), np.arange(count))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--mini", action="store_true", help="SmolLM2-135M's layout at tiny widths")
    p.add_argument("--responses", help="samples (default with --mini: random ones)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="the target's dtype")
    p.add_argument("--method", default="eagle3")
    p.add_argument("--unroll", type=int, default=6)
    p.add_argument("--tokens-per-batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6, help="timed steps (after one warm-up step)")
    p.add_argument("--autocast", action="store_true", help="bf16 autocast (always on for CUDA)")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--compile", action="store_true", help="torch.compile the step modules (--compile)")
    p.add_argument(
        "--profile", action="store_true", help="one more step under the torch profiler: ops by device time"
    )
    args = p.parse_args()

    device = torch.device(args.device)
    target = str(mini_target(Path("/tmp/specserve-mini-smollm2"))) if args.mini else args.target
    loaded = load_model(target, device, getattr(torch, args.dtype))
    loaded.model.requires_grad_(False)
    if args.responses:
        samples = load_all([args.responses])
    else:
        samples = random_samples(256, loaded.arch.vocab_size)
    cfg = TrainConfig(
        method=args.method, steps=args.unroll, tokens_per_batch=args.tokens_per_batch, max_steps=1
    )
    head = new_head(loaded, cfg, device)
    head.train()
    if args.compile:
        compile_head(head)
    params = [q for q in head.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    indices = epoch_batches(samples, cfg.tokens_per_batch, cfg.max_len, 0, 0)
    batches = [make_batch(samples, i, cfg.max_len, device) for i in indices[: args.steps + 1]]
    use_autocast = args.autocast or device.type == "cuda"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast)
    counter: OpCounter | None = None
    target_pass = unroll_module.target_pass

    def counted_target_pass(*a, **k):
        if counter is not None:
            counter.phase = "target"
        out = target_pass(*a, **k)
        if counter is not None:
            counter.phase = "head forward"
        return out

    unroll_module.target_pass = counted_target_pass

    def step(batch) -> None:
        with autocast:
            result = unrolled_loss(head, loaded.model, batch, cfg.steps, cfg.decay)
        if counter is not None:
            counter.phase = "backward"
        optimizer.zero_grad(set_to_none=True)
        result.loss.backward()
        if counter is not None:
            counter.phase = "optimizer"
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for batch in batches[:3] if args.compile else batches[:1]:  # warm-up (allocator; compiles)
        step(batch)
    counter = OpCounter()
    with counter:
        step(batches[0])
    counted, counter = counter, None
    walls, cpus = [], []
    for i in range(args.steps):
        batch = batches[1 + i % (len(batches) - 1)] if len(batches) > 1 else batches[0]
        sync()
        wall, cpu = time.perf_counter(), time.process_time()
        step(batch)
        sync()
        walls.append((time.perf_counter() - wall) * 1e3)
        cpus.append((time.process_time() - cpu) * 1e3)
    b = batches[0]
    print(
        f"target {target}; batch 0: {tuple(b.ids.shape)} ({b.tokens} real tokens); "
        f"unroll {cfg.steps}; autocast {use_autocast}; torch threads {torch.get_num_threads()}"
    )
    total = collections.Counter()
    for phase in PHASES:
        total.update(counted.counts[phase])
    print(
        f"aten ops per step: {sum(total.values())} ("
        + ", ".join(f"{p} {sum(counted.counts[p].values())}" for p in PHASES)
        + ")"
    )
    # (AdamW's own item() calls read its step counts, which live on the CPU: left out.)
    forward_backward = sum((counted.counts[p] for p in PHASES[:3]), collections.Counter())
    syncing = {n: forward_backward[n] for n in SYNCING if forward_backward[n]}
    print(f"ops that wait for the device on CUDA (forward + backward): {sum(syncing.values())} {syncing}")
    for phase in ("head forward", "backward"):
        print(f"  {phase}: " + ", ".join(f"{n} {c}" for n, c in counted.counts[phase].most_common(args.top)))
    print(
        f"ms per step over {args.steps} steps: wall median {statistics.median(walls):.1f} "
        f"(min {min(walls):.1f}), process CPU median {statistics.median(cpus):.1f} (min {min(cpus):.1f})"
    )
    if args.profile:
        _profiled(lambda: (step(batches[-1]), sync()), device, args.top)


def _profiled(run, device: torch.device, top: int) -> None:
    """One step under the torch profiler: its wall time beside the device's busy time (a step whose
    kernels add up to much less than its wall is bound by the host), and the ops by device time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        run()
    wall = (time.perf_counter() - start) * 1e3
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    busy = sum(getattr(e, key) for e in events) / 1e3
    print(
        f"profiled step: wall {wall:.1f} ms (under the profiler), {'device' if cuda else 'CPU'} busy {busy:.1f} ms"
    )
    print(events.table(sort_by=key, row_limit=top))


if __name__ == "__main__":
    main()
