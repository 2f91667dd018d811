"""N-gram (prompt lookup) drafting: continue earlier occurrences of the sequence's suffix.

No weights: the draft is deterministic, so its probability is 1 on the proposed token and the
rejection test reduces to accepting with the target's probability of that token.

A chain continues the latest occurrence of the longest matching suffix. A tree (topk > 1) merges
several continuations into a trie: the occurrences of the longest matching suffix (latest first),
then those of shorter suffixes, each continuation inserted in that order, at most `topk` children a
node; the `num_nodes` nodes made first are kept. Every child of a kept node is a candidate verify tests, kept or not.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specserve.spec.drafter import Drafter
from specserve.spec.tree import DraftTree, build_tree

# Continuations merged into one tree, per candidate a node may have.
CONTINUATIONS_PER_TOPK = 4


class NgramDrafter(Drafter):
    def __init__(self, min_match: int, max_match: int) -> None:
        self.min_match, self.max_match = min_match, max_match

    def draft(self, reqs: list, budgets: list[int]) -> None:
        for req, budget in zip(reqs, budgets, strict=True):
            req.draft = self.propose(req.token_ids, budget)

    def draft_tree(self, reqs: list, depths: list[int], topk: int, num_nodes: int) -> None:
        for req, depth in zip(reqs, depths, strict=True):
            tree = self.propose_tree(req.token_ids, depth, topk, num_nodes)
            req.draft, req.draft_tree = list(tree.tokens) if tree else [], tree

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the longest (then latest) earlier match of the suffix."""
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
        """A trie of earlier continuations of the suffix, at most `depth` deep (None: no match)."""
        if depth <= 0 or len(token_ids) < self.min_match + 1:
            return None
        tokens = np.asarray(token_ids, dtype=np.int64)
        # node: (token, parent node or -1); children per node (-1: the root) in insertion order
        nodes: list[tuple[int, int]] = []
        children: dict[int, dict[int, int]] = {-1: {}}
        for follow in self._continuations(tokens, depth, CONTINUATIONS_PER_TOPK * topk):
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
        kept = range(min(len(nodes), num_nodes))  # insertion order: the earliest, parents first
        row = {node: r for r, node in enumerate(kept, start=1)}
        candidates = [[(t, row.get(c, -1)) for t, c in children[-1].items()]]
        candidates += [[(t, row.get(c, -1)) for t, c in children[i].items()] for i in kept]
        parents = [row.get(nodes[i][1], 0) for i in kept]
        return build_tree([nodes[i][0] for i in kept], parents, candidates, topk)

    def _continuations(self, tokens: np.ndarray, depth: int, limit: int) -> list[list[int]]:
        """Up to `limit` continuations (each up to `depth` tokens) of the suffix's earlier
        occurrences: longest suffix first, latest occurrence first."""
        out: list[list[int]] = []
        for n in range(min(self.max_match, len(tokens) - 1), self.min_match - 1, -1):
            for start in _matches(tokens, n)[::-1]:
                out.append(tokens[start + n : start + n + depth].tolist())
                if len(out) >= limit:
                    return out
        return out


def _matches(tokens: np.ndarray, n: int) -> np.ndarray:
    """Starts of the windows of length n, before the suffix itself, equal to the last n tokens."""
    windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
    return np.flatnonzero((windows == tokens[-n:]).all(axis=1))


def _latest_match(tokens: np.ndarray, n: int) -> int | None:
    """Start of the latest window of length n, before the suffix itself, equal to the last n tokens."""
    hits = _matches(tokens, n)
    return int(hits[-1]) if hits.size else None
