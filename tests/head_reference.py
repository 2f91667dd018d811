"""A from-scratch statement of what a hidden-state draft head proposes (a helper module, not a test file).

It shares nothing with the engine's drafting path but the head's own modules: no pages, no
batching, no extend, no cached state. The target runs once, densely, over the verified tokens; then
each step module runs over every position from 0 with its inputs written out in full:

    module 0 at position p:          token x[p+1], the target's feature at p
    module i > 0 at position p:      token x[p+1], module i-1's output at p-1 (zero at p = 0)
    reuse steps (s >= k):            the last module at p = n-2+s, fed its own output at p-1

where x is the verified sequence followed by the drafts. Step s's draft comes from the row at
position n-2+s. The engine's incremental drafter must match this exactly (up to fp32 rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.attention.backend import AttentionContext
from specserve.model.draft_heads import DraftHead
from specserve.model.llama import LlamaForCausalLM


class DenseContext(AttentionContext):
    """Causal attention over everything this context has seen, per layer; appends on every call."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys = torch.cat([self.k[layer], k]) if layer in self.k else k
        values = torch.cat([self.v[layer], v]) if layer in self.v else v
        self.k[layer], self.v[layer] = keys, values
        new, total = q.shape[0], keys.shape[0]
        visible = torch.arange(total)[None, :] <= (total - new + torch.arange(new))[:, None]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=visible,
            enable_gqa=True,
        )
        return out.transpose(0, 1)


@torch.inference_mode()
def reference_step_logits(
    target: LlamaForCausalLM,
    head: DraftHead,
    verified: list[int],
    drafts: list[int],
    *,
    chain_hidden: bool = True,
) -> list[torch.Tensor]:
    """Draft-vocabulary logits [V_draft] of chain steps 0..len(drafts)-1 (step s proposes
    drafts[s]). `chain_hidden=False` feeds MTP module i the target's feature from i positions back
    (the one the chain started from) instead of module i-1's output: the bug invariant 5 forbids,
    kept here to prove the test can see it."""
    n, x = len(verified), verified + drafts
    features = _target_features(target, head, verified[:-1])  # positions 0 .. n-2
    k = len(head.step_modules)
    logits, inputs, out = [], [], None
    for i in range(min(k, len(drafts))):
        rows = n - 1 + i  # positions 0 .. n-2+i
        if i == 0:
            hidden = features
        elif chain_hidden:
            hidden = _shifted(out, rows, 1)
        else:
            hidden = _shifted(features, rows, i)
        out, to_logits = head.run(
            i, torch.tensor(x[1 : rows + 1]), hidden, torch.arange(rows), DenseContext(), i == 0
        )
        inputs.append(hidden)
        logits.append(head.logits(i, to_logits[-1:])[0])
    if len(drafts) > k:
        logits += _reuse_steps(head, x, n, len(drafts), inputs[-1])
    return logits


def _reuse_steps(
    head: DraftHead, x: list[int], n: int, num_drafts: int, inputs: torch.Tensor
) -> list[torch.Tensor]:
    """Steps k.. : the last module, one position at a time, fed its own previous output."""
    m = len(head.step_modules) - 1
    rows = n - 1 + m
    ctx = DenseContext()
    out, _ = head.run(m, torch.tensor(x[1 : rows + 1]), inputs, torch.arange(rows), ctx, m == 0)
    last_out, logits = out[-1:], []
    for s in range(m + 1, num_drafts):
        p = n - 2 + s
        last_out, to_logits = head.run(m, torch.tensor([x[p + 1]]), last_out, torch.tensor([p]), ctx, False)
        logits.append(head.logits(m, to_logits)[0])
    return logits


def _target_features(target: LlamaForCausalLM, head: DraftHead, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor(tokens)
    hidden, aux = target.forward_features(
        ids, torch.arange(len(tokens)), DenseContext(), head.spec.aux_layers
    )
    return hidden if aux is None else aux


def _shifted(rows: torch.Tensor, count: int, by: int) -> torch.Tensor:
    """Row p = rows[p - by] (zero for p < by), for p < count."""
    padded = torch.cat([torch.zeros_like(rows[:1]).expand(by, -1), rows])
    assert padded.shape[0] >= count, "no input for a draft position"
    return padded[:count]
