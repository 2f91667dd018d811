"""Lossless acceptance over draft trees: greedy walk, and multi-candidate rejection sampling.

At a tree row with target distribution p (filtered, as `sample` draws) the candidates c_1..c_K are
tested in order. Candidate i is accepted with probability min(1, p_i(c_i) / q_i(c_i)); on rejection

    p_{i+1} = norm(max(p_i - q_i, 0)),   q_{i+1} = norm(q_i with c_i removed),

and when all K are rejected the row draws from p_{K+1}. With the c_i drawn one after another without
replacement from the drafter's q (`TreeSearch`), each step is an ordinary rejection test of p_i
against the proposal c_i was really drawn from (the tokens before it removed), and a rejection
leaves exactly the residual p_{i+1}, whatever c_i was: by induction the row emits a token with
distribution p (recursive rejection sampling; SpecInfer and EAGLE use this family). A deterministic
candidate list (n-gram continuations, greedy top-k) is the case q_i = one-hot(c_i): accept with
p_i(c_i), else remove c_i from p and renormalise. Greedy rows have one-hot p: the argmax is accepted
if proposed, else it is the residual draw.

A row's candidates are tested whether or not the tree kept a row for them: which ones are kept
depends on their own draws (their scores), so testing only the kept ones would bias the outcome. An
accepted candidate with a row continues the walk there; one without ends the step with its token.
The noise: per row, K accept uniforms (stream ACCEPT_SALT) and the residual draw (stream 0), keyed
by (request seed, output index) like every other draw, so only one row per output index is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.engine.host_copy import to_device
from specserve.engine.sampler import (
    SamplingBatch,
    SamplingRow,
    filtered_probs,
    sample,
    sample_from_probs,
)
from specserve.spec.tree import DraftTree
from specserve.spec.verify import ACCEPT_SALT
from specserve_kernels import use_triton
from specserve_kernels.verify_tree import verify_tree, verify_tree_ref


@dataclass(frozen=True)
class TreeOutcome:
    tokens: list[int]  # emitted: the accepted path's tokens, then one residual, bonus or row-less token
    rows: list[int]  # the rows the emitted tokens were drawn at: 0, then the accepted path's rows

    @property
    def path(self) -> list[int]:
        """The accepted nodes' rows (their KV is kept, moved to the root's next slots)."""
        return self.rows[1:]


def verify_trees(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    trees: Sequence[DraftTree | None],
    banned: torch.Tensor | None = None,
    *,
    check_bounds: bool = False,
) -> list[TreeOutcome]:
    """The outcome of each request's tree. Request b owns `1 + trees[b].num_nodes` consecutive rows
    of `logits` [R, V] (and of `rows`, `banned`): its root, then its nodes in tree order (a None tree
    is the root alone: plain sampling). One host copy at the end."""
    device = logits.device
    sizes = [1 + (t.num_nodes if t is not None else 0) for t in trees]
    width = max((t.cand_tokens.shape[1] for t in trees if t is not None), default=1)
    cand_tokens, cand_rows = _candidate_blocks(trees, sizes, width)
    batch = SamplingBatch.build(rows, device)
    host = torch.from_numpy(np.stack([cand_tokens, cand_rows]))
    tokens, children = to_device(host, device).unbind(0)
    present = tokens >= 0
    starts_host = np.cumsum([0, *sizes[:-1]])
    if batch.all_greedy:
        # p is one-hot: the argmax wins wherever it is a candidate, and is every row's residual.
        draws = sample(logits, batch, banned)
        accept = ((tokens == draws[:, None]) & present).double()
        u = torch.full(accept.shape, 0.5, dtype=torch.float64, device=device)
    else:
        accept, draws, u = _sampled_tests(logits, batch, banned, trees, sizes, starts_host, tokens, present)
    starts, sizes_dev = to_device(torch.from_numpy(np.stack([starts_host, sizes])), device).unbind(0)
    depth = (
        max(int(t.depths.max()) for t in trees if t is not None) if any(t is not None for t in trees) else 0
    )
    walk = verify_tree if use_triton(device) else verify_tree_ref
    out_tokens, out_path, counts = walk(
        accept.contiguous(),
        tokens.contiguous(),
        children.contiguous(),
        u.contiguous(),
        draws,
        starts,
        sizes_dev,
        depth + 1,
        vocab=logits.shape[1],
        check_bounds=check_bounds,
    )
    out_tokens, out_path, counts = out_tokens.tolist(), out_path.tolist(), counts.tolist()
    return [
        TreeOutcome(t[: n + 1], [0, *p[:n]]) for t, p, n in zip(out_tokens, out_path, counts, strict=True)
    ]


def _sampled_tests(logits, batch, banned, trees, sizes, starts_host, tokens, present):
    """Accept probabilities [R, K], residual draws [R] and accept uniforms [R, K] of a batch with
    sampling rows: closed form for one-hot proposals, the recursion where a tree carries q."""
    probs = filtered_probs(logits, batch, banned)
    accept, residual = _deterministic(probs, tokens, present)
    sampled = [t is not None and t.q is not None for t in trees]
    if any(sampled):
        blocks = [np.arange(s, s + n) for s, n, x in zip(starts_host, sizes, sampled, strict=True) if x]
        index = to_device(torch.from_numpy(np.concatenate(blocks)), probs.device)
        q = torch.cat([t.q for t, s in zip(trees, sampled, strict=True) if s]).to(probs.device, probs.dtype)
        a, res = _recursive(probs[index], q, tokens[index], present[index])
        accept, residual = accept.index_copy(0, index, a), residual.index_copy(0, index, res)
    # Rounding can leave a row with no residual mass; p itself is the safe draw then.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs)
    u = batch.noise(tokens.shape[1], ACCEPT_SALT)
    return accept, sample_from_probs(residual, batch), u


def _candidate_blocks(trees, sizes: list[int], width: int) -> tuple[np.ndarray, np.ndarray]:
    """[R, width] candidate tokens and local rows of every request's rows, -1 padded."""
    total = sum(sizes)
    cand_tokens = np.full((total, width), -1, dtype=np.int64)
    cand_rows = np.full((total, width), -1, dtype=np.int64)
    offset = 0
    for tree, size in zip(trees, sizes, strict=True):
        if tree is not None:
            k = tree.cand_tokens.shape[1]
            cand_tokens[offset : offset + size, :k] = tree.cand_tokens
            cand_rows[offset : offset + size, :k] = tree.cand_rows
        offset += size
    return cand_tokens, cand_rows


def _deterministic(probs: torch.Tensor, tokens: torch.Tensor, present: torch.Tensor):
    """Accept probabilities [R, K] (float64) and residuals [R, V] for one-hot proposals: candidate i
    wins with p(c_i) / (mass left after removing c_1..c_{i-1}); the residual is p without them all."""
    p = probs.double()
    ids = tokens.clamp_min(0)
    picked = p.gather(1, ids) * present
    left = p.sum(-1, keepdim=True) - (picked.cumsum(-1) - picked)
    accept = torch.where(left > 0, picked / left.clamp_min(1e-300), 0.0).clamp(0.0, 1.0)
    # scatter_add, not scatter: padding columns point at token 0 too, and must not clear it.
    removed = torch.zeros_like(probs).scatter_add_(1, ids, present.to(probs.dtype)) > 0
    return accept, probs.masked_fill(removed, 0.0)


def _recursive(probs: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, present: torch.Tensor):
    """Accept probabilities [S, K] and residuals [S, V] for candidates drawn from q without
    replacement: the recursion of the module docstring, one candidate column at a time."""
    p = probs.double() / probs.sum(-1, keepdim=True).clamp_min(1e-300)
    q = q.double()
    accept = torch.zeros(tokens.shape, dtype=torch.float64, device=probs.device)
    for i in range(tokens.shape[1]):
        c, live = tokens[:, i : i + 1].clamp_min(0), present[:, i : i + 1]
        q_i = q / q.sum(-1, keepdim=True).clamp_min(1e-300)
        # A candidate q could not have drawn (q_i(c) = 0) is tested as a deterministic proposal.
        drawable = q_i.gather(1, c) > 0
        q_i = torch.where(drawable, q_i, torch.zeros_like(q_i).scatter_(1, c, 1.0))
        ratio = p.gather(1, c) / q_i.gather(1, c)
        accept[:, i] = torch.where(live, ratio.clamp(max=1.0), 0.0)[:, 0]
        rest = (p - q_i).clamp_min(0.0)
        mass = rest.sum(-1, keepdim=True)
        p = torch.where(live & (mass > 0), rest / mass.clamp_min(1e-300), p)
        q = torch.where(live, q.scatter(1, c, 0.0), q)
    return accept, p.to(probs.dtype)
