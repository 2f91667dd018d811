"""Page allocation with reference counts.

A page is in exactly one of three states: free; in use (refcount > 0, held by running requests);
or cached (refcount 0, kept by the prefix cache until evicted). `check()` asserts that partition.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

import numpy as np

from specserve.engine.kv_cache import DUMMY_PAGE


class OutOfPages(Exception):
    """Not enough free or evictable pages; the scheduler answers by retracting a request."""


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError("num_pages: need at least 2 (page 0 is reserved)")
        self.refcount = np.zeros(num_pages, dtype=np.int32)
        self._free: deque[int] = deque(p for p in range(num_pages) if p != DUMMY_PAGE)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._is_cached: Callable[[int], bool] = lambda page: False
        self._on_evict: Callable[[int], None] = lambda page: None

    def attach_cache(self, is_cached: Callable[[int], bool], on_evict: Callable[[int], None]) -> None:
        self._is_cached, self._on_evict = is_cached, on_evict

    @property
    def capacity(self) -> int:
        return len(self.refcount) - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        return len(self._free) + len(self._evictable)

    def allocate(self, n: int) -> list[int]:
        free = self._free
        if n == 1 and free:  # a decode step's page (page size 1: every token's)
            page = free.popleft()
            self.refcount[page] = 1
            return [page]
        if n > self.num_available:
            raise OutOfPages(f"need {n} pages, {self.num_available} available")
        while len(free) < n:
            self.evict_oldest()
        pages = [free.popleft() for _ in range(n)]
        for page in pages:  # one or a few pages per call: item assignment beats fancy indexing
            self.refcount[page] = 1
        return pages

    def retain(self, pages: Iterable[int]) -> None:
        for page in pages:
            if self.refcount[page] == 0:
                self._evictable.pop(page)  # a cached page comes back into use
            self.refcount[page] += 1

    def release(self, pages: Iterable[int]) -> None:
        for page in pages:
            assert self.refcount[page] > 0, f"page {page} released more often than retained"
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                if self._is_cached(page):
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def evict_oldest(self) -> None:
        page, _ = self._evictable.popitem(last=False)
        self._on_evict(page)
        self._free.append(page)

    def evict_all(self) -> None:
        while self._evictable:
            self.evict_oldest()

    def check(self, *, idle: bool) -> None:
        """Assert the partition; with `idle`, no page may be in use."""
        in_use = int((self.refcount > 0).sum())
        assert (self.refcount >= 0).all(), "negative refcount"
        assert self.refcount[DUMMY_PAGE] == 0, "the dummy page was handed out"
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not free & evictable, "a page is both free and cached"
        assert all(self.refcount[p] == 0 for p in free | evictable), "a free or cached page has a refcount"
        assert len(free) + len(evictable) + in_use == self.capacity, "pages leaked"
        if idle:
            assert in_use == 0, f"{in_use} pages still referenced with no request running"
