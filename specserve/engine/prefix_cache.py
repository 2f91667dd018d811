"""Prefix cache: full pages keyed by a digest of every token up to and including the page.

The digest chains (digest of page i covers page i-1's digest), so a lookup walks a prompt from its
start and stops at the first page nobody has computed. A page whose parent was evicted stays
correct, merely unreachable until that parent is computed again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from specserve.engine.page_pool import PagePool

ROOT = b""


def page_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    # array("q"): the tokens' int64 bytes without numpy's per-call overhead (one call per page, and
    # with page size 1 one per generated token).
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class PrefixCache:
    def __init__(self, pool: PagePool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size
        self._page_of: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        pool.attach_cache(is_cached=self._digest_of.__contains__, on_evict=self._forget)
        self.queries = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._page_of)

    def match(self, tokens: Sequence[int], max_tokens: int) -> tuple[list[int], list[bytes]]:
        """Cached pages covering the longest page-aligned prefix of `tokens[:max_tokens]`, retained."""
        pages: list[int] = []
        digests: list[bytes] = []
        parent = ROOT
        for start in range(0, max_tokens - self.page_size + 1, self.page_size):
            digest = page_digest(parent, tokens[start : start + self.page_size])
            page = self._page_of.get(digest)
            if page is None:
                break
            pages.append(page)
            digests.append(digest)
            parent = digest
        self.pool.retain(pages)
        self.queries += 1
        self.hit_tokens += len(pages) * self.page_size
        return pages, digests

    def insert(self, digest: bytes, page: int) -> None:
        """Offer a full, computed page; a digest already cached keeps its first page."""
        if digest not in self._page_of and page not in self._digest_of:
            self._page_of[digest] = page
            self._digest_of[page] = digest

    def flush(self) -> None:
        """Evict every cached page no request holds; entries of pages in use are dropped too."""
        self.pool.evict_all()
        for page in [p for p in self._digest_of if self.pool.refcount[p] > 0]:
            self._forget(page)

    def _forget(self, page: int) -> None:
        digest = self._digest_of.pop(page)
        del self._page_of[digest]
