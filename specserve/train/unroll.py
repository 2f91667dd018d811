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
the total weighs step s by decay**s. The lm_head + loss of each step is recomputed in the backward
pass rather than keeping [tokens, vocabulary] logits of every step alive.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from specserve.model.draft_heads import DraftHead
from specserve.model.llama import LlamaForCausalLM
from specserve.train.attention import CausalContext, UnrollContext
from specserve.train.dataset import Batch


@dataclass(frozen=True)
class TargetPass:
    features: torch.Tensor  # [B, S, F] what the head's module 0 reads
    label_logp: torch.Tensor  # [N, V_draft] fp32 target log-probabilities at the label rows
    label_index: torch.Tensor  # [B * S] row of `label_logp` for each position, -1 where none
    label_keep: torch.Tensor | None  # [N] bool: the target's argmax is in the draft vocabulary


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor  # the weighted total, for backward
    step_losses: tuple[float, ...]
    step_accuracy: tuple[float, ...]  # head argmax == target argmax, per step
    positions: tuple[int, ...]  # scored positions per step


@torch.no_grad()
def target_pass(
    target: LlamaForCausalLM,
    batch: Batch,
    capture: tuple[int, ...],
    draft_to_target: torch.Tensor | None = None,
    t2d: torch.Tensor | None = None,
) -> TargetPass:
    """The target's features at every position and its log-probabilities where they are labels:
    positions q with prompt_len - 1 <= q <= length - 2 (each predicts an answer token that exists).
    With a reduced draft vocabulary (`draft_to_target`, `t2d`) the log-probabilities are renormalised
    over it, and `label_keep` marks the rows whose argmax it contains. Done once per batch: every
    chain step scores a shifted subset of these rows (twice, with the loss recomputed backwards)."""
    bsz, seq = batch.ids.shape
    positions = torch.arange(seq, device=batch.ids.device)
    ctx = CausalContext(bsz, seq)
    hidden, aux = target.forward_features(batch.ids.flatten(), positions.repeat(bsz), ctx, capture)
    is_label = (positions >= batch.prompt_lens[:, None] - 1) & (positions <= batch.lengths[:, None] - 2)
    rows = is_label.flatten().nonzero().squeeze(1)
    index = torch.full((bsz * seq,), -1, dtype=torch.long, device=rows.device)
    index[rows] = torch.arange(rows.shape[0], device=rows.device)
    logits = target.compute_logits(hidden.index_select(0, rows))
    keep = None
    if draft_to_target is not None:
        keep = t2d[logits.argmax(-1)]
        logits = logits[:, draft_to_target]
    logp = logits.float().log_softmax(-1)
    features = (hidden if aux is None else aux).view(bsz, seq, -1)
    # Out of inference mode: autograd may save these (the head's first matmul reads the features).
    return TargetPass(features.clone(), logp.clone(), index, None if keep is None else keep.clone())


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
        if s < k:
            ctx.causal()
            offset, hidden = 1, features
            if s > 0:
                hidden = F.pad(out, (0, 0, 1, 0))[:, :seq]  # module s-1's output one position back
        else:
            ctx.chain()
            offset, hidden = 1 + s - (k - 1), out
        tokens = F.pad(ids[:, offset:], (0, offset))  # x[p + offset], 0 past the end
        pos = (positions + offset - 1).clamp(max=last_position)
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
) -> StepResult:
    """The weighted loss of one batch (`t2d`: [V] bool, the reduced draft vocabulary, if any)."""
    tp = target_pass(target, batch, head.spec.aux_layers, head.draft_to_target, t2d)
    bsz, seq = batch.ids.shape
    positions = torch.arange(seq, device=batch.ids.device).expand(bsz, seq).flatten()
    flat_row = torch.arange(bsz * seq, device=batch.ids.device)
    total, losses, accuracy, counts = 0.0, [], [], []
    for s, offset, to_logits in unroll(head, batch.ids, tp.features, steps):
        # a label row p + offset in the same sample (rows past a sample's end have index -1)
        inside = positions + offset < seq
        label = torch.where(inside, tp.label_index[(flat_row + offset).clamp(max=bsz * seq - 1)], -1)
        rows = (label >= 0).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        weight = head.output_head(head.module_for_step(s)).weight
        label_rows = label.index_select(0, rows)
        hidden = to_logits.flatten(0, 1).index_select(0, rows)
        logp = tp.label_logp.index_select(0, label_rows)
        if tp.label_keep is not None:  # score only where the target's choice is a draft token
            keep = tp.label_keep.index_select(0, label_rows)
            hidden, logp = hidden[keep], logp[keep]
        loss, acc, used = checkpoint(_soft_cross_entropy, hidden, weight, logp, use_reentrant=False)
        total = total + decay**s * loss
        losses.append(float(loss.detach()))
        accuracy.append(float(acc))
        counts.append(int(used))
    if not losses:
        raise ValueError("batch: no answer position to score (every sample is prompt only)")
    return StepResult(total, tuple(losses), tuple(accuracy), tuple(counts))


def _soft_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, logp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean KL divergence of the head's distribution from the target's `logp`, top-1 agreement,
    rows scored)."""
    logq = F.linear(hidden, weight).float().log_softmax(-1)
    rows = logp.shape[0]
    # KL(target || head): the cross-entropy's gradient, with the target's entropy taken off so the
    # figure falls towards 0 as the head matches the target.
    loss = (logp.exp() * (logp - logq)).sum(-1).mean() if rows else logq.sum() * 0.0
    with torch.no_grad():
        agree = (logq.argmax(-1) == logp.argmax(-1)).float().mean() if rows else logq.new_zeros(())
    return loss, agree, torch.tensor(rows)
