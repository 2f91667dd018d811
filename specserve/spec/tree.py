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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.engine.request import Request
from specserve.engine.sampler import SamplingBatch, filtered_probs, uniform_noise

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


@dataclass
class _Node:
    token: int  # target vocabulary
    parent: int  # node id, -1 = the root
    depth: int
    score: float  # cumulative log-probability of the path
    children: list[int] = field(default_factory=list)  # node ids, in test order
    q: torch.Tensor | None = None  # [V] what the children were drawn from (sampling requests)


@dataclass(frozen=True)
class Expansion:
    """Nodes one search step expands: request index and node id (-1: the root), in a fixed order."""

    request: list[int]
    node: list[int]

    def __len__(self) -> int:
        return len(self.node)


class TreeSearch:
    """One draft round of EAGLE-2 for `reqs`: request b's tree is at most `depths[b]` deep."""

    def __init__(
        self,
        reqs: Sequence[Request],
        depths: Sequence[int],
        topk: int,
        num_nodes: int,
        vocab: int,
        to_target_ids: Callable[[torch.Tensor], torch.Tensor] = lambda ids: ids,
        to_target_probs: Callable[[torch.Tensor, int], torch.Tensor] = lambda probs, vocab: probs,
    ) -> None:
        self.reqs, self.depths = list(reqs), list(depths)
        self.topk, self.num_nodes, self.vocab = topk, num_nodes, vocab
        self.to_target_ids, self.to_target_probs = to_target_ids, to_target_probs
        self.nodes: list[list[_Node]] = [[] for _ in self.reqs]
        self.newest: list[list[int]] = [[] for _ in self.reqs]  # node ids of the last expansion
        self.root_children: list[list[int]] = [[] for _ in self.reqs]
        self.root_q: list[torch.Tensor | None] = [None] * len(self.reqs)

    # ---- the search ------------------------------------------------------------------------

    def roots(self) -> Expansion:
        live = [b for b, d in enumerate(self.depths) if d > 0]
        return Expansion(live, [-1] * len(live))

    def frontier(self, step: int) -> Expansion:
        """The nodes step `step` (1..) expands: per request still this deep, its `topk` best nodes
        of depth `step` (ties to the earlier node)."""
        request, node = [], []
        for b, nodes in enumerate(self.nodes):
            if self.depths[b] <= step:
                continue
            newest = [i for i in self.newest[b] if nodes[i].depth == step]
            best = sorted(newest, key=lambda i: (-nodes[i].score, i))[: self.topk]
            request += [b] * len(best)
            node += best
        return Expansion(request, node)

    def path(self, b: int, node: int) -> list[int]:
        """Node ids from depth 1 down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.nodes[b][node].parent
        return out[::-1]

    def expand(self, where: Expansion, logits: torch.Tensor) -> None:
        """Children of the nodes `where` names, from the drafter's logits there [len(where), V_draft]."""
        if not len(where):
            return
        ids, scores, q = self._candidates(where, logits)
        for b in set(where.request):
            self.newest[b] = []
        for j, (b, parent) in enumerate(zip(where.request, where.node, strict=True)):
            nodes = self.nodes[b]
            base = 0.0 if parent < 0 else nodes[parent].score
            depth = 1 if parent < 0 else nodes[parent].depth + 1
            kids = self.root_children[b] if parent < 0 else nodes[parent].children
            for token, score in zip(ids[j], scores[j], strict=True):
                if score == float("-inf"):
                    break  # q has no more support
                kids.append(len(nodes))
                self.newest[b].append(len(nodes))
                nodes.append(_Node(int(token), parent, depth, base + float(score)))
            row_q = None if q is None or self.reqs[b].params.greedy else q[j]
            if parent < 0:
                self.root_q[b] = row_q
            else:
                nodes[parent].q = row_q

    def _candidates(self, where: Expansion, logits: torch.Tensor):
        """Per expanded node: up to topk (target ids, log-probability) on the host, best / first
        drawn first, and the sampling rows' q over the target vocabulary (None if all greedy)."""
        k = min(self.topk, logits.shape[1])
        reqs = [self.reqs[b] for b in where.request]
        logp = torch.log_softmax(logits.float(), dim=-1)
        if all(r.params.greedy for r in reqs):
            scores, ids = logp.topk(k, dim=-1)
            return self.to_target_ids(ids).tolist(), scores.tolist(), None
        counters = [
            r.num_output + self._depth(b, n) for r, b, n in zip(reqs, where.request, where.node, strict=True)
        ]
        rows = [r.sampling_row(c) for r, c in zip(reqs, counters, strict=True)]
        batch = SamplingBatch.build(rows, logits.device)
        q = filtered_probs(logits, batch)
        streams = [self._stream(b, n) for b, n in zip(where.request, where.node, strict=True)]
        counter = torch.tensor(
            [(s << 32) | c for s, c in zip(streams, counters, strict=True)], device=logits.device
        )
        u = uniform_noise(batch.seed, counter, q.shape[-1], salt=TREE_DRAFT_SALT)
        # Exponential race: the k first arrivals (largest q / E) are k draws without replacement, in
        # draw order; tokens with q = 0 never arrive.
        keys = torch.where(q > 0, q.double() / -torch.log(u), -1.0)
        race_keys, race_ids = keys.topk(k, dim=-1)
        race_scores = torch.where(race_keys > 0, q.gather(1, race_ids).log(), float("-inf"))
        greedy = (batch.temperature <= 0)[:, None]
        top_scores, top_ids = logp.topk(k, dim=-1)
        ids = torch.where(greedy, top_ids, race_ids)
        scores = torch.where(greedy, top_scores, race_scores)
        return self.to_target_ids(ids).tolist(), scores.tolist(), self.to_target_probs(q, self.vocab)

    def _depth(self, b: int, node: int) -> int:
        return 0 if node < 0 else self.nodes[b][node].depth

    def _stream(self, b: int, node: int) -> int:
        """A noise stream (< 2**31) per (request, verify round, node): no two expansions share one."""
        round_ = self.reqs[b].spec_verify_ct
        return (round_ * 4099 + node + 2) & 0x7FFFFFFF

    # ---- the result ------------------------------------------------------------------------

    def trees(self) -> list[DraftTree | None]:
        """Per request its tree of the best `num_nodes` nodes (None where nothing was drafted)."""
        return [self._tree(b) for b in range(len(self.reqs))]

    def _tree(self, b: int) -> DraftTree | None:
        nodes = self.nodes[b]
        if not nodes:
            return None
        # Scores only fall along a path and ties go to the shallower node, so the best N are closed
        # under parents and sorted parents-first.
        kept = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))[: self.num_nodes]
        row = {node: r for r, node in enumerate(kept, start=1)}
        parents = [row.get(nodes[i].parent, 0) for i in kept]
        candidates = [[(nodes[c].token, row.get(c, -1)) for c in self.root_children[b]]]
        candidates += [[(nodes[c].token, row.get(c, -1)) for c in nodes[i].children] for i in kept]
        q = None
        if not self.reqs[b].params.greedy:
            rows_q = [self.root_q[b], *(nodes[i].q for i in kept)]
            zero = torch.zeros_like(self.root_q[b])
            q = torch.stack([zero if x is None else x for x in rows_q])
        return build_tree([nodes[i].token for i in kept], parents, candidates, self.topk, q)


@dataclass(frozen=True)
class TreeFeed:
    """A model drafter's forward over the nodes a search step expands: per request (in order of
    first appearance in the expansion) the union of the paths to its expanded nodes, parents first."""

    requests: list[int]  # search indices of the requests fed
    nodes: list[list[int]]  # per fed request, node ids (ascending: parents come first)
    forest: list[np.ndarray]  # per fed request, each fed node's parent among its fed nodes (-1: depth 1)
    rows: list[int]  # flat row (over every fed node) of each expanded node, in expansion order


def tree_feed(search: TreeSearch, where: Expansion) -> TreeFeed:
    order: list[int] = []
    union: dict[int, set[int]] = {}
    for b, node in zip(where.request, where.node, strict=True):
        if b not in union:
            order.append(b)
            union[b] = set()
        union[b].update(search.path(b, node))
    nodes = [sorted(union[b]) for b in order]
    local = [{node: j for j, node in enumerate(fed)} for fed in nodes]
    forest = [
        np.array([loc.get(search.nodes[b][n].parent, -1) for n in fed], dtype=np.int64)
        for b, fed, loc in zip(order, nodes, local, strict=True)
    ]
    offsets = dict(zip(order, np.cumsum([0, *map(len, nodes)]).tolist(), strict=False))
    position = dict(zip(order, local, strict=True))
    rows = [offsets[b] + position[b][node] for b, node in zip(where.request, where.node, strict=True)]
    return TreeFeed(order, nodes, forest, rows)
