"""Lossless acceptance of a drafted chain, for deterministic drafts (n-gram).

Row j of a request scores position j of its chain: row 0 follows the last verified token, row j
follows draft token j. With p_j the target's (filtered) distribution at row j and draft d_{j+1}
proposed with probability 1, rejection sampling accepts d_{j+1} with probability min(1, p_j(d)/1)
= p_j(d), and on rejection draws from norm(max(p_j - onehot(d), 0)) = p_j with d removed. A row
with no draft draws from p_j itself (the bonus token). Greedy rows are the same rule on a one-hot
p_j: accept iff the draft is the argmax, else take the argmax. So the emitted tokens are distributed
exactly as the target's own samples (invariants 1 and 2).
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


@dataclass(frozen=True)
class VerifyResult:
    accepted: list[bool]  # per row: its draft token was accepted (False where a row has no draft)
    replacement: list[int]  # per row: the token emitted if the chain stops at this row


def verify_rows(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    drafts: Sequence[int | None],
    banned: torch.Tensor | None,
) -> VerifyResult:
    """`drafts[j]` is the draft token row j tests (None: a bonus row). One host copy at the end."""
    batch = SamplingBatch.build(rows, logits.device)
    has_draft = [d is not None for d in drafts]
    if not any(has_draft):
        return VerifyResult([False] * len(rows), sample(logits, batch, banned).tolist())
    draft = torch.tensor([d if d is not None else 0 for d in drafts], dtype=torch.long)
    draft_mask = torch.tensor(has_draft, dtype=torch.bool)
    draft, draft_mask = draft.to(logits.device), draft_mask.to(logits.device)
    probs = filtered_probs(logits, batch, banned)
    p_draft = probs.gather(1, draft[:, None]).squeeze(1)
    u = uniform_noise(batch.seed, batch.counter, 1, salt=ACCEPT_SALT)[:, 0]
    accepted = draft_mask & (u < p_draft)
    # The residual removes the draft from the *filtered* p (filtering after removal would let a token
    # outside top-k/top-p in). Scatter, not boolean indexing: no host sync.
    drafted = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, draft[:, None], draft_mask[:, None])
    replacement = sample_from_probs(probs.masked_fill(drafted, 0.0), batch)
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
