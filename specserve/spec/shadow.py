"""Shadow drafts: what an n-gram lookup would have had accepted, scored while speculation is off.

While the adaptive policy decodes plainly it learns nothing about acceptance but from probes, every
`probe_every` steps. On text that starts to loop (a greedy answer repeating itself) a chain would
pay from the loop's first turn, and the policy, holding an estimate from before, stayed off (issue
9's MT-Bench batch-1 run: off for 224 of 230 steps, the first draft's estimate 0.30, while a static
4-chain made 2.66 tokens a verify). An n-gram lookup is host work, a few microseconds, so here a
request's lookup runs anyway, its draft anchored where the request's known tokens end; as the
request's tokens become known (plain steps, overlapped or not) the draft's leading tokens are
checked against them, and once one misses, or the whole draft is matched, the outcome goes to the
acceptance estimates exactly as a verify of that draft would have: `accepted` leading tokens kept
of `depth` drafted (a lookup with no match: position 1 rejected). Under sampling the chance that a
sampled token equals the draft is what the verify's acceptance of a point-mass draft is, so the
estimates stay unbiased there too.

Each step at most `lookups` new shadows start (round-robin over the decoding requests), so the host
cost stays bounded at large batch; a request keeps one shadow at a time. When the policy speculates
the real verifies take over and the shadows are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specserve.engine.request import Request

# A lookup over a request's known tokens: (the known tokens as int64, the request's token list, which
# it reads no further than those, most tokens) -> draft
Lookup = Callable[[np.ndarray, list[int], int], list[int]]
# What a finished shadow tells the acceptance estimates: (request id, drafted, accepted, batch)
Observe = Callable[[str, int, int, int], None]


@dataclass
class _Shadow:
    req: Request
    anchor: int  # the position the draft's first token stands for
    draft: list[int]
    matched: int = 0


class ShadowDrafts:
    def __init__(self, lookup: Lookup, depth: int, lookups: int, observe: Observe) -> None:
        self.lookup, self.depth, self.lookups, self.observe = lookup, depth, lookups, observe
        self._open: dict[str, _Shadow] = {}
        self._turn = 0  # where this step's round of new lookups starts among the requests
        self.scored = 0  # shadows finished, for tests and diagnostics

    def score(self, reqs: Sequence[Request]) -> None:
        """Before a step over `reqs` is decided: the shadows their known tokens now settle go to the
        acceptance estimates."""
        if not self._open:
            return
        batch = len(reqs)
        # The open shadows only (a few), not the batch: each belongs to a running request (`forget`
        # drops a finished one's), and its known tokens decide it wherever it is scheduled.
        for request_id, shadow in list(self._open.items()):
            if self._settled(shadow.req, shadow):
                del self._open[request_id]
                self.observe(request_id, self.depth, shadow.matched, batch)
                self.scored += 1

    def start(self, reqs: Sequence[Request]) -> None:
        """A plain step runs over `reqs`: new shadows for up to `lookups` of those without one."""
        idle = [r for r in reqs if r.request_id not in self._open]
        if not idle or self.lookups <= 0:
            return
        first = self._turn % len(idle)
        self._turn += 1
        for req in (idle[first:] + idle[:first])[: self.lookups]:
            self._start(req)

    def drop(self) -> None:
        """Speculation is on: real verifies score the drafts."""
        self._open.clear()

    def forget(self, request_id: str) -> None:
        self._open.pop(request_id, None)

    def _start(self, req: Request) -> None:
        known = len(req.token_ids) - req.num_pending
        if known < 2:
            return
        tokens = req.token_mirror.first(req.token_ids, known)
        draft = self.lookup(tokens, req.token_ids, self.depth)  # reads the list below `known` only
        self._open[req.request_id] = _Shadow(req, known, draft)

    @staticmethod
    def _settled(req: Request, shadow: _Shadow) -> bool:
        """Checks the draft against the tokens known since its anchor; True once it is decided (a
        miss, the whole draft matched, or no draft at all)."""
        known = len(req.token_ids) - req.num_pending
        tokens, draft = req.token_ids, shadow.draft
        while shadow.matched < len(draft):
            at = shadow.anchor + shadow.matched
            if at >= known:
                return False
            if tokens[at] != draft[shadow.matched]:
                return True
            shadow.matched += 1
        return True
