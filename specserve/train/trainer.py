"""Phase 2 of draft training: the loop. AdamW on the head's parameters (fp32 masters, bf16 autocast
on CUDA), warmup then cosine decay over the run's budget (steps or minutes, whichever ends first),
gradient clipping, a progress bar, a snapshot every `checkpoint_every` steps and at the end, and
the head folder exported beside it. Started again on the same `out`, it resumes from the snapshot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.model.draft_heads import DraftHead
from specserve.model.head_checkpoint import new_head_spec
from specserve.model.loader import LoadedModel
from specserve.train.checkpoint import (
    Progress,
    append_log,
    check_resumable,
    export_head,
    load_state,
    restore,
    save_state,
)
from specserve.train.data import Samples
from specserve.train.dataset import draft_vocabulary, epoch_batches, make_batch
from specserve.train.unroll import AnswerStart, unrolled_loss


@dataclass(frozen=True)
class TrainConfig:
    method: str = "eagle3"
    num_modules: int = 1  # MTP chain length k
    layers_per_module: int = 1  # EAGLE-1 / EAGLE-3 decoder layers
    intermediate_size: int | None = None  # the head's MLP width (None: the target's)
    draft_vocab: int | None = None  # EAGLE-3 reduced vocabulary (None: the target's lm_head)
    steps: int = 6  # chain steps unrolled per batch
    decay: float = 0.8  # step s's loss weighs decay**s
    start_weight: float = 1.0  # rows of an answer's first start_tokens weigh this (`AnswerStart`)
    start_tokens: int = 128
    hard_label: float = 0.0  # the target argmax's share in the labels (`unroll.sharpened`)
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    tokens_per_batch: int = 32768  # padded; peak GPU memory ~0.5-0.8 MB per token (docs/draft-training.md)
    max_len: int = 2048
    max_steps: int | None = None
    max_minutes: float | None = None
    checkpoint_every: int = 200
    log_every: int = 10
    save_dtype: str = "bfloat16"
    seed: int = 0
    compile: bool = False  # torch.compile the head's step modules (`compile_head`)
    init_from: str | None = None  # a head folder of the same shape to start from (not a resume)
    aux_layers: tuple[int, ...] | None = None  # EAGLE-3: the target layers fused (None: the default three)

    def __post_init__(self) -> None:
        if self.max_steps is None and self.max_minutes is None:
            raise ValueError("train: give max_steps or max_minutes (or both)")
        if not self.start_weight > 0 or self.start_tokens < 0:
            raise ValueError("train: start_weight must be > 0 and start_tokens >= 0")
        if not 0.0 <= self.hard_label <= 1.0:
            raise ValueError("train: hard_label must be in [0, 1]")

    def recipe(self, target: str) -> dict:
        return {**dataclasses.asdict(self), "target": target}


@dataclass(frozen=True)
class TrainResult:
    out: Path
    progress: Progress
    losses: tuple[float, ...]  # weighted total per step taken in this call
    last_step_losses: tuple[float, ...]
    last_step_accuracy: tuple[float, ...]


def new_head(loaded: LoadedModel, cfg: TrainConfig, device: torch.device) -> DraftHead:
    """A freshly initialised head (PyTorch's default init, norms at 1) bound to the target, fp32."""
    spec = new_head_spec(
        cfg.method,
        loaded.arch,
        num_modules=cfg.num_modules,
        layers_per_module=cfg.layers_per_module,
        draft_vocab_size=cfg.draft_vocab,
        intermediate_size=cfg.intermediate_size,
        aux_layers=cfg.aux_layers,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        head = DraftHead(spec, loaded.arch.hidden_size).to(device)
    head.bind(loaded.model.model.embed_tokens, loaded.model.lm_head)
    return head


def compile_head(head: DraftHead) -> None:
    """`--compile`: each step module through torch.compile, in place (parameter names unchanged),
    with dynamic shapes (every batch has its own). The attention contexts' `attend` stays eager, so
    each module compiles to a graph before and one after attention per kind of step (from the
    target, fresh, chained), all in the first two batches; the host then launches a few fused
    kernels per step module where eager mode dispatches ~100 ops forward and as many backward."""
    for module in head.step_modules:
        module.compile(dynamic=True)


def train_head(
    loaded: LoadedModel,
    samples: Samples,
    cfg: TrainConfig,
    out: str | Path,
    *,
    resume: bool = True,
    progress_bar: bool = True,
    stop_after: int | None = None,
    stop_seconds: float | None = None,
    log=print,
) -> TrainResult:
    """Train a head of `cfg.method` on `samples` into the folder `out` (see the module doc).
    `stop_after`: end this call after that many steps, as an interruption would (the schedule stays
    the whole budget's; the next call resumes); `stop_seconds`: the same after that much wall time
    (a budget spread over several shorter sessions, e.g. calls to a lent GPU)."""
    out = Path(out)
    target = loaded.model
    device = next(target.parameters()).device
    target.requires_grad_(False)
    recipe = cfg.recipe(loaded.location.name)
    head = new_head(loaded, cfg, device)
    if cfg.compile:
        compile_head(head)
    state = load_state(out, device) if resume else None
    draft_ids = None
    if state is None and cfg.init_from is not None:
        draft_ids = _initialise_from(head, loaded, cfg, device, log)
    if cfg.draft_vocab is not None and head.spec.draft_vocab_size is not None:
        if state:
            draft_ids = state["draft_ids"]
        elif draft_ids is None:
            draft_ids = draft_vocabulary(samples, cfg.draft_vocab, loaded.arch.vocab_size)
        head.draft_to_target = draft_ids.to(device)
    t2d = None
    if draft_ids is not None:
        t2d = torch.zeros(loaded.arch.vocab_size, dtype=torch.bool, device=device)
        t2d[draft_ids.to(device)] = True
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    done = Progress()
    if state is not None:
        check_resumable(state, recipe)
        done = restore(head, optimizer, state)
        log(f"train: resumed at step {done.step} ({done.seconds:.0f}s, {done.tokens} tokens)")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    bar = tqdm(total=cfg.max_steps, initial=done.step, desc=f"train {cfg.method}", disable=not progress_bar)
    batches = epoch_batches(samples, cfg.tokens_per_batch, cfg.max_len, cfg.seed, done.epoch)
    answer_start = AnswerStart(cfg.start_weight, cfg.start_tokens)
    losses: list[float] = []
    result = None
    started = time.monotonic() - done.seconds
    head.train()
    stop_at = None if stop_after is None else done.step + stop_after
    session_end = None if stop_seconds is None else time.monotonic() + stop_seconds
    while not _finished(cfg, done) and done.step != stop_at:
        if session_end is not None and time.monotonic() >= session_end:
            log(f"train: session time up at step {done.step}; the same command resumes")
            break
        if done.batch >= len(batches):
            done = dataclasses.replace(done, epoch=done.epoch + 1, batch=0)
            batches = epoch_batches(samples, cfg.tokens_per_batch, cfg.max_len, cfg.seed, done.epoch)
            continue
        batch = make_batch(samples, batches[done.batch], cfg.max_len, device)
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * _lr_factor(cfg, done)
        with _profiled(done.step, log):
            with autocast:
                result = unrolled_loss(
                    head, target, batch, cfg.steps, cfg.decay, t2d, answer_start, cfg.hard_label
                )
            optimizer.zero_grad(set_to_none=True)
            result.loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
        losses.append(float(result.loss.detach()))
        done = Progress(
            step=done.step + 1,
            epoch=done.epoch,
            batch=done.batch + 1,
            seconds=time.monotonic() - started,
            tokens=done.tokens + batch.tokens,
        )
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", acc="/".join(f"{a:.2f}" for a in result.step_accuracy))
        if done.step % cfg.log_every == 0:
            append_log(out, _record(done, result, float(grad_norm), optimizer))
        if done.step % cfg.checkpoint_every == 0:
            _snapshot(out, head, optimizer, done, recipe, draft_ids, loaded, cfg)
    bar.close()
    _snapshot(out, head, optimizer, done, recipe, draft_ids, loaded, cfg)
    log(
        f"train: {done.step} steps, {done.tokens} tokens, {done.seconds:.0f}s; head in {out}"
        + (f"; last step accuracy {[round(a, 3) for a in result.step_accuracy]}" if result else "")
    )
    return TrainResult(
        out,
        done,
        tuple(losses),
        result.step_losses if result else (),
        result.step_accuracy if result else (),
    )


def _initialise_from(
    head: DraftHead, loaded: LoadedModel, cfg: TrainConfig, device: torch.device, log
) -> torch.Tensor | None:
    """Copy a trained head's weights into `head` (a new schedule and optimizer: more training of a
    head whose run's state is gone, e.g. made on a machine since given back). Its shape must be
    the recipe's, but for a wider MLP (`_widened`), more fused target layers (`_refeatured`) or more
    EAGLE-3 layers (`_deepened`); a reduced vocabulary comes with it. Returns
    the head's draft ids, if reduced."""
    from specserve.model.head_checkpoint import load_head

    trained = load_head(cfg.init_from, cfg.method, loaded.model, device, torch.float32)
    mine = head.state_dict()
    theirs = _widened(trained.state_dict(), mine)
    theirs = _refeatured(theirs, trained.spec.aux_layers, head.spec.aux_layers, cfg.init_from)
    theirs = _deepened(theirs, mine)
    wrong = sorted(n for n in mine if n not in theirs or theirs[n].shape != mine[n].shape)
    if wrong or set(theirs) - set(mine):
        raise ValueError(
            f"train: --init-from {cfg.init_from}: its head differs in shape from this recipe's "
            f"({', '.join(wrong or sorted(set(theirs) - set(mine)))})"
        )
    head.load_state_dict(theirs)
    log(f"train: initialised from the head in {cfg.init_from}")
    return None if trained.draft_to_target is None else trained.draft_to_target.cpu()


def _widened(theirs: dict[str, torch.Tensor], mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A trained head's MLPs grown to the wider ones of `mine` without changing what it computes:
    the new units keep `mine`'s fresh gate/up rows, and their down-projection columns start at 0,
    so the head drafts exactly as before and the new units learn from the first step (their down
    columns get gradients at once, then their gate/up rows). More capacity for a head that has
    stopped improving on more data, without training it afresh. Other tensors pass through."""
    out = dict(theirs)
    for name, old in theirs.items():
        new = mine.get(name)
        if new is None or new.dim() != 2:
            continue
        if name.endswith("mlp.gate_up_proj.weight") and _grows(old.shape[::-1], new.shape[::-1]):
            width, wider = old.shape[0] // 2, new.shape[0] // 2
            fresh = new.to(old.dtype)
            out[name] = torch.cat([old[:width], fresh[width:wider], old[width:], fresh[wider + width :]])
        elif name.endswith("mlp.down_proj.weight") and _grows(old.shape, new.shape):
            out[name] = torch.cat([old, old.new_zeros(old.shape[0], new.shape[1] - old.shape[1])], dim=1)
    return out


def _refeatured(
    theirs: dict[str, torch.Tensor], old: tuple[int, ...], new: tuple[int, ...], source: str
) -> dict[str, torch.Tensor]:
    """An EAGLE-3 head's fc moved onto more target layers without changing what it computes: the
    layers it fused keep their blocks of input columns, the added layers' blocks start at 0 (and
    learn from the first step, as `_widened`'s new units do)."""
    if old == new:
        return theirs
    if new[: len(old)] != old:
        raise ValueError(
            f"train: --init-from {source}: fuses layers {old}; --aux-layers must start with them"
        )
    name = next(n for n in theirs if n.endswith(".fc.weight"))
    fc = theirs[name]
    added = fc.new_zeros(fc.shape[0], fc.shape[1] // len(old) * (len(new) - len(old)))
    return {**theirs, name: torch.cat([fc, added], dim=1)}


def _deepened(theirs: dict[str, torch.Tensor], mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An EAGLE-3 head given further decoder layers without changing what it computes: each new
    layer keeps `mine`'s fresh weights but for its two output projections (attention's o_proj and
    the MLP's down_proj), which start at 0, so the layer adds nothing to the residual stream and
    the head drafts exactly as before. Those projections get gradients at once (their inputs are
    not 0), then the rest of the layer: depth for a head whose first draft stopped improving with
    more data and a wider MLP."""
    prefix = next((n.split("midlayer.")[0] for n in theirs if "midlayer." in n), None)
    if prefix is None:
        return theirs
    new = {n: t for n, t in mine.items() if n.startswith(f"{prefix}layers.") and n not in theirs}
    zeroed = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
    return {**theirs, **{n: torch.zeros_like(t) if n.endswith(zeroed) else t.clone() for n, t in new.items()}}


def _grows(old: torch.Size, new: torch.Size) -> bool:
    """Same rows, more columns."""
    return old[0] == new[0] and new[1] > old[1]


@contextlib.contextmanager
def _profiled(step: int, log):
    """SPECSERVE_TRAIN_PROFILE=N: step N (0-based, after warm-up) runs under torch.profiler and its
    table is logged, to see where a training step's time goes on the GPU."""
    wanted = os.environ.get("SPECSERVE_TRAIN_PROFILE")
    if wanted is None or int(wanted) != step:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])]
    with profile(activities=activities) as prof:
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    log(prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=60))


def _finished(cfg: TrainConfig, done: Progress) -> bool:
    return (cfg.max_steps is not None and done.step >= cfg.max_steps) or (
        cfg.max_minutes is not None and done.seconds >= cfg.max_minutes * 60
    )


def _lr_factor(cfg: TrainConfig, done: Progress) -> float:
    """Linear warmup, then cosine from 1 to `min_lr_ratio` over the budget's fraction spent."""
    if done.step < cfg.warmup_steps:
        return (done.step + 1) / cfg.warmup_steps
    spent = 0.0
    if cfg.max_steps is not None:
        spent = max(spent, done.step / cfg.max_steps)
    if cfg.max_minutes is not None:
        spent = max(spent, done.seconds / (cfg.max_minutes * 60))
    cosine = 0.5 * (1 + math.cos(math.pi * min(spent, 1.0)))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine


def _record(done: Progress, result, grad_norm: float, optimizer) -> dict:
    return {
        **dataclasses.asdict(done),
        "loss": float(result.loss.detach()),
        "step_losses": result.step_losses,
        "step_accuracy": result.step_accuracy,
        "grad_norm": grad_norm,
        "lr": optimizer.param_groups[0]["lr"],
    }


def _snapshot(out, head, optimizer, done, recipe, draft_ids, loaded, cfg) -> None:
    save_state(out, head, optimizer, done, recipe, draft_ids)
    dtype = getattr(torch, cfg.save_dtype)
    export_head(out, head, loaded.arch, draft_ids, dtype, recipe)
