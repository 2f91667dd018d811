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

import torch

from specserve.engine.host_copy import to_device
from specserve.engine.sampler import (
    SamplingBatch,
    SamplingRow,
    filtered_probs,
    greedy_tokens,
    sample,
    sample_from_probs,
)
from specserve.spec.drafter import resolve_drafts
from specserve_kernels import check_indices, use_triton
from specserve_kernels.verify_chain import verify_chain, verify_chain_ref

ACCEPT_SALT = 1  # the accept test's uniforms: a stream independent of the sampling race's (and the drafts')


def verify_chains(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    drafts: Sequence[Sequence[int]],
    banned: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    pending: torch.Tensor | None = None,
) -> tuple[list[list[int]], list[list[int]]]:
    """The tokens each chain emits: its accepted prefix of drafts, then one corrected or bonus token;
    and the drafts, placeholders resolved.

    Chain b owns `len(drafts[b]) + 1` consecutive rows of `logits` [R, V] (and of `rows`, `banned`,
    `draft_probs`): one per draft token, then the bonus row. `draft_probs` [R, V] holds the
    distribution each sampled draft was drawn from; a draft row whose q is zero at its token (or no
    `draft_probs` at all) is deterministic (n-gram lookup, a head's or a greedy request's draft):
    q = one-hot. `pending`: the device drafts that placeholders in `drafts` name (`resolve_drafts`:
    a head's graphed chains), resolved on the device and read back with the results. One host copy
    at the end."""
    if all(row.temperature <= 0 for row in rows):
        return verify_greedy_chains(logits, drafts, banned, pending)
    batch = SamplingBatch.build(rows, logits.device)
    if not any(drafts):
        return [[t] for t in sample(logits, batch, banned).tolist()], [[] for _ in drafts]
    device = logits.device
    counts = [len(d) for d in drafts]
    flat = [t for chain in drafts for t in (*chain, 0)]
    has = [j < n for n in counts for j in range(n + 1)]
    pad = [0] * (len(flat) - len(counts))  # per-chain rows are shorter than per-token ones
    host = torch.tensor([flat, has, [*_starts(counts), *pad], [*counts, *pad]], dtype=torch.long)
    draft, mask, starts, num_drafts = to_device(host, device).unbind(0)  # one copy
    starts, num_drafts = starts[: len(counts)], num_drafts[: len(counts)]
    if pending is not None:  # placeholder -(1 + k) names pending[k]
        draft = torch.where(draft >= 0, draft, pending[(-1 - draft).clamp_min(0)])
    probs = filtered_probs(logits, batch, banned)
    if draft_probs is None:  # every q one-hot: the race drops the draft itself
        kernel_q = None
        replacement = sample_from_probs(probs, batch, drop=torch.where(mask.bool(), draft, -1))
    else:
        one_hot = torch.zeros_like(probs).scatter_(1, draft[:, None], mask[:, None].to(probs.dtype))
        draft_probs = draft_probs.to(probs.dtype)
        deterministic = draft_probs.gather(1, draft[:, None]) == 0
        kernel_q = torch.where(deterministic, one_hot, draft_probs)
        replacement = residual_draws(probs, kernel_q * mask[:, None], batch)
    u = accept_uniforms(batch)
    chain = verify_chain if use_triton(device) else verify_chain_ref
    tokens, accepted = chain(
        probs,
        draft,
        starts,
        num_drafts,
        u,
        replacement,
        kernel_q,
        max_drafts=max(counts),
        check_bounds=check_indices(),
    )
    width = tokens.shape[1]
    host = torch.cat([tokens.flatten(), accepted, draft]).tolist()  # the step's one host sync
    chains = [
        host[b * width : b * width + a + 1]
        for b, a in enumerate(host[tokens.numel() : tokens.numel() + len(counts)])
    ]
    flat_drafts = host[tokens.numel() + len(counts) :]
    resolved = [flat_drafts[s : s + n] for s, n in zip(_starts(counts), counts, strict=True)]
    return chains, resolved


def one_hot_chain_rows(
    logits: torch.Tensor, batch: SamplingBatch, drafts: torch.Tensor, has_draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_chains` row by row for deterministic drafts, on the device (the device loop's sampled
    verify: no host sync, capturable). Rows [R, V] of logits, drafts [R] int64, has_draft [R] bool
    (a draft proposed at this row; a bonus row has none). Returns per row the token the chain emits
    if it gets that far (the draft where its accept test passes, else the residual's draw) and
    whether the test passed: the same draws `verify_chains` makes for the same rows and counters."""
    probs = filtered_probs(logits, batch)
    replacement = sample_from_probs(probs, batch, drop=torch.where(has_draft, drafts, -1))
    # verify_chain's test with q(d) = 1: u < p(d), in float64.
    ok = has_draft & (accept_uniforms(batch) < probs.gather(1, drafts[:, None])[:, 0].double())
    return torch.where(ok, drafts, replacement), ok


def accept_uniforms(batch: SamplingBatch) -> torch.Tensor:
    """[R] float64: each row's uniform for the accept test (its own noise stream)."""
    return batch.noise(1, ACCEPT_SALT)[:, 0]


def residual_draws(probs: torch.Tensor, q: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[R] a draw per row from norm(max(p - q, 0)): a rejected row's replacement (bonus rows have
    q = 0, so they draw from p itself)."""
    # The residual is taken from the *filtered* p (filtering after removing q would let tokens outside
    # top-k/top-p in).
    residual = (probs - q).clamp_min(0.0)
    # Rounding can leave a rejected row with no residual mass; p itself is the safe draw then.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs)
    return sample_from_probs(residual, batch)


def verify_greedy_chains(
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    banned: torch.Tensor | None = None,
    pending: torch.Tensor | None = None,
) -> tuple[list[list[int]], list[list[int]]]:
    """`verify_chains` when every row is greedy: p is one-hot at the argmax, so a draft survives iff
    it is the argmax, and the argmax is every rejected row's residual and the bonus. The same outcome
    as the general rule, without its [R, V] probabilities and noise (which cost more than the whole
    forward at batch 16), and without a sampling batch (host work and copies): one argmax, one host
    copy. `pending`: the device drafts that placeholders in `drafts` name (`resolve_drafts`), read
    in the same copy. Returns the emitted tokens and the drafts (placeholders resolved)."""
    argmax = greedy_tokens(logits, banned)
    if pending is None:
        return _greedy_chains(argmax.tolist(), drafts), [list(d) for d in drafts]
    host = torch.cat([argmax, pending]).tolist()  # the step's one host sync: results and drafts
    rows = argmax.shape[0]
    drafts = resolve_drafts(drafts, host[rows:])
    return _greedy_chains(host[:rows], drafts), drafts


def _greedy_chains(argmax: list[int], drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each chain's emitted tokens from the argmax of its rows: the drafts while they match, then
    the argmax at the first mismatch (or the bonus row)."""
    out, row = [], 0
    for chain in drafts:
        best = argmax[row : row + len(chain) + 1]
        accepted = 0
        while accepted < len(chain) and chain[accepted] == best[accepted]:
            accepted += 1
        out.append(best[: accepted + 1])
        row += len(chain) + 1
    return out


def _starts(counts: list[int]) -> list[int]:
    out, start = [], 0
    for n in counts:
        out.append(start)
        start += n + 1
    return out
