"""Continuous batching: which requests run this step, and how many of their tokens.

Running requests go first, oldest first (a decode is one token, an unfinished prefill a chunk);
waiting requests are admitted while the token budget, the running cap and the KV pool allow.
When the pool runs dry the newest running request is retracted: its pages are freed and it
waits at the front of the queue to recompute everything it had, output included.
"""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

from specserve.config import SchedulerConfig
from specserve.engine.kv_manager import KVManager
from specserve.engine.request import Request, Status
from specserve.engine.stats import StepStats


class ScheduledItem(NamedTuple):
    """Compute `request.token_ids[start : start + num_known]` and then `draft` this step.

    `start` is the request's num_computed when scheduled; `num_tokens` counts known and draft tokens.
    A tuple: one is made per request and step.
    """

    request: Request
    start: int
    num_tokens: int
    completes: bool  # this step computes the last known token, so its logits yield the next one
    draft: tuple[int, ...] = ()

    @classmethod
    def of(cls, request: Request, num_tokens: int) -> ScheduledItem:
        start, length = request.num_computed, len(request.token_ids)
        known = min(num_tokens, length - start)
        draft = tuple(request.draft[: num_tokens - known]) if request.draft else ()
        return cls(request, start, num_tokens, start + known == length, draft)

    @property
    def num_known(self) -> int:
        return self.num_tokens - len(self.draft)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_retracted = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take a finished or aborted request out of the queues and free its pages."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)

    def schedule(self, stats: StepStats | None = None) -> list[ScheduledItem]:
        """This step's items; retractions, prefix-cache lookups and queue times go to `stats`."""
        stats = stats if stats is not None else StepStats()
        budget = self.config.max_batched_tokens
        items: list[ScheduledItem] = []
        retracted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.settling:  # its last step is in flight (overlap scheduling)
                i += 1
                continue
            n = self._chunk(req.num_uncomputed + len(req.draft), budget, first=not items)
            if n == 0:
                break
            ok, retracted_now = self._reserve_or_retract(req, req.num_computed + n, stats)
            retracted |= retracted_now
            if not ok:
                break
            items.append(ScheduledItem.of(req, n))
            budget -= n
            i += 1
        if not retracted:
            self._admit(items, budget, stats)
        return items

    def _admit(self, items: list[ScheduledItem], budget: int, stats: StepStats) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            hits = self.kv.match_prefix(req)
            if not req.admitted_once:
                req.cached_tokens = req.num_computed
            n = self._chunk(req.num_uncomputed, budget, first=not items)
            if n == 0 or not self.kv.reserve(req, req.num_computed + n):
                self.kv.free(req)
                break
            self.waiting.popleft()
            _count_admission(req, hits, stats)
            req.status, req.admitted_once = Status.RUNNING, True
            self.running.append(req)
            items.append(ScheduledItem.of(req, n))
            budget -= n

    def _chunk(self, remaining: int, budget: int, *, first: bool) -> int:
        if self.config.chunked_prefill:
            return min(remaining, budget)
        # Without chunking a prompt runs whole; one larger than the budget still runs, alone.
        return remaining if remaining <= budget or first else 0

    def _reserve_or_retract(self, req: Request, num_tokens: int, stats: StepStats) -> tuple[bool, bool]:
        retracted = False
        while not self.kv.reserve(req, num_tokens):
            victim = self.running.pop()
            self._retract(victim)
            stats.retracted += 1
            retracted = True
            if victim is req:
                return False, retracted
        return True, retracted

    def _retract(self, req: Request) -> None:
        self.kv.free(req)
        req.draft = []
        req.status = Status.WAITING
        req.num_retractions += 1
        self.num_retracted += 1
        self.waiting.appendleft(req)


def _count_admission(req: Request, hits: int, stats: StepStats) -> None:
    """Counted only once the admission holds (a lookup whose pages go back, because the pool was
    short, is repeated on a later step), and again after a retraction: that lookup is real too."""
    stats.prefix_queries += len(req.token_ids)
    stats.prefix_hits += hits
    if not req.admitted_once:
        stats.queue_times.append(time.monotonic() - req.arrival_time)
