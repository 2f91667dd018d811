"""Invariant 1, the matrix: greedy speculative output equals target-only output token for token,
for every method x num_steps {1, 3, 5} x page_size {1, 16} x batch {1, 7}.

The target is a small-vocabulary random model, so even random heads get drafts accepted now and
then; the n-gram prompts repeat themselves so lookups hit; the standalone drafter is another random
model over the same vocabulary.
"""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.model.head_checkpoint import random_head, save_head
from specserve.model.tokenizer import load_tokenizer

from engine_utils import motif_prompts
from tiny_models import save_tiny_qwen2

VOCAB = 96
METHODS = ("ngram", "standalone", "eagle", "eagle3", "mtp")
PARAMS = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def target(small_vocab_target):
    return small_vocab_target


@pytest.fixture(scope="module")
def draft_models(target, smollm2_gguf, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    folders = {"ngram": None}
    folders["standalone"] = save_tiny_qwen2(root / "standalone", load_tokenizer(smollm2_gguf), VOCAB)
    shapes = {"eagle": {}, "eagle3": {"draft_vocab_size": 48}, "mtp": {"num_modules": 2}}
    for method, kwargs in shapes.items():
        folders[method] = save_head(root / method, *random_head(method, target.arch, seed=9, **kwargs))
    return folders


@pytest.fixture(scope="module")
def prompts():
    return motif_prompts(7, VOCAB)


@pytest.fixture(scope="module")
def reference(target, prompts):
    outs = LLM(target, device="cpu", dtype="float32").generate(prompts, PARAMS)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("batch", [1, 7])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("num_steps", [1, 3, 5])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_is_lossless(target, draft_models, prompts, reference, method, num_steps, page_size, batch):
    spec = {"method": method, "num_steps": num_steps}
    if draft_models[method] is not None:
        spec["draft_model"] = str(draft_models[method])
    llm = LLM(target, device="cpu", dtype="float32", page_size=page_size, speculative=spec)
    outs = llm.generate(prompts[:batch], PARAMS)
    assert [o.token_ids for o in outs] == reference[:batch]
    for o in outs:
        assert o.meta["spec_verify_ct"] > 0
        assert sum(o.meta["spec_accept_histogram"]) == o.meta["spec_verify_ct"]
        assert o.meta["spec_accepted_tokens"] <= o.meta["spec_draft_tokens"]
    if method == "ngram" and batch == 7:
        assert sum(o.meta["spec_accepted_tokens"] for o in outs) > 0


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_the_triton_path_inside_the_engine(target, draft_models, prompts, method, monkeypatch):
    """The engine with its Triton kernels (verify_chain, draft_top1) under the interpreter gives the
    same tokens as with their torch references, greedy and sampled."""
    spec = {"method": method, "num_steps": 3}
    if draft_models[method] is not None:
        spec["draft_model"] = str(draft_models[method])
    sampled = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)
    batch = prompts[:3]
    llm = LLM(target, device="cpu", dtype="float32", speculative=spec)
    expected = [o.token_ids for o in llm.generate(batch, PARAMS) + llm.generate(batch, sampled)]
    monkeypatch.setenv("SPECSERVE_TRITON_CPU", "1")
    llm = LLM(target, device="cpu", dtype="float32", speculative=spec)
    got = [o.token_ids for o in llm.generate(batch, PARAMS) + llm.generate(batch, sampled)]
    assert got == expected


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_pages_holding_accepted_drafts_enter_the_prefix_cache(target, draft_models, prompts, method):
    """A follow-up turn (prompt + answer + more) reuses the answer's pages, including those whose KV
    was written by accepted drafts."""
    spec = {"method": method, "num_steps": 4}
    if draft_models[method] is not None:
        spec["draft_model"] = str(draft_models[method])
    llm = LLM(target, device="cpu", dtype="float32", page_size=4, speculative=spec)
    prompt = prompts[6]
    first = llm.generate([prompt], PARAMS)[0]
    assert first.meta["spec_accepted_tokens"] > 0 or method != "ngram"
    history = prompt + first.token_ids
    follow = llm.generate([history + [5, 6, 7]], PARAMS)[0]
    # Every full page of the history but (at most) the one holding its last token was cached.
    assert follow.meta["cached_tokens"] >= (len(history) - 1) // 4 * 4 - 4
