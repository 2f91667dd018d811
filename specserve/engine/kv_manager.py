"""Request-level KV bookkeeping: which pages a request holds, prefix reuse, and the accounting check.

For a hybrid model it also hands out the request's recurrent-state slot (`StatePool`): taken with the
request's first pages and given back with them, so finish, abort and retract free both.
"""

from __future__ import annotations

from specserve.engine.page_pool import OutOfPages, PagePool
from specserve.engine.prefix_cache import ROOT, PrefixCache, page_digest
from specserve.engine.request import Request
from specserve.engine.state_pool import OutOfSlots, StatePool


class KVManager:
    def __init__(
        self, num_pages: int, page_size: int, enable_prefix_cache: bool, states: StatePool | None = None
    ) -> None:
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        self.prefix_cache = PrefixCache(self.pool, page_size) if enable_prefix_cache else None
        if states is not None and self.prefix_cache is not None:
            raise ValueError(
                "enable_prefix_cache: hybrid models keep no state snapshots to resume a prefix from"
            )
        self.states = states
        # Commits put off until the host has time (`commit_later`): request -> its `upto`.
        self._later: dict[Request, int] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.pool.capacity * self.page_size

    def usage(self) -> float:
        """Share of pages held by running requests (cached-but-idle pages count as free)."""
        return 1.0 - self.pool.num_available / self.pool.capacity

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def match_prefix(self, req: Request) -> int:
        """Give a request with no KV the cached pages of its longest cached prefix; the tokens they cover."""
        assert not req.pages and req.num_computed == 0
        if self.prefix_cache is None:
            return 0
        pages, digests = self.prefix_cache.match(req.token_ids, req.max_prefix_match())
        req.pages, req.page_digests = pages, digests
        # Cached pages hold valid drafter KV too (only such pages are offered to the cache).
        req.num_computed = req.draft_computed = len(pages) * self.page_size
        return req.num_computed

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Make sure `req` holds pages for its first `num_tokens` tokens (and, with a state pool, a
        state slot); False when the pool is short."""
        if self.states is not None and req.state_slot is None:
            try:
                req.state_slot = self.states.allocate()
            except OutOfSlots:
                return False
        missing = -(-num_tokens // self.page_size) - len(req.pages)
        if missing <= 0:
            return True
        try:
            req.pages.extend(self.pool.allocate(missing))
        except OutOfPages:
            return False
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back pages past the first `num_tokens` tokens (reserved for drafts that were rejected)."""
        keep = self.pages_for(num_tokens)
        if len(req.pages) > keep:
            self.pool.release(reversed(req.pages[keep:]))
            del req.pages[keep:]
            req.page_mirror.truncate(keep)

    def commit(self, req: Request, upto: int) -> None:
        """Offer the request's newly completed pages among its first `upto` tokens to the prefix cache."""
        if self.prefix_cache is None:
            return
        ps, digests = self.page_size, req.page_digests
        # Accepted drafts past a stop token have KV but are not the request's tokens: never keyed.
        limit = min(upto, req.num_computed, len(req.token_ids))
        i = len(digests)
        if (i + 1) * ps > limit:  # no page completed since (most steps when pages hold many tokens)
            return
        parent = digests[-1] if digests else ROOT
        while (i + 1) * ps <= limit:
            parent = page_digest(parent, req.token_ids[i * ps : (i + 1) * ps])
            self.prefix_cache.insert(parent, req.pages[i])
            digests.append(parent)
            i += 1

    def commit_later(self, req: Request, upto: int) -> None:
        """`commit` when `flush_commits` runs (the engine runs it while the device works), or before
        the request's pages are freed, whichever comes first. Its pages' KV and tokens are final, so
        the digests are the same whenever they are taken; meanwhile a new request simply finds
        fewer of its pages cached."""
        if self.prefix_cache is None:
            return
        limit = min(upto, req.num_computed, len(req.token_ids))
        if (len(req.page_digests) + 1) * self.page_size <= limit:  # a page completed: else nothing to do
            self._later[req] = upto

    def flush_commits(self) -> None:
        """Run the commits `commit_later` put off."""
        if self._later:
            later, self._later = self._later, {}
            for req, upto in later.items():
                self.commit(req, upto)

    def free(self, req: Request) -> None:
        upto = self._later.pop(req, None)
        if upto is not None:  # its completed pages enter the cache before they are released
            self.commit(req, upto)
        # Last pages first, so the prefix cache evicts leaves before the prefixes they extend.
        self.pool.release(reversed(req.pages))
        req.pages, req.page_digests = [], []
        req.num_computed = req.draft_computed = 0
        req.draft_state = req.draft_backlog = None
        if req.state_slot is not None:
            self.states.release(req.state_slot)
            req.state_slot = None

    def flush(self) -> None:
        self.flush_commits()
        if self.prefix_cache is not None:
            self.prefix_cache.flush()

    def check(self, *, idle: bool) -> None:
        self.pool.check(idle=idle)
        if self.states is not None:
            self.states.check(idle=idle)
