"""N-gram (prompt lookup) drafting: continue the latest earlier occurrence of the sequence's suffix.

No weights: the draft is deterministic, so its probability is 1 on the proposed token and the
rejection test reduces to accepting with the target's probability of that token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specserve.spec.drafter import Drafter


class NgramDrafter(Drafter):
    def __init__(self, min_match: int, max_match: int) -> None:
        self.min_match, self.max_match = min_match, max_match

    def draft(self, reqs: list, budgets: list[int]) -> None:
        for req, budget in zip(reqs, budgets, strict=True):
            req.draft = self.propose(req.token_ids, budget)

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


def _latest_match(tokens: np.ndarray, n: int) -> int | None:
    """Start of the latest window of length n, before the suffix itself, equal to the last n tokens."""
    windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
    hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
    return int(hits[-1]) if hits.size else None
