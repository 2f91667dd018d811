"""Page pool, prefix cache and scheduler bookkeeping, without a model."""

from __future__ import annotations

import pytest

from specserve.config import SchedulerConfig
from specserve.engine.kv_manager import KVManager
from specserve.engine.page_pool import OutOfPages, PagePool
from specserve.engine.request import Request, Status
from specserve.engine.scheduler import Scheduler
from specserve.types import SamplingParams


def _req(rid: str, prompt: list[int], **params) -> Request:
    return Request(rid, prompt, SamplingParams(**params), seed=0)


def test_pool_refcounts_and_check():
    pool = PagePool(5)
    pages = pool.allocate(3)
    assert 0 not in pages and pool.num_free == 1
    pool.retain(pages[:1])
    pool.release(pages)
    assert pool.refcount[pages[0]] == 1
    with pytest.raises(AssertionError):
        pool.check(idle=True)
    pool.release(pages[:1])
    pool.check(idle=True)
    with pytest.raises(OutOfPages):
        pool.allocate(5)


def test_prefix_cache_match_evict_and_flush():
    kv = KVManager(num_pages=9, page_size=2, enable_prefix_cache=True)
    a = _req("a", [1, 2, 3, 4, 5, 6, 7])
    assert kv.reserve(a, 7)
    a.num_computed = 7
    kv.commit(a, a.num_computed)
    assert len(a.page_digests) == 3  # the partial last page is not offered
    kv.free(a)
    assert kv.pool.num_evictable == 3
    b = _req("b", [1, 2, 3, 4, 9, 9, 9])
    kv.match_prefix(b)
    assert b.num_computed == 4 and kv.pool.refcount[b.pages].tolist() == [1, 1]
    kv.free(b)
    # Allocating past the free list evicts the least recently released pages, leaves first.
    c = _req("c", list(range(100, 116)))
    assert kv.reserve(c, 16)
    assert kv.pool.num_evictable == 0
    kv.free(c)
    kv.flush()
    kv.check(idle=True)
    assert kv.pool.num_free == kv.pool.capacity


def test_prefix_match_leaves_a_token_to_compute_and_respects_logprob_start():
    kv = KVManager(num_pages=20, page_size=1, enable_prefix_cache=True)
    a = _req("a", [5, 6, 7, 8])
    kv.reserve(a, 4)
    a.num_computed = 4
    kv.commit(a, a.num_computed)
    kv.free(a)
    same = _req("same", [5, 6, 7, 8])
    kv.match_prefix(same)
    assert same.num_computed == 3  # the last token is recomputed for its logits
    kv.free(same)
    scored = _req("scored", [5, 6, 7, 8], return_logprob=True, logprob_start_len=2)
    kv.match_prefix(scored)
    assert scored.num_computed == 1  # logits of token 1 are needed to score token 2
    kv.free(scored)
    kv.flush()
    kv.check(idle=True)


def test_scheduler_chunks_prefill_under_budget_and_caps_running():
    kv = KVManager(num_pages=200, page_size=1, enable_prefix_cache=False)
    sched = Scheduler(SchedulerConfig(max_running_requests=2, max_batched_tokens=10), kv)
    reqs = [_req(str(i), list(range(1, 16))) for i in range(3)]
    for r in reqs:
        sched.add(r)
    items = sched.schedule()
    assert [(i.request.request_id, i.num_tokens) for i in items] == [("0", 10)]
    items[0].request.num_computed += 10
    items = sched.schedule()
    assert [(i.request.request_id, i.num_tokens) for i in items] == [("0", 5), ("1", 5)]
    assert len(sched.running) == 2 and reqs[2].status is Status.WAITING
    for r in list(sched.running):
        sched.remove(r)
    sched.remove(reqs[2])
    kv.check(idle=True)


def test_scheduler_retracts_newest_when_pool_is_short():
    kv = KVManager(num_pages=9, page_size=1, enable_prefix_cache=False)  # 8 usable slots
    sched = Scheduler(SchedulerConfig(max_running_requests=4, max_batched_tokens=64), kv)
    old, new = _req("old", [1, 2, 3]), _req("new", [4, 5, 6])
    sched.add(old)
    sched.add(new)
    for item in sched.schedule():
        item.request.num_computed = item.end
        item.request.token_ids.append(9)  # as if a token were sampled
    for item in sched.schedule():  # 4 + 4 tokens needed, 8 slots: fits
        item.request.num_computed = item.end
        item.request.token_ids.append(9)
    items = sched.schedule()  # 5 + 5 > 8: the newest goes back to the queue
    assert [i.request.request_id for i in items] == ["old"]
    assert new.status is Status.WAITING and new.num_computed == 0 and not new.pages
    assert sched.waiting[0] is new and sched.num_retracted == 1
    sched.remove(old)
    sched.remove(new)
    kv.check(idle=True)


def test_a_commit_put_off_runs_at_the_flush_or_before_the_pages_are_freed():
    """`commit_later` keys the same pages `commit` would, when the engine gets to it (while the
    device works), and never loses them: freeing the request or flushing the cache runs it first."""
    kv = KVManager(num_pages=30, page_size=2, enable_prefix_cache=True)
    a = _req("a", [1, 2, 3, 4, 5, 6, 7])
    kv.reserve(a, 7)
    a.num_computed = 7
    kv.commit_later(a, a.num_computed)
    assert a.page_digests == [] and len(kv.prefix_cache) == 0  # not yet
    kv.flush_commits()
    assert len(a.page_digests) == 3 and len(kv.prefix_cache) == 3
    a.token_ids += [8, 9]
    kv.reserve(a, 9)
    a.num_computed = 9
    kv.commit_later(a, 9)
    kv.free(a)  # the put-off commit runs before the pages go back
    assert len(kv.prefix_cache) == 4 and kv.pool.num_evictable == 4
    b = _req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert kv.match_prefix(b) == 8
    kv.free(b)
    # Nothing to key (the last page is partial): nothing is put off.
    c = _req("c", [1, 2, 3])
    kv.reserve(c, 3)
    c.num_computed = 3
    kv.commit(c, 3)
    kv.commit_later(c, 3)
    assert not kv._later
    c.token_ids.append(4)
    c.num_computed = 4
    kv.reserve(c, 4)
    kv.commit_later(c, 4)
    kv.flush()  # a cache flush runs put-off commits first (then drops in-use pages' entries)
    assert len(c.page_digests) == 2 and not kv._later
    kv.free(c)
    kv.flush()
    kv.check(idle=True)
