"""The n-gram drafter's proposals as they were computed before the per-candidate matching and the
token mirror (the whole list converted each call, every sliding window compared for each match
length), kept as the statement the fast `specserve.spec.ngram` is tested against, bit for bit
(`test_ngram_fast.py`; a helper module, not a test file). Same semantics as documented there."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specserve.spec.ngram import CONTINUATIONS_PER_TOPK
from specserve.spec.tree import DraftTree, build_tree


class RefNgramDrafter:
    def __init__(self, min_match: int, max_match: int) -> None:
        self.min_match, self.max_match = min_match, max_match

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        if max_tokens <= 0 or len(token_ids) < self.min_match + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_match, len(tokens) - 1), self.min_match - 1, -1):
            start = _latest_match(tokens, n)
            if start is not None:
                follow = tokens[start + n : start + n + max_tokens]
                return follow.tolist()
        return []

    def propose_tree(
        self, token_ids: Sequence[int], depth: int, topk: int, num_nodes: int
    ) -> DraftTree | None:
        if depth <= 0 or len(token_ids) < self.min_match + 1:
            return None
        tokens = np.asarray(token_ids, dtype=np.int64)
        nodes: list[tuple[int, int]] = []
        children: dict[int, dict[int, int]] = {-1: {}}
        for follow in self.continuations(tokens, depth, CONTINUATIONS_PER_TOPK * topk):
            parent = -1
            for token in follow:
                kids = children[parent]
                if token not in kids:
                    if len(kids) >= topk:
                        break
                    kids[token] = len(nodes)
                    nodes.append((token, parent))
                    children[len(nodes) - 1] = {}
                parent = kids[token]
        if not nodes:
            return None
        kept = range(min(len(nodes), num_nodes))
        row = {node: r for r, node in enumerate(kept, start=1)}
        candidates = [[(t, row.get(c, -1)) for t, c in children[-1].items()]]
        candidates += [[(t, row.get(c, -1)) for t, c in children[i].items()] for i in kept]
        parents = [row.get(nodes[i][1], 0) for i in kept]
        return build_tree([nodes[i][0] for i in kept], parents, candidates, topk)

    def continuations(self, tokens: np.ndarray, depth: int, limit: int) -> list[list[int]]:
        out: list[list[int]] = []
        for n in range(min(self.max_match, len(tokens) - 1), self.min_match - 1, -1):
            for start in _matches(tokens, n)[::-1]:
                out.append(tokens[start + n : start + n + depth].tolist())
                if len(out) >= limit:
                    return out
        return out


def _matches(tokens: np.ndarray, n: int) -> np.ndarray:
    windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
    return np.flatnonzero((windows == tokens[-n:]).all(axis=1))


def _latest_match(tokens: np.ndarray, n: int) -> int | None:
    hits = _matches(tokens, n)
    return int(hits[-1]) if hits.size else None
