"""Lossless acceptance of a drafted chain (rejection sampling, as in Leviathan et al. / Chen et al.).

Row j of a request scores position j of its chain: row 0 follows the last verified token, row j
follows draft token j. With p_j the target's (filtered) distribution at row j and q_j the one the
draft d_{j+1} was drawn from, d_{j+1} is accepted with probability min(1, p_j(d) / q_j(d)); on
rejection the row draws from norm(max(p_j - q_j, 0)). A row with no draft draws from p_j itself
(the bonus token). A deterministic drafter (n-gram) has q_j = onehot(d): accept with p_j(d), else
draw from p_j with d removed. Greedy rows are the same rule on one-hot p_j: accept iff the draft is
the argmax, else take the argmax. Either way the emitted tokens are distributed exactly as the
target's own samples (invariants 1 and 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.engine.sampler import (
    SamplingBatch,
    SamplingRow,
    filtered_probs,
    sample,
    sample_from_probs,
    uniform_noise,
)

ACCEPT_SALT = 1  # the accept test's uniforms: a stream independent of the sampling race's
DRAFT_SALT = 2  # a drafter sampling its proposals draws with this stream


@dataclass(frozen=True)
class VerifyResult:
    accepted: list[bool]  # per row: its draft token was accepted (False where a row has no draft)
    replacement: list[int]  # per row: the token emitted if the chain stops at this row


def verify_rows(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    drafts: Sequence[int | None],
    banned: torch.Tensor | None,
    draft_probs: torch.Tensor | None = None,
) -> VerifyResult:
    """`drafts[j]` is the draft token row j tests (None: a bonus row); `draft_probs` [R, V] the
    distributions they were drawn from (None: deterministic drafts). One host copy at the end."""
    batch = SamplingBatch.build(rows, logits.device)
    has_draft = [d is not None for d in drafts]
    if not any(has_draft):
        return VerifyResult([False] * len(rows), sample(logits, batch, banned).tolist())
    draft = torch.tensor([d if d is not None else 0 for d in drafts], dtype=torch.long)
    draft_mask = torch.tensor(has_draft, dtype=torch.bool)
    draft, draft_mask = draft.to(logits.device), draft_mask.to(logits.device)
    probs = filtered_probs(logits, batch, banned)
    if draft_probs is None:  # q = onehot(draft); scatter, not boolean indexing: no host sync
        draft_probs = torch.zeros_like(probs).scatter_(1, draft[:, None], draft_mask[:, None].to(probs.dtype))
    p_draft = probs.gather(1, draft[:, None]).squeeze(1)
    q_draft = draft_probs.gather(1, draft[:, None]).squeeze(1)
    u = uniform_noise(batch.seed, batch.counter, 1, salt=ACCEPT_SALT)[:, 0]
    # u < p/q, written without a division (q > 0 for any token the drafter could have drawn).
    accepted = draft_mask & (u * q_draft < p_draft)
    # The residual is taken from the *filtered* p (filtering after removing q would let tokens outside
    # top-k/top-p in); rows without a draft have q = 0 there, so they draw from p itself.
    residual = (probs - draft_probs * draft_mask[:, None]).clamp_min(0.0)
    # Rounding can leave a rejected row with no residual mass; p itself is the safe draw then.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs)
    replacement = sample_from_probs(residual, batch)
    return VerifyResult(accepted.tolist(), replacement.tolist())


def emitted_tokens(result: VerifyResult, rows: range, drafts: Sequence[int]) -> list[int]:
    """The tokens one request emits: its accepted prefix of drafts, then the first replacement."""
    out: list[int] = []
    for j, row in enumerate(rows):
        if j < len(drafts) and result.accepted[row]:
            out.append(drafts[j])
            continue
        out.append(result.replacement[row])
        break
    return out
