"""Invariant 1 for draft trees, the matrix: greedy tree-speculative output equals target-only output
token for token, for topk {2, 4, 8} x num_steps {2, 4, 6} x num_draft_tokens {4, 16, 64} x page_size
{1, 16} x batch {1, 5}; after the speculative tokens, 64 more tokens of plain decoding still match
(they read the KV the accepted-path compaction left: stale or misplaced entries would show).

Every combination runs; the drafter rotates over the five methods (each meets every topk and page
size). The standalone drafter is the target itself, so long paths through later tree rows get
accepted and compacted; the heads are random (rarely accepted); the n-gram prompts repeat motifs.
Engines are built once per (method, page size) and switched between shapes with `spec_settings`.
"""

from __future__ import annotations

import itertools

import pytest

from specserve import LLM, SamplingParams
from specserve.engine.stats import SpecSettings
from specserve.model.head_checkpoint import random_head, save_head

from engine_utils import motif_prompts

VOCAB = 96
METHODS = ("ngram", "standalone", "eagle", "eagle3", "mtp")
SPEC_TOKENS = 12  # speculative outputs per request before drafting stops
PLAIN_TOKENS = 64
# Enough that every request, having overshot SPEC_TOKENS by at most a whole path, decodes 64 more.
MAX_NEW = SPEC_TOKENS + 6 + PLAIN_TOKENS
COMBOS = list(itertools.product((2, 4, 8), (2, 4, 6), (4, 16, 64), (1, 16), (1, 5)))
CASES = [(METHODS[i % len(METHODS)], *combo) for i, combo in enumerate(COMBOS)]


@pytest.fixture(scope="module")
def target(small_vocab_target):
    return small_vocab_target


@pytest.fixture(scope="module")
def draft_models(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    folders = {"ngram": None, "standalone": target.location.path}
    shapes = {"eagle": {}, "eagle3": {"draft_vocab_size": 48}, "mtp": {"num_modules": 3}}
    for method, kwargs in shapes.items():
        folders[method] = save_head(root / method, *random_head(method, target.arch, seed=9, **kwargs))
    return folders


@pytest.fixture(scope="module")
def prompts():
    return motif_prompts(5, VOCAB, max_noise=20)


PARAMS = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(target, prompts):
    return [o.token_ids for o in LLM(target, device="cpu", dtype="float32").generate(prompts, PARAMS)]


@pytest.fixture(scope="module")
def engines(target, draft_models):
    """One engine per (method, page size), built on first use."""
    cache: dict[tuple[str, int], LLM] = {}

    def get(method: str, page_size: int) -> LLM:
        if (method, page_size) not in cache:
            spec = {"method": method, "num_steps": 2, "topk": 2}
            if draft_models[method] is not None:
                spec["draft_model"] = str(draft_models[method])
            cache[method, page_size] = LLM(
                target,
                device="cpu",
                dtype="float32",
                page_size=page_size,
                speculative=spec,
                max_total_tokens=4096,
            )
        return cache[method, page_size]

    return get


def run_then_plain(llm: LLM, prompts, settings: SpecSettings) -> list:
    """Decode speculatively with `settings` until every request has SPEC_TOKENS outputs, then with
    drafting off to the end; the KV accounting check holds after every step."""
    engine = llm.engine
    engine.spec_settings = settings
    ids = [engine.add_request(p, PARAMS) for p in prompts]
    done: dict[str, object] = {}
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            engine.check_kv_accounting()
            live = [r for r in engine.scheduler.running if r.num_output > 0]
            if engine.spec_settings.num_steps and all(r.num_output >= SPEC_TOKENS for r in live):
                engine.spec_settings = SpecSettings()
    finally:
        engine.spec_settings = SpecSettings()
    return [done[i] for i in ids]


@pytest.mark.parametrize(("method", "topk", "num_steps", "num_nodes", "page_size", "batch"), CASES)
def test_greedy_tree_is_lossless(
    engines, prompts, reference, method, topk, num_steps, num_nodes, page_size, batch
):
    llm = engines(method, page_size)
    outs = run_then_plain(llm, prompts[:batch], SpecSettings(num_steps, topk, num_nodes))
    assert [o.token_ids for o in outs] == reference[:batch]
    for o in outs:
        assert o.meta["spec_verify_ct"] > 0
        assert sum(o.meta["spec_accept_histogram"]) == o.meta["spec_verify_ct"]
        assert max(len(o.meta["spec_accept_histogram"]) - 1, 0) <= num_steps  # a path is no deeper
    if method == "standalone":  # the self-draft's argmax is always a kept node: every verify accepts
        assert all(o.meta["spec_accept_histogram"][0] == 0 for o in outs)


def test_every_method_meets_every_topk_and_page_size():
    seen = {(m, topk, ps) for m, topk, _, _, ps, _ in CASES}
    assert seen == set(itertools.product(METHODS, (2, 4, 8), (1, 16)))
