"""Draft trees: what a tree drafter proposes, and the EAGLE-2 search model drafters grow them with.

A `DraftTree` is laid out the way verify reads it: row 0 is the root (the request's last verified
token), rows 1..N the drafted nodes in an order where every parent comes before its children, so any
prefix of the rows is a tree too (the scheduler may cut a tree to fit its token budget). Node r
sits at position root + depth(r) but at context slot root + r: verify writes its KV there, and the
accepted path is compacted to root + 1, root + 2, ... afterwards (`specserve/engine/engine.py`).

Each row also lists the *candidates* verify tests there, in test order: the tokens the drafter
proposed after that node, with the candidate's own row, or -1 for one the tree dropped (the best N
by cumulative probability are kept). Dropped candidates are still tested: for a sampled tree that is
what keeps it lossless (`specserve/spec/tree_verify.py`), and an accepted one still emits its token.

`TreeSearch` is EAGLE-2's dynamic tree, batched over requests: from the root's distribution take
`topk` candidates; then per step expand the `topk` best nodes of the newest depth (by cumulative
log-probability), each into `topk` children; finally keep the best `num_nodes`. Greedy requests take
each node's top-k tokens (scored by the draft's log-softmax); sampling requests draw the k children
*without replacement* from the drafter's filtered distribution q (the exponential race's k first
arrivals), scored by log q, with noise of their own per node and verify round.

The search keeps its nodes in [request, node id] arrays, so a step costs a few numpy calls over
every request and node, not Python work per candidate (an object and a few list appends each: some
17,000 a round at batch 64, depth 5, topk 8); `tests/tree_reference.py` keeps the plain statement
of the same search, which the arrays must match bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.engine.host_copy import to_device
from specserve.engine.request import Request
from specserve.engine.sampler import SamplingBatch, filtered_probs, uniform_noise_host
from specserve_kernels.top_logits import row_top_logits

TREE_DRAFT_SALT = 3  # the noise stream tree drafters sample children with (verify uses 0 and 1)


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]  # node r (1..N) proposes tokens[r - 1]
    parents: np.ndarray  # [N] int64: parent row of node r at [r - 1] (0 = the root), < r
    cand_tokens: np.ndarray  # [N + 1, K] int64: each row's candidates in test order, -1 past the end
    cand_rows: np.ndarray  # [N + 1, K] int64: the candidate's row, -1 where it has none
    # [N + 1, V] the distribution each row's candidates were drawn from (zero rows where none were),
    # on the target's vocabulary; None: candidates chosen deterministically (greedy top-k, n-gram).
    q: torch.Tensor | None = None

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> np.ndarray:
        """[N + 1] depth of every row (the root's is 0)."""
        return tree_depths(self.parents)

    def truncated(self, num_nodes: int) -> DraftTree:
        """The tree of its first `num_nodes` nodes (their candidates past the cut lose their rows)."""
        if num_nodes >= self.num_nodes:
            return self
        rows = self.cand_rows[: num_nodes + 1]
        return DraftTree(
            self.tokens[:num_nodes],
            self.parents[:num_nodes],
            self.cand_tokens[: num_nodes + 1],
            np.where(rows > num_nodes, -1, rows),
            None if self.q is None else self.q[: num_nodes + 1],
        )


def tree_depths(parents: np.ndarray) -> np.ndarray:
    """Depth of row 0 (0) and of each node r whose parent row is parents[r - 1] (< r)."""
    depth = np.zeros(len(parents) + 1, dtype=np.int64)
    for r, parent in enumerate(parents.tolist(), start=1):
        depth[r] = depth[parent] + 1
    return depth


def build_tree(
    tokens: Sequence[int],
    parents: Sequence[int],
    candidates: Sequence[Sequence[tuple[int, int]]],
    width: int,
    q: torch.Tensor | None = None,
) -> DraftTree:
    """A `DraftTree` from plain lists: `candidates[r]` is row r's (token, row or -1) in test order."""
    cand_tokens = np.full((len(tokens) + 1, width), -1, dtype=np.int64)
    cand_rows = np.full_like(cand_tokens, -1)
    for r, cands in enumerate(candidates):
        for i, (token, row) in enumerate(cands):
            cand_tokens[r, i], cand_rows[r, i] = token, row
    return DraftTree(tuple(tokens), np.asarray(parents, dtype=np.int64), cand_tokens, cand_rows, q)


@dataclass(frozen=True)
class Expansion:
    """Nodes one search step expands: request index and node id (-1: the root). Each request's rows
    are contiguous and requests ascend (what `roots` and `frontier` give): the new nodes' ids then
    follow in row order, as one cumulative sum."""

    request: np.ndarray  # [R] int64
    node: np.ndarray  # [R] int64

    def __len__(self) -> int:
        return len(self.node)


class TreeSearch:
    """One draft round of EAGLE-2 for `reqs`: request b's tree is at most `depths[b]` deep.

    The nodes live in [B, capacity] arrays (node id n of request b at [b, n], ids in order of
    creation), so each step is a few array operations over every request and node, with no Python
    object per candidate. A node's children have consecutive ids (one expansion makes them)."""

    def __init__(
        self,
        reqs: Sequence[Request],
        depths: Sequence[int],
        topk: int,
        num_nodes: int,
        vocab: int,
        to_target_ids: Callable[[torch.Tensor], torch.Tensor] = lambda ids: ids,
        to_target_probs: Callable[[torch.Tensor, int], torch.Tensor] = lambda probs, vocab: probs,
        deterministic: bool = False,
    ) -> None:
        self.reqs = list(reqs)
        self.depths = np.asarray(depths, dtype=np.int64).reshape(len(self.reqs))
        self.topk, self.num_nodes, self.vocab = topk, num_nodes, vocab
        self.to_target_ids, self.to_target_probs = to_target_ids, to_target_probs
        shape = (len(self.reqs), self.capacity(int(self.depths.max(initial=0)), topk))
        self.token = np.zeros(shape, dtype=np.int64)  # target vocabulary
        self.parent = np.full(shape, -1, dtype=np.int64)  # node id, -1 = the root
        self.depth = np.zeros(shape, dtype=np.int64)
        self.score = np.zeros(shape, dtype=np.float64)  # cumulative log-probability of the path
        self.first_child = np.zeros(shape, dtype=np.int64)
        self.num_children = np.zeros(shape, dtype=np.int64)  # 0 until expanded
        self.count = np.zeros(len(self.reqs), dtype=np.int64)  # nodes per request
        self.root_children = np.zeros(len(self.reqs), dtype=np.int64)  # ids 0 .. n - 1
        # What each expanded node's children were drawn from (sampling requests): a row of one of
        # `q_parts` (an expansion's q), by its row in their concatenation; -1: none.
        self.q_parts: list[torch.Tensor] = []
        self.q_row = np.full(shape, -1, dtype=np.int64)
        self.root_q_row = np.full(len(self.reqs), -1, dtype=np.int64)
        # Per-request constants of the round, read once.
        # `deterministic`: every request takes the top k (a head's trees), sampling ones too.
        self.greedy = np.array([deterministic or r.params.greedy for r in self.reqs], dtype=bool)
        self.fixed = np.array([r.sampling_fixed for r in self.reqs], dtype=np.float64).reshape(-1, 4)
        self.seed = np.array([r.seed for r in self.reqs], dtype=np.int64)
        self.num_output = np.array([r.num_output for r in self.reqs], dtype=np.int64)
        self.round = np.array([r.spec_verify_ct for r in self.reqs], dtype=np.int64)

    @staticmethod
    def capacity(depth: int, topk: int) -> int:
        """Most nodes a request gets: topk at depth 1, then topk children of topk nodes per depth."""
        return topk + max(depth - 1, 0) * topk * topk

    # ---- the search ------------------------------------------------------------------------

    def roots(self) -> Expansion:
        live = np.flatnonzero(self.depths > 0)
        return Expansion(live, np.full(len(live), -1, dtype=np.int64))

    def frontier(self, step: int) -> Expansion:
        """The nodes step `step` (1..) expands: per request still this deep, its `topk` best nodes
        of depth `step` (ties to the earlier node)."""
        ids = np.arange(self.token.shape[1])
        level = (self.depth == step) & (ids < self.count[:, None]) & (self.depths > step)[:, None]
        # A stable sort of -score keeps equal scores in id order; other depths sort last.
        order = np.argsort(np.where(level, -self.score, np.inf), axis=1, kind="stable")[:, : self.topk]
        taken = np.arange(order.shape[1]) < np.minimum(level.sum(axis=1), self.topk)[:, None]
        request, _ = np.nonzero(taken)
        return Expansion(request, order[taken])

    def path(self, b: int, node: int) -> list[int]:
        """Node ids from depth 1 down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = int(self.parent[b, node])
        return out[::-1]

    def path_tokens(self, b: int, node: int) -> list[int]:
        """Tokens from depth 1 down to `node`."""
        return self.token[b, self.path(b, node)].tolist()

    def expand(self, where: Expansion, logits: torch.Tensor) -> None:
        """Children of the nodes `where` names, from the drafter's logits there [len(where), V_draft]."""
        if not len(where):
            return
        b, parent = where.request, where.node
        assert (b[1:] >= b[:-1]).all(), "an expansion's requests ascend"
        ids, scores, q = self._candidates(where, logits)
        # Each node's children up to the first -inf score (q has no more support past it).
        kept = np.cumprod(scores != -np.inf, axis=1, dtype=bool)
        kids = kept.sum(axis=1)
        before = np.cumsum(kids) - kids  # children of earlier rows, over every request
        first = self.count[b] + before - before[np.searchsorted(b, b)]  # after the request's earlier rows
        self.count += np.bincount(b, weights=kids, minlength=len(self.count)).astype(np.int64)
        # New nodes in row order (kept is a prefix of each row): flat [B * capacity] indices.
        rows = np.repeat(np.arange(len(b)), kids)
        flat = (b * self.token.shape[1] + first - before)[rows] + np.arange(len(rows))
        is_root = parent < 0
        above = np.maximum(parent, 0)
        self.token.ravel()[flat] = ids[kept]
        self.parent.ravel()[flat] = parent[rows]
        self.depth.ravel()[flat] = (np.where(is_root, 0, self.depth[b, above]) + 1)[rows]
        self.score.ravel()[flat] = np.where(is_root, 0.0, self.score[b, above])[rows] + scores[kept]
        self.root_children[b[is_root]] = kids[is_root]
        self.first_child[b[~is_root], parent[~is_root]] = first[~is_root]
        self.num_children[b[~is_root], parent[~is_root]] = kids[~is_root]
        if q is not None:
            self._keep_q(where, q)

    def _keep_q(self, where: Expansion, q: torch.Tensor) -> None:
        """Record the sampling rows' q (greedy rows of a mixed expansion have none)."""
        offset = sum(part.shape[0] for part in self.q_parts)
        self.q_parts.append(q)
        row = np.where(self.greedy[where.request], -1, offset + np.arange(len(where)))
        is_root = where.node < 0
        self.root_q_row[where.request[is_root]] = row[is_root]
        self.q_row[where.request[~is_root], where.node[~is_root]] = row[~is_root]

    def _candidates(
        self, where: Expansion, logits: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray, torch.Tensor | None]:
        """Per expanded node: up to topk (target ids, log-probability) on the host, best / first
        drawn first, and the sampling rows' q over the target vocabulary (None if all greedy)."""
        k = min(self.topk, logits.shape[1])
        greedy = self.greedy[where.request]
        if greedy.all():
            return (*_to_host(*self._top(logits, k)), None)
        ids, scores, q = self._race(where, logits, k)
        if greedy.any():  # greedy rows of a mixed expansion take the top k instead
            top_ids, top_scores = self._top(logits, k)
            rows = to_device(torch.from_numpy(greedy[:, None]), logits.device)
            ids, scores = torch.where(rows, top_ids, ids), torch.where(rows, top_scores, scores)
        return (*_to_host(ids, scores), self.to_target_probs(q, self.vocab))

    def _top(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k likeliest tokens (target ids) and their log-probabilities."""
        scores, ids = top_logprobs(logits, k)
        return self.to_target_ids(ids), scores

    def _race(
        self, where: Expansion, logits: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k draws without replacement from each row's q (target ids, log q; -inf past q's
        support), and q itself (draft vocabulary)."""
        b = where.request
        depth = np.where(where.node < 0, 0, self.depth[b, np.maximum(where.node, 0)])
        counters = self.num_output[b] + depth
        batch = SamplingBatch.from_columns(self.fixed[b], self.seed[b], counters, logits.device)
        q = filtered_probs(logits, batch)
        noise_counters = (self._stream(b, where.node) << 32) | counters
        u = uniform_noise_host(self.seed[b], noise_counters, q.shape[-1], logits.device, salt=TREE_DRAFT_SALT)
        # Exponential race: the k first arrivals (largest q / E) are k draws without replacement, in
        # draw order; tokens with q = 0 never arrive.
        keys = torch.where(q > 0, q.double() / -torch.log(u), -1.0)
        race_keys, race_ids = keys.topk(k, dim=-1)
        race_scores = torch.where(race_keys > 0, q.gather(1, race_ids).log(), float("-inf"))
        return self.to_target_ids(race_ids), race_scores, q

    def _stream(self, b: np.ndarray, node: np.ndarray) -> np.ndarray:
        """A noise stream (< 2**31) per (request, verify round, node): no two expansions share one."""
        return (self.round[b] * 4099 + node + 2) & 0x7FFFFFFF

    # ---- the result ------------------------------------------------------------------------

    def trees(self) -> list[DraftTree | None]:
        """Per request its tree of the best `num_nodes` nodes (None where nothing was drafted)."""
        if not self.count.any():
            return [None] * len(self.reqs)
        kept, sizes = self._kept()
        # Flat [B * capacity] index of each kept node; row of each node in its tree (1..), -1: dropped.
        flat = kept + (np.arange(len(self.reqs)) * self.token.shape[1])[:, None]
        live = np.arange(kept.shape[1]) < sizes[:, None]
        row_of = np.full(self.token.size, -1, dtype=np.int64)
        row_of[flat[live]] = np.nonzero(live)[1] + 1
        up = self.parent.ravel()[flat]
        parents = np.maximum(np.where(up < 0, 0, row_of[flat - kept + np.maximum(up, 0)]), 0)
        cand_tokens, cand_rows = self._candidate_table(flat, live, row_of)
        q = self._tree_q(kept, sizes)
        tokens = self.token.ravel()[flat].tolist()
        return [
            None
            if not self.count[b]
            else DraftTree(
                tuple(tokens[b][:n]),
                parents[b, :n],
                cand_tokens[b, : n + 1],
                cand_rows[b, : n + 1],
                q[b] if q is not None else None,
            )
            for b, n in enumerate(sizes.tolist())
        ]

    def _kept(self) -> tuple[np.ndarray, np.ndarray]:
        """[B, num_nodes] node ids of each tree's rows 1.. (valid up to its size), and the sizes.
        Scores only fall along a path and ties go to the shallower node, so the best N are closed
        under parents and sorted parents-first."""
        ids = np.arange(self.token.shape[1])
        absent = ids >= self.count[:, None]
        # lexsort is stable: equal (score, depth) keep id order.
        order = np.lexsort((self.depth, -self.score, absent), axis=-1)[:, : self.num_nodes]
        return order, np.minimum(self.count, self.num_nodes)

    def _candidate_table(
        self, flat: np.ndarray, live: np.ndarray, row_of: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """[B, num_nodes + 1, topk] each row's children (tokens, rows or -1) in test order, from the
        kept nodes' flat indices; the root's children are ids 0.. of its request."""
        base = (np.arange(len(self.reqs)) * self.token.shape[1])[:, None]
        first = np.concatenate([base, base + self.first_child.ravel()[flat]], axis=1)
        children = np.where(live, self.num_children.ravel()[flat], 0)
        count = np.concatenate([self.root_children[:, None], children], axis=1)
        slot = np.arange(self.topk)
        present = slot < count[..., None]
        child = np.where(present, first[..., None] + slot, 0)
        cand_tokens = np.where(present, self.token.ravel()[child], -1)
        cand_rows = np.where(present, row_of[child], -1)
        return cand_tokens, cand_rows

    def _tree_q(self, kept: np.ndarray, sizes: np.ndarray) -> list[torch.Tensor | None] | None:
        """Per sampling request [size + 1, V]: the root's q, then each kept node's (zero where it
        was not expanded); None for greedy ones. Gathered part by part into one tensor."""
        sampling = np.flatnonzero(~self.greedy & (self.count > 0))
        if not len(sampling):
            return None
        batch = np.arange(len(self.reqs))[:, None]
        rows = np.concatenate([self.root_q_row[:, None], self.q_row[batch, kept]], axis=1)[sampling]
        live = np.arange(rows.shape[1]) < (sizes[sampling] + 1)[:, None]
        src = rows[live]  # each output row's source row, -1: zero
        parts = self.q_parts
        out = parts[0].new_zeros((len(src), parts[0].shape[1]))
        ends = np.cumsum([part.shape[0] for part in parts])
        for part, end in zip(parts, ends.tolist(), strict=True):
            mine = np.flatnonzero((src >= end - part.shape[0]) & (src < end))
            if len(mine):
                dst = to_device(torch.from_numpy(mine), out.device)
                index = to_device(torch.from_numpy(src[mine] - (end - part.shape[0])), out.device)
                out.index_copy_(0, dst, part.index_select(0, index))
        per_request: list[torch.Tensor | None] = [None] * len(self.reqs)
        for b, piece in zip(sampling.tolist(), out.split((sizes[sampling] + 1).tolist()), strict=True):
            per_request[b] = piece
        return per_request


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k likeliest draft tokens' log-probabilities (descending, ties to the lower id on
    the GPU) and ids: each logit less the row's log-sum-exp, no [R, V] log-softmax (the host search
    and the tree graphs alike, so their trees agree on one device)."""
    lse, top, ids = row_top_logits(logits, k)
    return top - lse[:, None], ids


def _to_host(ids: torch.Tensor, scores: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Candidate ids and scores in one device-to-host copy (ids < 2**53 are exact in float64)."""
    both = torch.cat([ids.double(), scores.double()], dim=1).cpu().numpy()
    k = ids.shape[1]
    return both[:, :k].astype(np.int64), both[:, k:]


@dataclass(frozen=True)
class TreeFeed:
    """A model drafter's forward over the nodes a search step expands: per request (ascending, as
    in the expansion) the union of the paths to its expanded nodes, parents first; flat over every
    fed node."""

    requests: np.ndarray  # [F] search indices of the requests fed
    lens: np.ndarray  # [F] nodes fed per request
    request: np.ndarray  # [T] each fed node's request
    node: np.ndarray  # [T] its node id (ascending within a request: parents come first)
    forest: np.ndarray  # [T] its parent among its request's fed nodes (-1: depth 1)
    rows: np.ndarray  # [len(where)] flat row (over every fed node) of each expanded node


def tree_feed(search: TreeSearch, where: Expansion) -> TreeFeed:
    """The feed of a frontier (nodes, not roots: a root's logits come from the drafter's own pass)."""
    shape = search.token.shape
    fed = np.zeros(shape[0] * shape[1], dtype=bool)  # flat over [request, node id]
    parent = search.parent.ravel()
    base, node = where.request * shape[1], where.node
    while len(node):  # every path one ancestor further up per round
        fed[base + node] = True
        up = parent[base + node]
        base, node = base[up >= 0], up[up >= 0]
    flat = np.cumsum(fed) - 1  # each fed node's row over every fed node
    request, nodes = np.divmod(np.flatnonzero(fed), shape[1])
    lens = fed.reshape(shape).sum(axis=1)
    first = np.cumsum(lens) - lens  # each request's first row
    up = search.parent[request, nodes]
    forest = np.where(up < 0, -1, flat[request * shape[1] + np.maximum(up, 0)] - first[request])
    fed_requests = np.flatnonzero(lens)
    rows = flat[where.request * shape[1] + where.node]
    return TreeFeed(fed_requests, lens[fed_requests], request, nodes, forest, rows)
