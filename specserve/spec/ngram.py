"""N-gram (prompt lookup) drafting: continue earlier occurrences of the sequence's suffix.

No weights: the draft is deterministic, so its probability is 1 on the proposed token and the
rejection test reduces to accepting with the target's probability of that token.

A chain continues the latest occurrence of the longest matching suffix. A tree (topk > 1) merges
several continuations into a trie: the occurrences of the longest matching suffix (latest first),
then those of shorter suffixes, each continuation inserted in that order, at most `topk` children a
node; the `num_nodes` nodes made first are kept. Every child of a kept node is a candidate verify tests, kept or not.

The search is per candidate, not per window: an earlier occurrence of a suffix of length n ends
at a position p holding the sequence's last token, and is followed by the tokens from p + 1 on
whatever n is. So one pass finds those ends, each is extended backwards (at most `max_match`
comparisons of a small index array) to its match length, and the matches of every n follow from
those lengths. The tokens come from the request's `token_mirror` (an int64 array only appended to),
not from converting the whole list every step. `tests/ngram_reference.py` keeps the windowed search
this replaced; the two agree bit for bit (`tests/test_ngram_fast.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specserve.spec.drafter import Drafter
from specserve.spec.tree import DraftTree, build_tree

# Continuations merged into one tree, per candidate a node may have.
CONTINUATIONS_PER_TOPK = 4
# A chain's candidate ends are extended in Python up to this many, beyond with array operations
# (cheaper per candidate, dearer per call).
PYTHON_CANDIDATES = 64
# With more candidates than that, the latest this many are still tried in Python first: a full
# match among them ends the search before any array operation.
PRESCAN_CANDIDATES = 8


class NgramDrafter(Drafter):
    acceptance_in_stretches = True  # a continuation copied while it lasts, then misses

    def __init__(self, min_match: int, max_match: int) -> None:
        self.min_match, self.max_match = min_match, max_match
        self._back = np.arange(max_match, dtype=np.int64)  # offsets back from a match's end
        self._suffix = -1 - self._back  # the suffix's positions, the last first
        self._ahead = np.arange(16, dtype=np.int64)  # offsets into a continuation
        self.python_candidates = PYTHON_CANDIDATES

    def draft(self, reqs: list, budgets: list[int]) -> None:
        for req, budget in zip(reqs, budgets, strict=True):
            tokens = _known_tokens(req)
            req.draft = self._propose(tokens, req.token_ids, budget) if tokens is not None else []

    def draft_tree(self, reqs: list, depths: list[int], topk: int, num_nodes: int) -> None:
        for req, depth in zip(reqs, depths, strict=True):
            tokens = _known_tokens(req)
            tree = self._propose_tree(tokens, depth, topk, num_nodes) if tokens is not None else None
            req.draft, req.draft_tree = list(tree.tokens) if tree else [], tree

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the longest (then latest) earlier match of the suffix."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        return self._propose(
            tokens, token_ids if isinstance(token_ids, list) else tokens.tolist(), max_tokens
        )

    def lookup(self, tokens: np.ndarray, seq: list[int], max_tokens: int) -> list[int]:
        """`propose` over a request's tokens already held both ways (`tokens` int64; `seq` a list that
        starts with them, read no further): no conversion (the adaptive policy's shadow drafts)."""
        return self._propose(tokens, seq, max_tokens)

    def propose_tree(
        self, token_ids: Sequence[int], depth: int, topk: int, num_nodes: int
    ) -> DraftTree | None:
        """A trie of earlier continuations of the suffix, at most `depth` deep (None: no match)."""
        return self._propose_tree(np.asarray(token_ids, dtype=np.int64), depth, topk, num_nodes)

    def _propose(self, tokens: np.ndarray, seq: list[int], max_tokens: int) -> list[int]:
        """`propose` over `tokens`, which `seq` starts with (read by the Python extension, below len(tokens))."""
        size = len(tokens)
        if max_tokens <= 0 or size < self.min_match + 1:
            return []
        top = min(self.max_match, size - 1)
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if not ends.size:
            return []
        many = len(ends) > self.python_candidates
        # Few candidates: extending each in Python, the latest first, costs less than the array
        # operations' calls, and stops at the first that matches `top` tokens. Many: the latest
        # few first all the same, as the latest full match is the answer however many come before
        # it (repetitive text, where the lookup pays off, has one at the very end).
        latest = ends[-PRESCAN_CANDIDATES:] if many else ends
        best, end = 0, -1
        for p in reversed(latest.tolist()):
            m = 1
            while m < top and m <= p and seq[p - m] == seq[size - 1 - m]:
                m += 1
            if m > best:
                best, end = m, p
                if m == top:
                    break
        if many and best < top:
            lengths = self._lengths(tokens, ends, top)
            i = len(lengths) - 1 - int(np.argmax(lengths[::-1]))  # the latest of the longest
            best, end = int(lengths[i]), int(ends[i])
        if best < self.min_match:
            return []
        return tokens[end + 1 : end + 1 + max_tokens].tolist()

    def _propose_tree(self, tokens: np.ndarray, depth: int, topk: int, num_nodes: int) -> DraftTree | None:
        if depth <= 0 or len(tokens) < self.min_match + 1:
            return None
        # node: (token, parent node or -1); children per node (-1: the root) in insertion order
        nodes: list[tuple[int, int]] = []
        children: dict[int, dict[int, int]] = {-1: {}}
        for follow in self._continuations(tokens, depth, CONTINUATIONS_PER_TOPK * topk):
            parent = -1
            for token in follow:
                kids = children[parent]
                node = kids.get(token)
                if node is None:
                    if len(kids) >= topk:
                        break
                    node = kids[token] = len(nodes)
                    nodes.append((token, parent))
                    if node < num_nodes:
                        children[node] = {}
                if node >= num_nodes:  # not kept, nor would its descendants be: they change nothing
                    break
                parent = node
        if not nodes:
            return None
        # Insertion order keeps the earliest nodes, parents first: node i is row i + 1 (0: the root).
        k = min(len(nodes), num_nodes)
        candidates = [[(t, c + 1 if c < k else -1) for t, c in children[i].items()] for i in range(-1, k)]
        return build_tree([t for t, _ in nodes[:k]], [p + 1 for _, p in nodes[:k]], candidates, topk)

    def _continuations(self, tokens: np.ndarray, depth: int, limit: int) -> list[list[int]]:
        """The distinct ones among the first `limit` continuations (each up to `depth` tokens) of the
        suffix's earlier occurrences: longest suffix first, latest occurrence first. An occurrence
        of length m is one of every shorter suffix too, with the same continuation: it counts once
        per length towards `limit`, but its repeats would add nothing to a trie."""
        top = min(self.max_match, len(tokens) - 1)
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        lengths = self._lengths(tokens, ends, top)
        picked: list[int] = []
        for n in range(int(lengths.max(initial=0)), self.min_match - 1, -1):
            picked += ends[lengths >= n][::-1][: limit - len(picked)].tolist()
            if len(picked) == limit:
                break
        if not picked:
            return []
        size = len(tokens)
        starts = [p + 1 for p in dict.fromkeys(picked)]  # first-seen order
        window = np.minimum(np.add.outer(starts, self._back_depth(depth)), size - 1)
        rows = tokens[window].tolist()
        return [row[: size - s] if s + depth > size else row for row, s in zip(rows, starts, strict=True)]

    def _lengths(self, tokens: np.ndarray, ends: np.ndarray, top: int) -> np.ndarray:
        """Per end p of an earlier occurrence of the last token (ascending, p < len - 1), how many of
        the sequence's last tokens the tokens up to p match, at most `top`: the suffix of length n
        occurs earlier ending at p iff that is at least n."""
        if top == 1 or not ends.size:
            return np.ones(len(ends), dtype=np.int64)
        back = self._back[:top]
        at = ends[:, None] - back  # [C, top] positions compared, the end first
        if ends[0] >= top - 1:
            same = tokens[at] == tokens[self._suffix[:top]]
        else:  # a window cannot start before the sequence
            same = tokens[np.maximum(at, 0)] == tokens[self._suffix[:top]]
            same &= at >= 0
        return np.logical_and.accumulate(same, axis=1).sum(axis=1)

    def _back_depth(self, depth: int) -> np.ndarray:
        if len(self._ahead) < depth:
            self._ahead = np.arange(depth, dtype=np.int64)
        return self._ahead[:depth]


def _known_tokens(req) -> np.ndarray | None:
    """The request's tokens as an int64 array, None while a placeholder for a token an in-flight step
    is still sampling ends them (overlap scheduling): the suffix to match is not known yet."""
    if req.num_pending:
        return None
    return req.token_mirror.first(req.token_ids, len(req.token_ids))
