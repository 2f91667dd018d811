"""The unrolled training step: a draft head run as the drafter will run it, scored against the target.

Per batch the frozen target runs once (its features for the head, and its next-token distribution at
every answer position: the soft labels of self-distillation; nothing is stored between batches).
Then the head unrolls `steps` chain steps over every position at once, in the layout
`head_drafter.py` documents (step s uses module min(s, k-1)):

- fresh steps s < k (every step of an MTP chain's own layer, and step 0 of any head) run causally
  over the whole sequence: at position p they read token x[p+1] and the target's feature at p (s = 0)
  or module s-1's output at p-1 (zero at p = 0); they predict x[p+2].
- chain steps s >= k reuse the last module: the draft r = s-k+1 tokens past a base position p reads
  token x[p+1+r] and the previous step's output at p, sits at position p+r, attends as
  `UnrollContext` describes (EAGLE-3's training-time test), and predicts x[p+2+r].

Inputs are the data's own tokens (the target's answers), hidden states the head's own, so every
step trains on what it will see when serving. Each step's loss is the KL divergence of the head's
distribution from the target's (restricted to, and renormalised over, a reduced draft vocabulary,
where positions whose target argmax falls outside it are skipped), averaged over answer positions;
the total weighs step s by decay**s.

Host cost matters as much as the GPU's here (a small head on a fast GPU waits on Python and op
dispatch), so a step never waits on the device: which rows each step scores is worked out on the
host from the batch's lengths, every step scores the same label rows (those a step cannot reach
weigh 0), and the per-step figures stay on the device until the caller reads them. Each step's
[rows, vocabulary] logits live only inside `_DistillLoss`, which returns the loss together with its
gradient, so nothing of that size is kept for (or recomputed in) the backward pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from specserve.model.draft_heads import DraftHead
from specserve.model.llama import LlamaForCausalLM
from specserve.train.attention import CausalContext, UnrollContext
from specserve.train.dataset import Batch


@dataclass(frozen=True)
class TargetPass:
    features: torch.Tensor  # [B, S, F] what the head's module 0 reads
    label_rows: torch.Tensor  # [N] flattened batch row b * S + q of each label position q
    label_positions: torch.Tensor  # [N] q, its position in the sample
    label_probs: torch.Tensor  # [N, V_draft] fp32 target probabilities p at the label rows
    label_negentropy: torch.Tensor  # [N] fp32 sum p log p: KL(p || q) = this - sum p log q
    label_argmax: torch.Tensor  # [N] the target's choice (a draft-vocabulary id)
    label_keep: torch.Tensor | None  # [N] bool: the target's argmax is in the draft vocabulary
    label_answer: torch.Tensor  # [N] how far into its answer the token the label row predicts lies (0: first)


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor  # the weighted total, for backward
    stats: torch.Tensor  # [steps, 3] per step: KL, top-1 agreement with the target, rows scored

    @cached_property
    def _host(self) -> list[list[float]]:
        return self.stats.tolist()  # the one device sync of the figures, when first asked for

    @property
    def step_losses(self) -> tuple[float, ...]:
        return tuple(row[0] for row in self._host)

    @property
    def step_accuracy(self) -> tuple[float, ...]:  # head argmax == target argmax, per step
        return tuple(row[1] for row in self._host)

    @property
    def positions(self) -> tuple[int, ...]:  # scored positions per step
        return tuple(int(row[2]) for row in self._host)


def label_positions(
    lengths: np.ndarray, prompt_lens: np.ndarray, seq: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flattened row b * seq + q, position q, answer index q - (prompt_len - 1)) of every label
    position, on the host: the q with prompt_len - 1 <= q <= length - 2 (each predicts an answer
    token that exists) and q < seq."""
    lengths = np.minimum(lengths, seq)
    start = np.maximum(prompt_lens - 1, 0)
    counts = np.maximum(lengths - 1 - start, 0)
    sample = np.repeat(np.arange(len(lengths)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    answer = np.arange(int(counts.sum())) - first
    positions = start[sample] + answer
    return sample * seq + positions, positions, answer


@torch.no_grad()
def target_pass(
    target: LlamaForCausalLM,
    batch: Batch,
    capture: tuple[int, ...],
    draft_to_target: torch.Tensor | None = None,
    t2d: torch.Tensor | None = None,
    hard_label: float = 0.0,
) -> TargetPass:
    """The target's features at every position and its distribution where they are labels. With a
    reduced draft vocabulary (`draft_to_target`, `t2d`) the distribution is renormalised over it, and
    `label_keep` marks the rows whose argmax it contains. `hard_label` h: the labels are
    (1 - h) p + h onehot(argmax p) (`sharpened`). Done once per batch: every chain step scores a
    shifted subset of these rows."""
    bsz, seq = batch.ids.shape
    device = batch.ids.device
    rows, positions, answer = label_positions(
        batch.lengths.cpu().numpy(), batch.prompt_lens.cpu().numpy(), seq
    )
    label_rows, label_positions_, label_answer = torch.from_numpy(np.stack([rows, positions, answer])).to(
        device
    )
    ctx = CausalContext(bsz, seq)
    positions_all = torch.arange(seq, device=device).repeat(bsz)
    hidden, aux = target.forward_features(batch.ids.flatten(), positions_all, ctx, capture)
    logits = target.compute_logits(hidden.index_select(0, label_rows))
    keep = None
    if draft_to_target is not None:
        keep = t2d[logits.argmax(-1)]
        logits = logits[:, draft_to_target]
    logp = logits.log_softmax(-1)  # fp32 (compute_logits)
    del logits
    argmax = logp.argmax(-1)
    if hard_label:
        probs, negentropy = sharpened(logp.exp_(), argmax, hard_label)
    else:
        probs = logp.exp()
        negentropy = (probs * logp).sum(-1)
    del logp
    features = (hidden if aux is None else aux).view(bsz, seq, -1)
    # features is an inference-mode tensor, which autograd may not save (the head's first matmul
    # reads it): a copy. The label tensors were computed out of inference mode: no [N, V] copy.
    return TargetPass(
        features.clone(), label_rows, label_positions_, probs, negentropy, argmax, keep, label_answer
    )


def sharpened(probs: torch.Tensor, argmax: torch.Tensor, share: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(1 - share) p + share onehot(argmax), in place over `probs` [N, V], and its sum p log p. A
    greedy verify accepts a draft only where it is the target's argmax: where the target is unsure
    (its argmax well under 1), the soft labels spend a small head's capacity on the runners-up, and
    `share` moves that weight onto the one token that decides acceptance (1: cross-entropy against
    the argmax). Sampled acceptance is the overlap of the two distributions, which this trades away.
    Measured on the shipped head: no gain on MT-Bench (docs/draft-training.md, nineteenth session)."""
    rows = torch.arange(probs.shape[0], device=probs.device)
    probs.mul_(1.0 - share).index_put_(
        (rows, argmax), torch.tensor(share, device=probs.device), accumulate=True
    )
    # x log x -> 0 at x = 0: zero entries (the argmax alone at share 1) add nothing
    negentropy = torch.special.xlogy(probs, probs).sum(-1)
    return probs, negentropy


def step_offset(step: int, modules: int) -> int:
    """The row at p of chain step `step` predicts the token after position p + offset."""
    return 1 + max(step - (modules - 1), 0)


def unroll(head: DraftHead, ids: torch.Tensor, features: torch.Tensor, steps: int) -> Iterator[tuple]:
    """(step, label offset o, output [B, S, H]) per chain step: the row at p of step s predicts the
    token after position p + o, the one the target's distribution at p + o is about."""
    bsz, seq = ids.shape
    k = len(head.step_modules)
    ctx = UnrollContext(bsz, seq)
    positions = torch.arange(seq, device=ids.device).expand(bsz, seq)
    last_position = head.rope.cos.shape[0] - 1
    out = None
    for s in range(max(steps, k)):
        offset = step_offset(s, k)
        if s < k:
            ctx.causal()
            hidden = features
            if s > 0:
                hidden = F.pad(out, (0, 0, 1, 0))[:, :seq]  # module s-1's output one position back
        else:
            ctx.chain()
            hidden = out
        tokens = F.pad(ids[:, offset:], (0, offset))  # x[p + offset], 0 past the end
        pos = (positions + (offset - 1)).clamp(max=last_position)
        out, to_logits = head.forward_step(
            head.module_for_step(s),
            tokens.flatten(),
            hidden.flatten(0, 1),
            pos.flatten(),
            ctx,
            from_target=s == 0,
        )
        out = out.view(bsz, seq, -1)
        yield s, offset, to_logits.view(bsz, seq, -1)


def unrolled_loss(
    head: DraftHead,
    target: LlamaForCausalLM,
    batch: Batch,
    steps: int,
    decay: float,
    t2d: torch.Tensor | None = None,
    answer_start: AnswerStart | None = None,
    hard_label: float = 0.0,
) -> StepResult:
    """The weighted loss of one batch (`t2d`: [V] bool, the reduced draft vocabulary, if any;
    `answer_start`: how much more the first tokens of each answer weigh; `hard_label`: the share of
    the target's argmax in the labels, `sharpened`)."""
    tp = target_pass(target, batch, head.spec.aux_layers, head.draft_to_target, t2d, hard_label)
    if tp.label_rows.numel() == 0:
        raise ValueError("batch: no answer position to score (every sample is prompt only)")
    rows, weights = _step_rows(tp, max(steps, len(head.step_modules)), len(head.step_modules), answer_start)
    total, stats = None, []
    for s, _, to_logits in unroll(head, batch.ids, tp.features, steps):
        hidden = to_logits.flatten(0, 1).index_select(0, rows[s])
        weight = head.output_head(head.module_for_step(s)).weight
        loss, figures = distill_loss(hidden, weight, tp, weights[s], decay**s)
        total = loss if total is None else total + loss
        stats.append(figures)
    return StepResult(total, torch.stack(stats))


@dataclass(frozen=True)
class AnswerStart:
    """Label rows predicting one of an answer's first `tokens` tokens weigh `weight` (the rest 1)
    in each step's mean. Where a one-layer head falls short is the answer's start: on MT-Bench its
    teacher-forced agreement is 0.56-0.65 over the first 128 tokens, against 0.73-0.76 further on in
    its own training answers (scripts/head_agreement.py), and MT-Bench is measured there."""

    weight: float = 1.0
    tokens: int = 128


def _step_rows(
    tp: TargetPass, steps: int, modules: int, answer_start: AnswerStart | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """For every step at once (all on the device, no sync): the head row that predicts each label
    row (`rows` [steps, N]) and the label row's weight in that step's mean (`weights` [steps, N]):
    its share of the step's total where the step reaches the label (q - offset >= 0, the same
    sample) and, with a reduced vocabulary, the target's choice is a draft token; 0 elsewhere (where
    q < offset the row index points before the sample, at a stand-in row whose zero weight removes
    it). Each row counts 1, or `answer_start.weight` near its answer's start."""
    # step_offset of every step, made on the device (a host-to-device copy would wait for the target)
    offsets = (
        torch.arange(steps, device=tp.label_rows.device).sub_(modules - 1).clamp_(min=0).add_(1)[:, None]
    )
    rows = (tp.label_rows - offsets).clamp_(min=0)
    used = tp.label_positions >= offsets
    if tp.label_keep is not None:
        used &= tp.label_keep
    weights = used.float()
    if answer_start is not None and answer_start.weight != 1.0:
        early = (tp.label_answer < answer_start.tokens).float().mul_(answer_start.weight - 1.0).add_(1.0)
        weights.mul_(early)
    return rows, weights.div_(weights.sum(-1, keepdim=True).clamp_(min=1e-12))


def distill_loss(
    hidden: torch.Tensor, weight: torch.Tensor, tp: TargetPass, row_weights: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`scale` x the mean KL of the head's distribution F.linear(hidden, weight) from the target's
    over the label rows, weighted by `row_weights`; its figures [KL, top-1 agreement, rows])."""
    grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _DistillLoss.apply(
        hidden, weight, tp.label_probs, tp.label_negentropy, tp.label_argmax, row_weights, scale, grads
    )


class _DistillLoss(torch.autograd.Function):
    """KL(target || head) = sum p log p - sum p log q, whose gradient with respect to the head's
    logits is (q - p) per row: computed here in the forward pass, while the logits exist, and only
    its [rows, hidden] (and lm_head) products kept for backward, which scales them by the incoming
    gradient. The same loss and gradients as autograd through log_softmax, without keeping or
    recomputing [rows, vocabulary] tensors, in a handful of passes over them."""

    @staticmethod
    def forward(ctx, hidden, weight, probs, negentropy, argmax, row_weights, scale, grads):
        logits = F.linear(hidden, weight)  # bf16 under autocast
        logits_dtype = logits.dtype
        logq = F.log_softmax(logits, -1, dtype=torch.float32)  # casts inside the kernel
        del logits
        kl = negentropy - (probs * logq).sum(-1)
        mean = (kl * row_weights).sum()
        scored = (row_weights > 0).float()
        rows = scored.sum()
        # agreement over the rows scored, each counting once whatever its weight in the loss
        agree = ((logq.argmax(-1) == argmax).float() * scored).sum() / rows.clamp(min=1)
        figures = torch.stack([mean, agree, rows])
        ctx.mark_non_differentiable(figures)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        grad_hidden = grad_weight = None
        if grads:
            # d(scale * mean) / d logits = scale * row_weight * (softmax - p), in place over logq.
            grad_logits = logq.exp_().sub_(probs).mul_((row_weights * scale)[:, None]).to(logits_dtype)
            del logq
            if ctx.needs_input_grad[0]:
                grad_hidden = grad_logits @ weight  # autocast casts as F.linear did
            if ctx.needs_input_grad[1]:
                grad_weight = grad_logits.t() @ hidden
        ctx.save_for_backward(grad_hidden, grad_weight)
        return mean * scale, figures

    @staticmethod
    def backward(ctx, grad_loss, _grad_figures):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        if grad_hidden is not None:
            grad_hidden = (grad_hidden * grad_loss).to(hidden_dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None
