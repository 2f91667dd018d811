"""The plain-Python EAGLE-2 tree search, forest feed and forest layout as they were before they
became array code (commit 12916bb), kept as the statement the vectorised `specserve.spec.tree` and
`specserve.engine.step_input` are tested against, bit for bit (a helper module, not a test file).

One `_Node` per candidate, node ids in order of creation, children lists in test order; the search
semantics are the ones documented in `specserve/spec/tree.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.engine.request import Request
from specserve.engine.sampler import SamplingBatch, filtered_probs, uniform_noise
from specserve.spec.tree import TREE_DRAFT_SALT, DraftTree, build_tree, top_logprobs


@dataclass
class _Node:
    token: int
    parent: int  # node id, -1 = the root
    depth: int
    score: float
    children: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None


@dataclass(frozen=True)
class RefExpansion:
    request: list[int]
    node: list[int]

    def __len__(self) -> int:
        return len(self.node)


class RefTreeSearch:
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
        self.newest: list[list[int]] = [[] for _ in self.reqs]
        self.root_children: list[list[int]] = [[] for _ in self.reqs]
        self.root_q: list[torch.Tensor | None] = [None] * len(self.reqs)

    def roots(self) -> RefExpansion:
        live = [b for b, d in enumerate(self.depths) if d > 0]
        return RefExpansion(live, [-1] * len(live))

    def frontier(self, step: int) -> RefExpansion:
        request, node = [], []
        for b, nodes in enumerate(self.nodes):
            if self.depths[b] <= step:
                continue
            newest = [i for i in self.newest[b] if nodes[i].depth == step]
            best = sorted(newest, key=lambda i: (-nodes[i].score, i))[: self.topk]
            request += [b] * len(best)
            node += best
        return RefExpansion(request, node)

    def path(self, b: int, node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(node)
            node = self.nodes[b][node].parent
        return out[::-1]

    def expand(self, where: RefExpansion, logits: torch.Tensor) -> None:
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
                    break
                kids.append(len(nodes))
                self.newest[b].append(len(nodes))
                nodes.append(_Node(int(token), parent, depth, base + float(score)))
            row_q = None if q is None or self.reqs[b].params.greedy else q[j]
            if parent < 0:
                self.root_q[b] = row_q
            else:
                nodes[parent].q = row_q

    def _candidates(self, where: RefExpansion, logits: torch.Tensor):
        k = min(self.topk, logits.shape[1])
        reqs = [self.reqs[b] for b in where.request]
        if all(r.params.greedy for r in reqs):
            scores, ids = top_logprobs(logits, k)  # the search's primitive (ties ordered alike)
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
        keys = torch.where(q > 0, q.double() / -torch.log(u), -1.0)
        race_keys, race_ids = keys.topk(k, dim=-1)
        race_scores = torch.where(race_keys > 0, q.gather(1, race_ids).log(), float("-inf"))
        greedy = (batch.temperature <= 0)[:, None]
        top_scores, top_ids = top_logprobs(logits, k)
        ids = torch.where(greedy, top_ids, race_ids)
        scores = torch.where(greedy, top_scores, race_scores)
        return self.to_target_ids(ids).tolist(), scores.tolist(), self.to_target_probs(q, self.vocab)

    def _depth(self, b: int, node: int) -> int:
        return 0 if node < 0 else self.nodes[b][node].depth

    def _stream(self, b: int, node: int) -> int:
        return (self.reqs[b].spec_verify_ct * 4099 + node + 2) & 0x7FFFFFFF

    def trees(self) -> list[DraftTree | None]:
        return [self._tree(b) for b in range(len(self.reqs))]

    def _tree(self, b: int) -> DraftTree | None:
        nodes = self.nodes[b]
        if not nodes:
            return None
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
class RefTreeFeed:
    requests: list[int]
    nodes: list[list[int]]
    forest: list[np.ndarray]
    rows: list[int]


def ref_tree_feed(search: RefTreeSearch, where: RefExpansion) -> RefTreeFeed:
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
    return RefTreeFeed(order, nodes, forest, rows)


def ref_forest_layout(
    forest: list[np.ndarray | None],
    starts: list[int],
    query_start: np.ndarray,
    max_query_len: int,
    positions: np.ndarray,
) -> list[np.ndarray]:
    flags = np.zeros(len(forest), dtype=np.int64)
    entries = []
    for b, parents in enumerate(forest):
        if parents is None:
            continue
        n = len(parents)
        flags[b] = 1
        seen = np.eye(n, dtype=bool)
        depth = np.zeros(n, dtype=np.int64)
        rows, parents = np.arange(n), np.asarray(parents, dtype=np.int64)
        assert n == query_start[b + 1] - query_start[b] and (parents < rows).all()
        up = parents
        while (live := up >= 0).any():
            seen[rows[live], up[live]] = True
            depth += live
            up = np.where(live, parents[np.maximum(up, 0)], -1)
        positions[query_start[b] : query_start[b + 1]] = starts[b] + depth
        i, j = np.nonzero(seen)
        entries.append((b * max_query_len + i) * max_query_len + j)
    return [flags, np.concatenate(entries)]
