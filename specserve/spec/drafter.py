"""What the engine asks of a drafter, and the draft-token choice every model drafter shares.

A drafter fills `Request.draft` (and `draft_probs`, the distribution each sampled draft was drawn
from: verify needs q for its acceptance test) for the requests the engine names; with topk > 1 it
fills `draft` with the nodes of a `DraftTree` instead and sets `draft_tree` (`specserve/spec/tree.py`).
Model drafters
write KV of their own on the request's pages, so the engine reserves those pages first
(`needs_pages`). Drafters that read the target's hidden states name them in `capture` and get them
after every target forward through `after_target`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specserve.engine.request import Request
from specserve.engine.sampler import SamplingBatch, filtered_probs, sample_from_probs
from specserve_kernels import use_triton
from specserve_kernels.draft_top1 import draft_top1, draft_top1_ref

DRAFT_SALT = 2  # a drafter sampling its proposals draws with this noise stream


@dataclass(frozen=True)
class TargetFeed:
    """What one scheduled request's target forward gives a hidden-state drafter: positions
    `start ...` have features at `rows` of the step's feature tensor, and `tokens` are the tokens
    that follow them (each position's next token). `seed`: the request will decode next, so the
    last pair's prediction is its first draft. After a tree verify the rows are the accepted path's
    (root, then each accepted node): its features compacted to consecutive positions."""

    request: Request
    start: int
    tokens: list[int]
    rows: Sequence[int]
    seed: bool


class Drafter:
    needs_pages = False
    # Target features read after each forward: None = none; () = final hidden states;
    # (i, ...) = the residual stream after those target layers.
    capture: tuple[int, ...] | None = None
    # Acceptance that comes in stretches (a lookup's copies): adaptive speculation counts each
    # verify by the tokens it emitted (`AcceptanceTracker.per_token`, specserve/spec/acceptance.py).
    acceptance_in_stretches = False

    def draft(self, reqs: list[Request], budgets: list[int]) -> None:
        raise NotImplementedError

    def draft_tree(self, reqs: list[Request], depths: list[int], topk: int, num_nodes: int) -> None:
        """Give each request a tree of at most `num_nodes` nodes, `depths[i]` deep, `topk` candidates a node."""
        raise NotImplementedError

    @staticmethod
    def tree_slots(depth: int, topk: int, num_nodes: int) -> int:
        """KV slots past a request's tokens that drafting and verifying such a tree writes: verify's
        one per node; a model drafter's forwards over up to topk paths of depth - 1 nodes each."""
        return max(num_nodes, topk * (depth - 1))

    def take_pending_drafts(self) -> torch.Tensor | None:
        """Drafts the last `draft` left on the device, once (then None): those requests' `draft`
        lists hold placeholders -(1 + k) for entry k (`resolve_drafts`), which the verify step's
        input resolves on the device and verify reads back with its own results. None: every draft
        is a host int."""
        return None

    def after_target(self, feeds: list[TargetFeed], features: torch.Tensor) -> None:
        """Called after each target forward and verify, before the step's results are applied."""

    def skip_target(self, feeds: list[TargetFeed], features: torch.Tensor) -> None:
        """`after_target` of a step that drafts nothing (speculation off for it): a drafter may put
        the work off until it drafts again, as long as its drafts then are what they would have been."""
        self.after_target(feeds, features)


def choose_drafts(
    logits: torch.Tensor,
    reqs: Sequence[Request],
    counters: Sequence[int],
    vocab: int,
    to_target_ids: Callable[[torch.Tensor], torch.Tensor] = lambda ids: ids,
    to_target_probs: Callable[[torch.Tensor, int], torch.Tensor] = lambda probs, vocab: probs,
) -> tuple[list[int], torch.Tensor | None]:
    """Draft tokens for rows of draft logits [R, V_draft]: the argmax for greedy requests (top-1 in
    one fused pass), a draw from the filtered distribution q for sampling ones. Returns the target
    ids and, when any row samples, q over the target vocabulary [R, vocab] (one-hot on greedy rows).
    `counters[i]` is the output index the draft on row i proposes (seeds its noise)."""
    if all(r.greedy for r in reqs):  # greedy: no sampling rows to build
        return greedy_drafts(logits, to_target_ids), None
    rows = [r.sampling_row(c) for r, c in zip(reqs, counters, strict=True)]
    batch = SamplingBatch.build(rows, logits.device)
    q = filtered_probs(logits, batch)
    ids = sample_from_probs(q, batch, salt=DRAFT_SALT)
    return to_target_ids(ids).tolist(), to_target_probs(q, vocab)


def greedy_drafts(
    logits: torch.Tensor, to_target_ids: Callable[[torch.Tensor], torch.Tensor] = lambda ids: ids
) -> list[int]:
    """The argmax of each row of draft logits [R, V_draft] as target ids (top-1 in one fused pass)."""
    top1 = draft_top1 if use_triton(logits.device) else draft_top1_ref
    ids, _ = top1(logits)
    return to_target_ids(ids).tolist()


def resolve_drafts(drafts: Sequence[Sequence[int]], pending: Sequence[int]) -> list[list[int]]:
    """Draft chains with their placeholders -(1 + k) (`Drafter.take_pending_drafts`) replaced by
    entry k of `pending`, the host copy of the device drafts they name."""
    return [[t if t >= 0 else pending[-1 - t] for t in chain] for chain in drafts]
