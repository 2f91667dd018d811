"""Draft-head training on the CPU (specserve/train/): the unrolled training forward is the drafter's own
computation, training lowers the loss and raises the accept length over an untrained head, the
exported folder loads back unchanged, a resumed run continues exactly, and `train-draft` runs its
phases end to end. Targets are tiny random models; everything stays within seconds."""

from __future__ import annotations

import dataclasses
import json
import random
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from head_reference import reference_step_logits

from specserve import LLM, SamplingParams, default_drafter
from specserve.cli import main
from specserve.config import SpeculativeConfig
from specserve.model.head_checkpoint import (
    ROW_SCALE,
    default_aux_layers,
    dequantize_rows,
    load_head,
    random_head,
    save_head,
)
from specserve.model.hf_loader import load_safetensors_folder
from specserve.model.loader import load_model
from specserve.serve.config import ServeConfig
from specserve.train.attention import CausalContext, UnrollContext
from specserve.train.checkpoint import export_head
from specserve.train.data import GenerationSettings, cut_loops, generate_responses, load_samples
from specserve.train.dataset import Batch, epoch_batches, make_batch
from specserve.train.evaluate import measure_acceptance
from specserve.train.trainer import TrainConfig, compile_head, new_head, train_head
from specserve.train.unroll import AnswerStart, target_pass, unroll, unrolled_loss

VOCAB = 96  # a small vocabulary: a tiny random target's answers are learnable in a few hundred steps
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target(small_vocab_target):
    return small_vocab_target


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 16))] for _ in range(count)]


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    """The target's greedy answers to 192 prompts, generated in sittings (later ones resume)."""
    path = tmp_path_factory.mktemp("data") / "responses.npz"
    llm = LLM(target, device="cpu", dtype="float32", max_running_requests=128)
    prompts = _prompts(192, seed=0)
    settings = GenerationSettings(max_new_tokens=40, batch=128)
    first = generate_responses(llm, prompts, path, settings, max_samples=64, log=lambda _: None)
    assert len(first) == 64 and len(set(first.prompt_index.tolist())) == 64
    past = time.monotonic() - 1  # a deadline already gone: nothing more is answered, nothing is lost
    assert len(generate_responses(llm, prompts, path, settings, deadline=past, log=lambda _: None)) == 64
    samples = generate_responses(llm, prompts, path, settings, log=lambda _: None)
    assert sorted(samples.prompt_index.tolist()) == list(range(192))
    again = load_samples(path)
    assert again.sample(3).tolist() == first.sample(3).tolist()  # kept, not regenerated
    for i in (0, 100, 191):  # each sample is its prompt followed by the target's answer
        prompt = prompts[int(again.prompt_index[i])]
        assert again.sample(i)[: len(prompt)].tolist() == prompt and again.prompt_lens[i] == len(prompt)
    return prompts, samples


def test_answers_stop_where_training_would_cut_their_loop(target, data, tmp_path):
    """`--stop-loops N`: an answer ends N tokens into its first loop, so the data phase keeps exactly
    what `cut_loops(N)` keeps of the whole answer, without generating the rest."""
    prompts, full = data
    llm = LLM(target, device="cpu", dtype="float32", max_running_requests=128)
    settings = GenerationSettings(max_new_tokens=40, batch=128, stop_loops=4)
    stopped = generate_responses(llm, prompts, tmp_path / "r.npz", settings, log=lambda _: None)
    cut = cut_loops(full, 4)
    by_prompt = {int(p): i for i, p in enumerate(cut.prompt_index)}
    assert sorted(stopped.prompt_index.tolist()) == list(range(len(prompts)))
    for i, p in enumerate(stopped.prompt_index.tolist()):
        assert stopped.sample(i).tolist() == cut.sample(by_prompt[p]).tolist()
    looped = int((cut.lengths < full.lengths[np.argsort(full.prompt_index)][cut.prompt_index]).sum())
    assert looped > len(prompts) // 4  # the tiny target loops often: most answers were stopped early
    assert stopped.lengths.sum() == cut.lengths.sum() < full.lengths.sum()


def test_new_requests_join_in_waves(target, tmp_path):
    """Requests are handed to the engine a wave at a time (prefilling steps run without CUDA graphs,
    so topping up one at a time would make most steps of a large batch eager); every prompt is
    still answered once."""
    llm = LLM(target, device="cpu", dtype="float32", max_running_requests=8)
    engine, steps, joined = llm.engine, [0], []
    add, step = engine.add_request, engine.step
    engine.add_request = lambda *a, **k: (joined.append(steps[0]), add(*a, **k))[1]
    engine.step = lambda: (steps.__setitem__(0, steps[0] + 1), step())[1]
    prompts = [p[:4] for p in _prompts(21, seed=5)]
    settings = GenerationSettings(max_new_tokens=6, batch=8, wave=3)
    samples = generate_responses(llm, prompts, tmp_path / "r.npz", settings, log=lambda _: None)
    assert sorted(samples.prompt_index.tolist()) == list(range(21))
    waves = [joined.count(s) for s in sorted(set(joined))]
    assert waves[0] == 8 and all(n >= 3 for n in waves[:-1]) and sum(waves) == 21


def test_max_samples_holds_across_saves(target, tmp_path):
    """`--num-prompts`: a run saving after every step (the answers so far leave its pending list)
    still stops at max_samples, counted with the file's earlier answers."""
    llm = LLM(target, device="cpu", dtype="float32", max_running_requests=4)
    prompts = [p[:4] for p in _prompts(16, seed=6)]
    settings = GenerationSettings(max_new_tokens=5, batch=4, wave=1, save_seconds=0)
    path, quiet = tmp_path / "r.npz", {"log": lambda _: None}
    assert len(generate_responses(llm, prompts, path, settings, max_samples=3, **quiet)) == 3
    assert len(generate_responses(llm, prompts, path, settings, max_samples=9, **quiet)) == 9


@pytest.mark.parametrize(
    "method, shape",
    [
        ("eagle3", {"draft_vocab_size": 64}),
        ("eagle3", {"layers_per_module": 2}),
        ("eagle", {"layers_per_module": 2}),
        ("mtp", {"num_modules": 3}),
    ],
)
def test_unrolled_training_forward_is_what_the_drafter_computes(target, tmp_path, method, shape):
    """Every chain step of the training forward, at every depth, equals the from-scratch statement of
    the drafter (head_reference.py, which the engine's drafts are tested against): the same tokens,
    hidden states, positions and visible keys."""
    config, tensors = random_head(method, target.arch, seed=3, **shape)
    head = load_head(save_head(tmp_path / method, config, tensors), method, target.model, CPU, torch.float32)
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    batch = Batch(ids, torch.tensor([24, 20]), torch.tensor([4, 4]))
    steps, k = 5, len(head.step_modules)
    with torch.no_grad():
        features = target_pass(target.model, batch, head.spec.aux_layers).features
        outputs = [out for _, _, out in unroll(head, ids, features, steps)]
    checked = 0
    for b in range(2):
        seq = ids[b, : int(batch.lengths[b])].tolist()
        for n in (2, 7, 13):
            expected = reference_step_logits(target.model, head, seq[:n], seq[n : n + steps])
            for s, logits in enumerate(expected):
                row = (
                    n - 2 + min(s, k - 1)
                )  # fresh steps move along the sequence; chain steps stay at their base
                got = head.logits(head.module_for_step(s), outputs[s][b, row : row + 1])[0]
                torch.testing.assert_close(got, logits, atol=2e-5, rtol=1e-4)
                checked += 1
    assert checked == 2 * 3 * steps


def dense_chain_attention(
    q: torch.Tensor, base: tuple[torch.Tensor, torch.Tensor], diagonal: list, batch: int
) -> torch.Tensor:
    """The chain step's attention as first written (the reference of UnrollContext's fused one):
    [B, H, S, S] fp32 scores over the base keys, masked causally, beside the query's own r diagonal
    scores, one softmax over both. Rows [B * S, heads, D] in and out."""
    heads = q.shape[1]

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [B * S, KvH, D] -> [B, H, S, D]
        x = x.repeat_interleave(heads // x.shape[1], dim=1)
        return x.view(batch, -1, heads, x.shape[-1]).transpose(1, 2)

    q4 = blocks(q)
    base_k, base_v = blocks(base[0]), blocks(base[1])
    diag_k = torch.stack([blocks(k) for k, _ in diagonal], dim=-2)  # [B, H, S, r, D]
    diag_v = torch.stack([blocks(v) for _, v in diagonal], dim=-2)
    scale = q4.shape[-1] ** -0.5
    seq = q4.shape[2]
    base_scores = (q4 @ base_k.transpose(-1, -2)).float() * scale
    later = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    base_scores = base_scores.masked_fill(later, float("-inf"))
    diag_scores = (q4.unsqueeze(-2) * diag_k).sum(-1).float() * scale  # [B, H, S, r]
    probs = torch.cat([base_scores, diag_scores], dim=-1).softmax(dim=-1)
    out = probs[..., :seq].to(base_v.dtype) @ base_v
    out = out + (probs[..., seq:, None].to(diag_v.dtype) * diag_v).sum(-2)
    return out.transpose(1, 2).reshape(q.shape).to(q.dtype)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_fused_chain_attention_equals_the_dense_one(dtype, tol):
    """UnrollContext's chain steps (one causal SDPA call with the diagonal folded into a sink key)
    give the dense softmax's outputs and gradients, GQA included, at every chain depth."""
    gen = torch.Generator().manual_seed(0)
    batch, seq, heads, kv_heads, dim, depth = 2, 9, 6, 2, 16, 4

    def rand(*shape):
        return (2 * torch.randn(*shape, generator=gen)).to(dtype).requires_grad_()

    qs = [rand(batch * seq, heads, dim) for _ in range(depth + 1)]
    ks = [rand(batch * seq, kv_heads, dim) for _ in range(depth + 1)]
    vs = [rand(batch * seq, kv_heads, dim) for _ in range(depth + 1)]
    ctx = UnrollContext(batch, seq)
    ctx.causal()
    ctx.attend(0, qs[0], ks[0], vs[0])
    ctx.chain()
    fused = [ctx.attend(0, qs[r], ks[r], vs[r]) for r in range(1, depth + 1)]
    dense = [
        dense_chain_attention(
            qs[r], (ks[0], vs[0]), list(zip(ks[1 : r + 1], vs[1 : r + 1], strict=True)), batch
        )
        for r in range(1, depth + 1)
    ]
    weights = [torch.randn(o.shape, generator=gen) for o in fused]
    inputs = qs[1:] + ks + vs
    grads = []
    for outs in (fused, dense):
        assert all(o.dtype == dtype for o in outs)
        total = sum((o.float() * w).sum() for o, w in zip(outs, weights, strict=True))
        grads.append(torch.autograd.grad(total, inputs))
    for got, want in zip(fused, dense, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=tol * 2, rtol=tol)


def reference_loss(
    head, target, batch: Batch, steps: int, decay: float, t2d=None, answer_start=None, hard_label=0.0
):
    """The batch's loss written plainly: the target's log-probabilities at every position, each
    step's KL from log_softmax of its logits at the positions whose label exists (and, with a reduced
    vocabulary, whose target argmax is a draft token), averaged (those predicting one of an answer's
    first `answer_start.tokens` weighing `answer_start.weight`), the labels (1 - hard_label) p +
    hard_label onehot(argmax p); autograd does the rest."""
    bsz, seq = batch.ids.shape
    positions = torch.arange(seq)
    is_label = (positions >= batch.prompt_lens[:, None] - 1) & (positions <= batch.lengths[:, None] - 2)
    with torch.no_grad():
        ctx = CausalContext(bsz, seq)
        hidden, aux = target.forward_features(
            batch.ids.flatten(), positions.repeat(bsz), ctx, head.spec.aux_layers
        )
        logits = target.compute_logits(hidden).view(bsz, seq, -1)
        if t2d is not None:
            is_label &= t2d[logits.argmax(-1)]
            logits = logits[..., head.draft_to_target]
        logp = logits.log_softmax(-1)
        features = (hidden if aux is None else aux).view(bsz, seq, -1)
    total, losses, agreement = 0.0, [], []
    for s, offset, out in unroll(head, batch.ids, features.clone(), steps):
        mask = is_label[:, offset:]  # the row at p is about the target's distribution at p + offset
        logq = head.output_head(head.module_for_step(s))(out[:, : seq - offset]).float().log_softmax(-1)
        label = logp[:, offset:]
        weight = torch.ones(mask.shape)
        if answer_start is not None:
            answer = positions[offset:] - (batch.prompt_lens[:, None] - 1)  # of the label row p + offset
            weight[answer < answer_start.tokens] = answer_start.weight
        probs = label.exp()
        onehot = F.one_hot(label.argmax(-1), probs.shape[-1]).float()
        probs = (1 - hard_label) * probs + hard_label * onehot
        kl_rows = (torch.special.xlogy(probs, probs) - probs * logq).sum(-1)
        kl = (kl_rows * weight)[mask].sum() / weight[mask].sum()
        total = total + decay**s * kl
        losses.append(float(kl.detach()))
        agreement.append(float((logq.argmax(-1) == label.argmax(-1))[mask].float().mean()))
    return total, losses, agreement


@pytest.mark.parametrize(
    "method, shape, answer_start, hard_label",
    [
        ("eagle3", {"draft_vocab": 48}, None, 0.0),
        ("mtp", {"num_modules": 2}, None, 0.0),
        ("eagle3", {"draft_vocab": 48}, AnswerStart(weight=3.0, tokens=4), 0.0),
        ("eagle3", {"draft_vocab": 48}, None, 0.5),
        ("eagle3", {}, None, 1.0),
    ],
)
def test_the_loss_and_its_gradients_are_the_plain_ones(target, method, shape, answer_start, hard_label):
    """unrolled_loss (host-planned rows, the KL and its gradient in one pass over the logits) equals
    the plain autograd statement of the loss, in value, per-step figures and gradients; with the
    answers' first tokens weighing more too, and with labels part (0.5) or all (1: cross-entropy
    against the target's argmax) hard."""
    cfg = TrainConfig(method=method, steps=4, max_steps=1, **shape)
    head = new_head(target, cfg, CPU)
    t2d = None
    if "draft_vocab" in shape:
        head.draft_to_target = torch.arange(0, 96, 2)
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[head.draft_to_target] = True
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (3, 20), generator=gen)
    # Short prompts: the last chain steps reach fewer answer positions than the first.
    batch = Batch(ids, torch.tensor([20, 17, 12]), torch.tensor([2, 5, 3]))
    params = [p for p in head.parameters() if p.requires_grad]
    got = unrolled_loss(head, target.model, batch, cfg.steps, cfg.decay, t2d, answer_start, hard_label)
    want, losses, agreement = reference_loss(
        head, target.model, batch, cfg.steps, cfg.decay, t2d, answer_start, hard_label
    )
    torch.testing.assert_close(got.loss, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.step_losses, tuple(losses), atol=1e-6, rtol=1e-5)
    assert got.step_accuracy == pytest.approx(agreement, abs=1e-6)
    assert got.positions[0] > got.positions[-1] > 0
    for a, b in zip(torch.autograd.grad(got.loss, params), torch.autograd.grad(want, params), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_compiled_head_trains_as_the_eager_one(target, data):
    """`--compile` (torch.compile of the step modules, attention left eager) computes the eager
    loss and gradients, on batches of different shapes (dynamic shapes, no per-batch graphs)."""
    _, samples = data
    cfg = TrainConfig(method="eagle3", steps=3, max_steps=1, compile=True)
    eager, compiled = new_head(target, cfg, CPU), new_head(target, cfg, CPU)
    compile_head(compiled)
    indices = epoch_batches(samples, 256, 64, seed=0, epoch=0)[:3]
    batches = [make_batch(samples, i, 64, CPU) for i in indices]
    assert len({tuple(b.ids.shape) for b in batches}) > 1
    for batch in batches:
        results = []
        for head in (eager, compiled):
            params = [p for p in head.parameters() if p.requires_grad]
            result = unrolled_loss(head, target.model, batch, cfg.steps, cfg.decay)
            results.append((result.loss, torch.autograd.grad(result.loss, params)))
        (loss, grads), (compiled_loss, compiled_grads) = results
        torch.testing.assert_close(compiled_loss, loss, atol=1e-6, rtol=1e-5)
        for a, b in zip(compiled_grads, grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_training_lowers_the_loss_and_beats_an_untrained_head(target, data, tmp_path):
    prompts, samples = data
    cfg = TrainConfig(
        method="eagle3",
        draft_vocab=64,
        steps=4,
        lr=3e-3,
        warmup_steps=10,
        tokens_per_batch=1024,
        max_steps=150,
        checkpoint_every=1000,
        save_dtype="float32",
    )
    result = train_head(target, samples, cfg, tmp_path / "trained", progress_bar=False, log=lambda _: None)
    first, last = result.losses[:10], result.losses[-10:]
    assert sum(last) / 10 < 0.75 * sum(first) / 10, (first, last)

    # Round trip: the exported folder, loaded as the engine loads heads, computes what training left.
    trained = new_head(target, cfg, CPU)
    state = torch.load(tmp_path / "trained" / "training" / "state.pt", weights_only=True)
    trained.load_state_dict(state["head"])
    trained.draft_to_target = state["draft_ids"]
    loaded = load_head(tmp_path / "trained", "eagle3", target.model, CPU, torch.float32)
    ids = torch.tensor(samples.sample(0)[:20].astype("int64"))[None]
    batch = Batch(ids, torch.tensor([20]), torch.tensor([2]))
    with torch.no_grad():
        features = target_pass(target.model, batch, trained.spec.aux_layers).features
        steps = zip(unroll(trained, ids, features, 3), unroll(loaded, ids, features, 3), strict=True)
        for (_, _, before), (_, _, after) in steps:
            torch.testing.assert_close(
                loaded.logits(0, after[0]), trained.logits(0, before[0]), atol=1e-5, rtol=1e-5
            )
    torch.testing.assert_close(loaded.draft_to_target, state["draft_ids"])

    # Untrained: the same head fresh from its initialisation, exported the same way.
    untrained = new_head(target, cfg, CPU)
    untrained.draft_to_target = state["draft_ids"]
    export_head(tmp_path / "untrained", untrained, target.arch, state["draft_ids"], torch.float32, {})
    # On prompts it was trained on (train -> export -> serve works) and on new ones (it generalises).
    held_out = _prompts(32, seed=1)
    lengths = {}
    for name in ("trained", "untrained"):
        spec = {"method": "eagle3", "num_steps": 4, "draft_model": str(tmp_path / name)}
        llm = LLM(target, device="cpu", dtype="float32", speculative=spec)
        seen = measure_acceptance(llm, prompts[::6], 0.0, 24).accept_length
        lengths[name] = (seen, measure_acceptance(llm, held_out, 0.0, 24).accept_length)
    (seen, new), (seen_before, new_before) = lengths["trained"], lengths["untrained"]
    assert seen > seen_before + 0.4 and new > new_before + 0.2, lengths


def test_a_resumed_run_continues_exactly(target, data, tmp_path):
    """MTP chain (per-layer losses): 3 steps, stop, resume to 6 == 6 steps in one go, bit for bit."""
    _, samples = data
    shape = dict(
        method="mtp", num_modules=2, steps=3, tokens_per_batch=512, warmup_steps=2, checkpoint_every=3
    )

    def run(folder: str, stop_after: int | None = None, **changes):
        cfg = TrainConfig(**{**shape, "max_steps": 6, **changes})
        out = tmp_path / folder
        return train_head(
            target, samples, cfg, out, progress_bar=False, stop_after=stop_after, log=lambda _: None
        )

    whole = run("a")
    assert run("b", stop_after=3).progress.step == 3
    resumed = run("b")
    assert whole.progress.step == resumed.progress.step == 6 and len(resumed.losses) == 3
    assert resumed.losses == whole.losses[3:]
    a = torch.load(tmp_path / "a" / "training" / "state.pt", weights_only=True)["head"]
    b = torch.load(tmp_path / "b" / "training" / "state.pt", weights_only=True)["head"]
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert len(whole.last_step_losses) == 3  # two MTP layers, then the last one chained once more
    with pytest.raises(ValueError, match="resume.*num_modules"):
        run("b", num_modules=3, max_steps=9)
    head = load_head(tmp_path / "b", "mtp", target.model, CPU, torch.float32)
    assert len(head.step_modules) == 2


def test_a_session_deadline_ends_a_run_that_the_same_command_resumes(target, data, tmp_path):
    """`stop_seconds` (--session-minutes): a budget spread over several calls. A passed deadline
    ends the run at once with a snapshot; the next run resumes and finishes the schedule."""
    _, samples = data
    cfg = TrainConfig(method="eagle3", steps=2, tokens_per_batch=512, warmup_steps=1, max_steps=3)
    out = tmp_path / "s"
    stopped = train_head(target, samples, cfg, out, progress_bar=False, stop_seconds=0, log=lambda _: None)
    assert stopped.progress.step == 0 and (out / "training" / "state.pt").is_file()
    assert train_head(target, samples, cfg, out, progress_bar=False, log=lambda _: None).progress.step == 3


def test_a_run_can_start_from_a_trained_heads_weights(target, data, tmp_path):
    """`--init-from`: a new run (own schedule and optimizer) starts from an exported head's weights,
    its reduced vocabulary included; zero steps export the same tensors; a head of another shape is
    refused, naming the flag."""
    _, samples = data
    shape = dict(method="eagle3", steps=2, tokens_per_batch=512, warmup_steps=1, draft_vocab=48)
    quiet = dict(progress_bar=False, log=lambda _: None)
    train_head(target, samples, TrainConfig(**shape, max_steps=3), tmp_path / "first", **quiet)
    cfg = TrainConfig(**shape, max_steps=0, init_from=str(tmp_path / "first"), seed=5)
    train_head(target, samples, cfg, tmp_path / "again", **quiet)
    heads = [load_head(tmp_path / n, "eagle3", target.model, CPU, torch.float32) for n in ("first", "again")]
    first, again = (h.state_dict() for h in heads)
    assert set(first) == set(again) and all(torch.equal(first[n], again[n]) for n in first)
    assert torch.equal(heads[0].draft_to_target, heads[1].draft_to_target)
    more = train_head(target, samples, dataclasses.replace(cfg, max_steps=2), tmp_path / "more", **quiet)
    assert more.progress.step == 2  # a fresh schedule, not a resume of "first"'s
    wider = dataclasses.replace(cfg, draft_vocab=None)
    with pytest.raises(ValueError, match="--init-from.*differs in shape"):
        train_head(target, samples, wider, tmp_path / "wider", **quiet)


def test_a_wider_mlp_starts_from_a_trained_head_drafting_the_same(target, data, tmp_path):
    """`--init-from` with a wider `--intermediate-size`: the trained units keep their weights, the new
    ones add nothing until trained (down-projection columns at 0), so the MLP computes what it did;
    one step of training gives the new units a say."""
    _, samples = data
    shape = dict(method="eagle3", steps=2, tokens_per_batch=512, warmup_steps=1, save_dtype="float32")
    quiet = dict(progress_bar=False, log=lambda _: None)
    train_head(target, samples, TrainConfig(**shape, max_steps=2), tmp_path / "first", **quiet)
    width = target.arch.intermediate_size
    wide = TrainConfig(**shape, max_steps=0, intermediate_size=2 * width, init_from=str(tmp_path / "first"))
    train_head(target, samples, wide, tmp_path / "wide", **quiet)
    narrow, widened = (
        load_head(tmp_path / n, "eagle3", target.model, CPU, torch.float32) for n in ("first", "wide")
    )
    x = torch.randn(5, target.arch.hidden_size, generator=torch.Generator().manual_seed(0))
    mlps = [h.step_modules[0].midlayer.mlp for h in (narrow, widened)]
    assert mlps[1].down_proj.weight.shape[1] == 2 * width
    assert torch.allclose(mlps[0](x), mlps[1](x), atol=1e-6)
    assert not mlps[1].down_proj.weight[:, width:].any()
    train_head(target, samples, dataclasses.replace(wide, max_steps=1), tmp_path / "trained", **quiet)
    trained = load_head(tmp_path / "trained", "eagle3", target.model, CPU, torch.float32)
    assert trained.step_modules[0].midlayer.mlp.down_proj.weight[:, width:].abs().sum() > 0


def test_more_fused_layers_start_from_a_trained_head_drafting_the_same(target, data, tmp_path):
    """`--init-from` with `--aux-layers` that start with the trained head's: the fc keeps its fused
    layers' blocks of columns and the added layer's block starts at 0, so the head computes what it
    did on any features; one step gives the added layer a say; dropping a fused layer is refused."""
    _, samples = data
    shape = dict(method="eagle3", steps=2, tokens_per_batch=512, warmup_steps=1, save_dtype="float32")
    quiet = dict(progress_bar=False, log=lambda _: None)
    train_head(target, samples, TrainConfig(**shape, max_steps=2), tmp_path / "first", **quiet)
    old = default_aux_layers(target.arch.num_layers)
    added = target.arch.num_layers - 1
    aux = (*old, added)
    more = TrainConfig(**shape, max_steps=0, aux_layers=aux, init_from=str(tmp_path / "first"))
    train_head(target, samples, more, tmp_path / "more", **quiet)
    heads = [load_head(tmp_path / n, "eagle3", target.model, CPU, torch.float32) for n in ("first", "more")]
    assert heads[1].spec.aux_layers == aux
    hidden = target.arch.hidden_size
    gen = torch.Generator().manual_seed(0)
    streams = torch.randn(4, len(aux) * hidden, generator=gen)
    fcs = [h.step_modules[0].fc for h in heads]
    assert torch.allclose(fcs[0](streams[:, : len(old) * hidden]), fcs[1](streams), atol=1e-6)
    block = len(old)
    assert not fcs[1].weight[:, block * hidden : (block + 1) * hidden].any()
    train_head(target, samples, dataclasses.replace(more, max_steps=1), tmp_path / "trained", **quiet)
    trained = load_head(tmp_path / "trained", "eagle3", target.model, CPU, torch.float32)
    assert trained.step_modules[0].fc.weight[:, block * hidden : (block + 1) * hidden].abs().sum() > 0
    fewer = dataclasses.replace(more, aux_layers=old[1:])
    with pytest.raises(ValueError, match="--aux-layers must start with them"):
        train_head(target, samples, fewer, tmp_path / "fewer", **quiet)


def test_a_deeper_head_starts_from_a_trained_head_drafting_the_same(target, data, tmp_path):
    """`--init-from` a one-layer EAGLE-3 head with `--layers 2`: the trained layer keeps its weights and
    the new one starts as an identity on the residual stream (its o_proj and down_proj at 0), so the
    deeper head's outputs equal the trained head's; one step of training gives the new layer a say."""
    _, samples = data
    shape = dict(method="eagle3", steps=2, tokens_per_batch=512, warmup_steps=1, save_dtype="float32")
    quiet = dict(progress_bar=False, log=lambda _: None)
    train_head(target, samples, TrainConfig(**shape, max_steps=2), tmp_path / "first", **quiet)
    deeper = TrainConfig(**shape, max_steps=0, layers_per_module=2, init_from=str(tmp_path / "first"))
    train_head(target, samples, deeper, tmp_path / "deep", **quiet)
    heads = [load_head(tmp_path / n, "eagle3", target.model, CPU, torch.float32) for n in ("first", "deep")]
    assert heads[1].spec.layers_per_module == 2 and heads[1].spec.arch.num_layers == 2
    seq = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    shallow, deep = (reference_step_logits(target.model, h, seq[:6], seq[6:]) for h in heads)
    for a, b in zip(shallow, deep, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    new_layer = heads[1].step_modules[0].layers[0]
    assert not new_layer.self_attn.o_proj.weight.any() and not new_layer.mlp.down_proj.weight.any()
    train_head(target, samples, dataclasses.replace(deeper, max_steps=1), tmp_path / "trained", **quiet)
    trained = load_head(tmp_path / "trained", "eagle3", target.model, CPU, torch.float32)
    assert trained.step_modules[0].layers[0].mlp.down_proj.weight.abs().sum() > 0


def test_an_int8_export_stores_half_the_bytes_and_loads_close_to_bf16(target, data, tmp_path):
    """`--save-dtype int8`: matrices as int8 rows with one scale each (norms stay floating point),
    dequantised at load within half a step of each row's bf16 values; a scale that does not fit its
    matrix is refused."""
    _, samples = data
    shape = dict(method="eagle3", steps=2, tokens_per_batch=512, warmup_steps=1, max_steps=2)
    quiet = dict(progress_bar=False, log=lambda _: None)
    for dtype in ("bfloat16", "int8"):
        train_head(target, samples, TrainConfig(**shape, save_dtype=dtype), tmp_path / dtype, **quiet)
    stored = {d: load_safetensors_folder(tmp_path / d) for d in ("bfloat16", "int8")}
    matrices = [n for n, t in stored["int8"].items() if t.dtype == torch.int8]
    assert matrices and all(n + ROW_SCALE in stored["int8"] for n in matrices)
    assert all(stored["int8"][n].dtype == torch.bfloat16 for n in stored["int8"] if "norm" in n)
    size = {d: sum(t.numel() * t.element_size() for t in stored[d].values()) for d in stored}
    assert size["int8"] < 0.6 * size["bfloat16"]
    heads = {d: load_head(tmp_path / d, "eagle3", target.model, CPU, torch.float32) for d in stored}
    for name, t in heads["bfloat16"].state_dict().items():
        loaded = heads["int8"].state_dict()[name]
        step = t.abs().amax(dim=-1, keepdim=True) / 127 if t.dim() == 2 else 0.0
        assert (loaded - t).abs().le(step / 2 + 1e-2 * t.abs() + 1e-6).all(), name
    broken = dict(stored["int8"])
    broken[matrices[0] + ROW_SCALE] = torch.ones(3)
    with pytest.raises(ValueError, match=ROW_SCALE):
        dequantize_rows(broken)


def test_answers_are_cut_a_few_tokens_into_their_first_loop():
    """`--cut-loops N`: an answer that falls into a loop keeps N tokens of it; one that never
    repeats an N-gram, and the prompts, stay whole."""
    from specserve.train.data import append, cut_loops, empty_samples

    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5]  # repeats, but prompts are never cut
    fresh = list(range(10, 30))
    looped = fresh[:10] + [7, 8, 9, 6, 5] * 10  # the 5-gram 7..5 recurs at answer position 15
    short_repeat = fresh[:5] + [40, 41, 40, 41] + fresh[5:]  # 2-grams recur, 5-grams do not
    samples = append(
        empty_samples(), [(prompt + a, len(prompt), i) for i, a in enumerate((fresh, looped, short_repeat))]
    )
    cut = cut_loops(samples, 5)
    assert cut.sample(0).tolist() == prompt + fresh
    assert cut.sample(1).tolist() == prompt + looped[: 15 + 5]
    assert cut.sample(2).tolist() == prompt + short_repeat
    assert cut.prompt_index.tolist() == [0, 1, 2] and cut_loops(samples, 0) is samples


def test_answer_samples_are_the_chat_prompt_then_the_answer(smollm2_gguf):
    """The `answers` phase: each question through the chat template, then the answer's ids and the
    end-of-turn token (none where the answer was cut); questions too long are skipped."""
    from specserve.model.tokenizer import chat_prompt_ids, load_tokenizer
    from specserve.train.answers import answer_samples

    tok = load_tokenizer(smollm2_gguf)
    pairs = [("What is 2+2?", "4."), ("word " * 400, "skipped"), ("Name a colour.", "Blue " * 50)]
    samples = answer_samples(tok, pairs, max_prompt_tokens=64, max_answer_tokens=20, meta={"x": 1})
    assert samples.prompt_index.tolist() == [0, 2] and samples.meta == {"x": 1}
    prompt = chat_prompt_ids(tok, [{"role": "user", "content": "What is 2+2?"}])
    answer = tok.encode("4.", add_special_tokens=False) + [tok.eos_token_id]
    assert samples.sample(0).tolist() == prompt + answer and samples.prompt_lens[0] == len(prompt)
    cut = samples.sample(1)[samples.prompt_lens[1] :].tolist()
    assert cut == tok.encode("Blue " * 50, add_special_tokens=False)[:20]


def test_a_profiled_step_logs_where_its_time_went(target, data, tmp_path, monkeypatch):
    """SPECSERVE_TRAIN_PROFILE=N logs a torch.profiler table of step N (and only of that step)."""
    _, samples = data
    monkeypatch.setenv("SPECSERVE_TRAIN_PROFILE", "1")
    cfg = TrainConfig(method="mtp", steps=2, tokens_per_batch=512, warmup_steps=1, max_steps=3)
    logged: list[str] = []
    train_head(target, samples, cfg, tmp_path / "p", progress_bar=False, log=logged.append)
    tables = [line for line in logged if "Self CPU" in line]
    assert len(tables) == 1 and "aten::mm" in tables[0]


def test_batches_cover_each_sample_once_per_epoch_within_the_budget(data):
    _, samples = data

    def order(epoch: int) -> list[list[int]]:
        return [b.tolist() for b in epoch_batches(samples, 512, 32, seed=1, epoch=epoch)]

    batches = epoch_batches(samples, 512, 32, seed=1, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(len(samples)))
    assert order(0) == [b.tolist() for b in batches] != order(1)
    for indices in batches:
        batch = make_batch(samples, indices, 32, CPU)
        assert batch.ids.numel() <= 512 or len(indices) == 1
        assert int(batch.lengths.max()) == batch.ids.shape[1] <= 32


def test_train_draft_command_runs_every_phase(tiny_llama, tmp_path, capsys):
    out = tmp_path / "head"
    common = ["train-draft", "--target", str(tiny_llama.location.path), "--out", str(out), "--no-progress"]
    assert main([*common, "--phase", "prompts", "--data", "mt-bench", "--num-prompts", "12"]) == 0
    prompts_file = out / "prompts.jsonl.gz"
    argv = [
        *common,
        "--phase",
        "data,train,eval",
        "--data",
        str(prompts_file),
        "--num-prompts",
        "6",
        "--max-new-tokens",
        "12",
        "--max-steps",
        "2",
        "--tokens-per-batch",
        "2048",
        "--unroll",
        "3",
        "--start-weight",
        "2",
        "--eval-data",
        str(prompts_file),
        "--eval-prompts",
        "3",
        "--eval-max-new-tokens",
        "8",
        "--eval-steps",
        "3",
        "--eval-tree",
        "4:8",
    ]
    assert main(argv) == 0
    assert len(load_samples(out / "responses.npz")) == 6
    config = json.loads((out / "config.json").read_text())
    assert config["specserve"]["method"] == "eagle3" and config["torch_dtype"] == "bfloat16"
    assert config["specserve"]["recipe"]["start_weight"] == 2.0  # the answers' first tokens weighed twice
    reports = json.loads((out / "eval.json").read_text())["reports"]
    chain = [r for r in reports if r["speculative"].get("topk", 1) == 1]
    assert [r["temperature"] for r in chain] == [0.0, 0.7]
    assert all(r["accept_length"] >= 1 and len(r["per_position"]) == 3 for r in chain)
    tree = [r for r in reports if r["speculative"].get("topk") == 4]
    assert [r["temperature"] for r in tree] == [0.0, 0.7] and all(r["accept_length"] >= 1 for r in tree)
    assert main([*common, "--phase", "data", "--shard", "2/2"]) == 2
    assert "--shard" in capsys.readouterr().err


def test_default_speculative_is_the_shipped_head_when_present(target, tmp_path, monkeypatch):
    monkeypatch.setattr(default_drafter, "HEADS_DIR", tmp_path)
    name = "smollm2-135m-instruct"
    assert default_drafter.default_speculative(name) == default_drafter.NGRAM_DEFAULT
    config, tensors = random_head("eagle3", target.arch, seed=1)  # a head that fits the tiny target
    save_head(tmp_path / name, config, tensors)
    spec = {"method": "eagle3", "num_steps": 5, "draft_model": str(tmp_path / name)}
    assert default_drafter.default_speculative("smollm2") == spec  # aliases too
    as_default = dataclasses.replace(target, location=dataclasses.replace(target.location, name=name))
    llm = LLM(as_default, device="cpu", dtype="float32", speculative="default")
    assert llm.engine.config.speculative == SpeculativeConfig(**spec)
    assert type(llm.engine.drafter).__name__ == "HeadDrafter"
    assert ServeConfig().engine_config().speculative == SpeculativeConfig(**spec)
    assert ServeConfig(model=str(target.location.path)).engine_config().speculative.method == "ngram"
    assert default_drafter.default_speculative(str(tmp_path / name)) == default_drafter.NGRAM_DEFAULT


@pytest.mark.gpu
def test_training_on_the_gpu_in_bf16(target, data, tmp_path):
    """The CUDA path: a bf16 target, autocast, fused SDPA, checkpointed losses; the head then drafts
    in a CUDA engine."""
    _, samples = data
    cuda = torch.device("cuda")
    on_gpu = load_model(str(target.location.path), cuda, torch.bfloat16)
    cfg = TrainConfig(method="eagle3", steps=4, lr=3e-3, warmup_steps=5, tokens_per_batch=4096, max_steps=60)
    result = train_head(on_gpu, samples, cfg, tmp_path / "head", progress_bar=False, log=lambda _: None)
    assert sum(result.losses[-5:]) < 0.75 * sum(result.losses[:5])
    spec = {"method": "eagle3", "num_steps": 4, "draft_model": str(tmp_path / "head")}
    llm = LLM(on_gpu, speculative=spec)
    assert measure_acceptance(llm, _prompts(16, seed=1), 0.0, 16).accept_length > 1.0


SHIPPED = sorted(p.name for p in default_drafter.HEADS_DIR.glob("*") if default_drafter.shipped_head(p.name))


@pytest.mark.skipif(not SHIPPED, reason="no trained head is shipped in specserve/heads/ yet")
@pytest.mark.parametrize("model", SHIPPED)
def test_a_shipped_head_fits_its_model_and_drafts_well(model, mtbench_questions):
    """What `speculative="default"` loads: at most 12 MB in shards under 5 MB each, lossless, and
    accepted often on MT-Bench."""
    folder = default_drafter.shipped_head(model)
    sizes = [f.stat().st_size for f in folder.glob("*.safetensors")]
    assert sum(sizes) <= 12 * 10**6 and max(sizes) < 5 * 10**6
    params = SamplingParams(max_new_tokens=48, temperature=0.0)
    plain = LLM(model, device="cpu", dtype="float32")
    drafted = LLM(plain.engine.loaded, device="cpu", dtype="float32", speculative="default")
    assert drafted.engine.config.speculative.draft_model == str(folder)
    chats = [[{"role": "user", "content": q}] for q in mtbench_questions[:3]]
    outs = drafted.chat(chats, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.chat(chats, params)]
    verifies = sum(o.meta["spec_verify_ct"] for o in outs)
    assert sum(len(o.token_ids) for o in outs) / verifies > 1.5
