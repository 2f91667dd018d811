"""A head drafter's CUDA graphs (specserve/spec/draft_graphs.py): graphed drafting equals eager drafting.

Every `draft` and `after_target` call of a generation runs twice from the same state: eagerly (the
drafter's graphs switched off) and through the graphs' static buffers (on the CPU they run without
capture, the same padded path). Draft tokens, each request's tails and seed, and the head's
KV outside the dummy page must be equal. Batches of 1..5 requests with a graph max batch of 4 pad
to buckets (and 5 runs eagerly), and lengths that end near each other give rows different budgets.
"""

from __future__ import annotations

import random

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.kv_cache import DUMMY_PAGE
from specserve.model.head_checkpoint import random_head, save_head
from specserve.spec.adaptive import OFF, Decision
from specserve.spec.draft_graphs import DRAFT_GRAPHS_ENV, DraftGraphs
from specserve.spec.drafter import resolve_drafts

from engine_utils import assert_same_outputs, motif_prompts

VOCAB = 96
HEADS = {"eagle3": {"draft_vocab_size": 64}, "mtp": {"num_modules": 3}, "eagle": {"layers_per_module": 2}}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def heads(small_vocab_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_graph_heads")
    folders = {}
    for method, kwargs in HEADS.items():
        config, tensors = random_head(method, small_vocab_target.arch, seed=7, **kwargs)
        folders[method] = save_head(root / method, config, tensors)
    return folders


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 30))] for _ in range(count)]


def _params(count: int, temperature: float = 0.0) -> list[SamplingParams]:
    """Lengths ending a few tokens apart: the last rounds draft with different budgets per row."""
    return [
        SamplingParams(
            max_new_tokens=10 + 3 * i,
            temperature=temperature if i % 2 else 0.0,
            top_k=30,
            seed=i,
            ignore_eos=True,
            return_logprob=True,
        )
        for i in range(count)
    ]


def _llm(target, method, folder, graphs: bool = True, num_steps: int | None = 5, device: str = "cpu", **kw):
    # Steps from the host (no device loop, which takes logprob requests too): the drafter's calls
    # are what this file compares.
    spec = {"method": method, "draft_model": str(folder), "num_steps": num_steps, "device_steps": 0}
    spec.update(kw.pop("speculative_extra", {}))
    return LLM(
        target,
        device=device,
        dtype="float32",
        page_size=kw.pop("page_size", 4),
        max_total_tokens=kw.pop("max_total_tokens", 1024),
        attention_backend="triton",
        cuda_graphs=graphs,
        cuda_graph_max_batch=4,
        speculative=spec,
        **kw,
    )


class Shadow:
    """Runs each drafter call eagerly first, then graphed from the same state, and compares: tokens
    exactly (`exact`; on the GPU a near-tie may flip, counted in `matched`), tensors closely (a
    graph runs every row of its bucket, and a matmul over more rows may round differently)."""

    def __init__(self, drafter, exact: bool = True) -> None:
        self.drafter, self.graphs, self.exact = drafter, drafter.graphs, exact
        self.counts = {"draft": 0, "after_target": 0}
        self.tokens = self.matched = 0
        self.device_seeds = 0  # chain replays whose first tokens came straight from the extend
        self.sampled = 0  # graphed chains with sampling requests' rows (a head drafts them greedily too)
        self.chain_batches: list[tuple[int, tuple[int, ...]]] = []  # (requests, budgets) graphed
        for name in self.counts:
            setattr(drafter, name, self._wrap(name, getattr(drafter, name)))
        original = self.graphs.launch_chain

        def launch_chain(reqs, tokens, hidden, positions, steps):
            self.sampled += any(not r.params.greedy for r in reqs)
            self.chain_batches.append((len(reqs), tuple(steps)))
            self.device_seeds += isinstance(tokens, torch.Tensor)
            return original(reqs, tokens, hidden, positions, steps)

        self.graphs.launch_chain = launch_chain
        self.extends: list[tuple[int, int]] = []  # (feeds, the longest) of each graphed extend
        extend = self.graphs.run_extend

        def run_extend(feeds, features, rows, previous):
            self.extends.append((len(feeds), max(len(t) for _, _, t in feeds)))
            return extend(feeds, features, rows, previous)

        self.graphs.run_extend = run_extend

    def _wrap(self, name, method):
        def call(reqs_or_feeds, *args):
            reqs = [getattr(x, "request", x) for x in reqs_or_feeds]
            saved = [_request_state(r) for r in reqs]
            kv = self.drafter.kv_cache
            k, v = kv.k.clone(), kv.v.clone()
            # Nested calls (a draft's catch-up extend) leave the outer call's choice as they found it.
            outer, self.drafter.graphs = self.drafter.graphs, None
            method(reqs_or_feeds, *args)
            eager = [_request_state(r) for r in reqs]
            eager_kv = kv.k.clone(), kv.v.clone()
            kv.k.copy_(k)
            kv.v.copy_(v)
            for r, state in zip(reqs, saved, strict=True):
                _restore(r, state)
            self.drafter.graphs = self.graphs
            method(reqs_or_feeds, *args)
            self.drafter.graphs = outer
            self.counts[name] += 1
            # Graphed drafts stay on the device until verify: compare what their placeholders name.
            pending = self.graphs.pending
            pending = pending.tolist() if pending is not None else None
            self._compare(eager, [_request_state(r, pending) for r in reqs], eager_kv)

        return call

    def _compare(self, eager, graphed, eager_kv) -> None:
        atol = 1e-5 if self.exact else 2e-3

        def close(a: torch.Tensor, b: torch.Tensor) -> bool:
            return torch.allclose(a.float(), b.float(), atol=atol, rtol=atol, equal_nan=True)

        same = True
        for e, g in zip(eager, graphed, strict=True):
            self.tokens += len(e["draft"])
            self.matched += sum(a == b for a, b in zip(e["draft"], g["draft"], strict=False))
            es, gs = e["draft_state"], g["draft_state"]
            same &= g["draft"] == e["draft"] and _first_draft(es) == _first_draft(gs)
        if self.exact:
            assert same, "graphed drafts differ from eager ones"
        elif not same:
            return  # a flipped near-tie on the GPU: later states differ, as they may
        for e, g in zip(eager, graphed, strict=True):
            assert g["draft_computed"] == e["draft_computed"]
            assert (e["draft_probs"] is None) == (g["draft_probs"] is None)
            if e["draft_probs"] is not None:
                assert close(g["draft_probs"], e["draft_probs"])
            es, gs = e["draft_state"], g["draft_state"]
            assert (es is None) == (gs is None)
            if es is None:
                continue
            assert gs.position == es.position and close(gs.tails, es.tails)
            assert (gs.logits is None) == (es.logits is None)
            assert es.logits is None or close(gs.logits, es.logits)
        kv, page = self.drafter.kv_cache, self.drafter.kv_cache.page_size
        real = torch.ones(kv.k.shape[1], dtype=torch.bool, device=kv.k.device)
        real[DUMMY_PAGE * page : (DUMMY_PAGE + 1) * page] = False  # pad rows write there
        for graphed, eager in zip((kv.k, kv.v), eager_kv, strict=True):
            assert close(graphed[:, real], eager[:, real])


def _first_draft(state) -> int | None:
    return state.first_draft() if state is not None and state.seeded else None


def _request_state(req, pending: list[int] | None = None) -> dict:
    probs = req.draft_probs
    return {
        "draft": resolve_drafts([req.draft], pending)[0] if pending is not None else list(req.draft),
        "draft_probs": probs.clone() if isinstance(probs, torch.Tensor) else probs,
        "draft_state": req.draft_state,
        "draft_backlog": req.draft_backlog,
        "draft_computed": req.draft_computed,
    }


def _restore(req, state: dict) -> None:
    req.draft = list(state["draft"])
    req.draft_probs = state["draft_probs"]
    req.draft_state = state["draft_state"]
    req.draft_backlog = state["draft_backlog"]
    req.draft_computed = state["draft_computed"]


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graphed_drafts_equal_eager(small_vocab_target, heads, method, temperature):
    """Graphed draft chains and extends equal eager ones, call by call, in padded buckets: chains
    through the chain graphs (with mixed budgets), sampling requests' among them (a head's drafts
    are its argmax for every request)."""
    llm = _llm(small_vocab_target, method, heads[method])
    shadow = Shadow(llm.engine.drafter)
    outs = llm.generate(_prompts(3), _params(3, temperature))
    assert shadow.counts["draft"] > 5 and shadow.counts["after_target"] > 5
    assert {n for n, _ in shadow.extends} & {1, 3}, "no extend padded to a bucket"
    if temperature > 0:
        assert shadow.sampled > 0, "no sampling request's chain graphed"
    if method == "eagle3":  # the random MTP chain's drafts are never accepted on these prompts
        assert sum(o.meta["spec_accepted_tokens"] for o in outs) > 0
        assert max(longest for _, longest in shadow.extends) > 1, "no graphed extend over accepted drafts"
    assert {n for n, _ in shadow.chain_batches} & {1, 3}, "no chain padded to a bucket"
    if temperature == 0:
        assert any(len(set(steps)) > 1 for _, steps in shadow.chain_batches), "no mixed budgets"
        assert shadow.device_seeds > 0  # one host sync a round: the extend's seeds stay on the device


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("method", list(HEADS))  # EAGLE (two layers) here only
def test_draft_graphs_stay_lossless(small_vocab_target, heads, method, temperature, monkeypatch):
    """Engine outputs with draft graphs equal eager drafting's (same accepts) and, greedy, plain
    decoding's; sampling rows beside greedy ones verify graphed drafts resolved with the results."""
    prompts, params = _prompts(4, seed=1), _params(4, temperature)
    outs = _llm(small_vocab_target, method, heads[method]).generate(prompts, params)
    if temperature == 0:
        plain = LLM(small_vocab_target, device="cpu", dtype="float32", page_size=4, max_total_tokens=1024)
        reference = plain.generate(prompts, params)
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    monkeypatch.setenv(DRAFT_GRAPHS_ENV, "0")
    eager_llm = _llm(small_vocab_target, method, heads[method])
    assert eager_llm.engine.drafter.graphs is None
    eager = eager_llm.generate(prompts, params)
    assert [o.meta["spec_accepted_tokens"] for o in outs] == [e.meta["spec_accepted_tokens"] for e in eager]
    assert_same_outputs(outs, eager)


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_graphs_under_adaptive_speculation(small_vocab_target, heads, method):
    """Adaptive speculation switches chains of every length, trees and plain steps (backlogs, then
    catch-ups) at random, each request with its own budget: graphed drafting still equals eager
    drafting call by call, and the output plain greedy decoding's."""
    spec = {"num_steps": 4, "topk": 4, "num_draft_tokens": 8, "adaptive": {"profile": False}}
    llm = _llm(small_vocab_target, method, heads[method], num_steps=None, speculative_extra=spec)
    shadow = Shadow(llm.engine.drafter)
    adaptive, rng = llm.engine.adaptive, random.Random(2)

    def decide(request_ids, remaining=None, verifies=1):
        tier = OFF if rng.random() < 0.3 else rng.choice(adaptive.tiers)
        steps = {r: 0 if tier.off else rng.randint(1, tier.num_steps) for r in request_ids}
        return Decision(tier, steps, 1.0, False)

    adaptive.policy.decide = decide
    prompts = motif_prompts(3, VOCAB, seed=5, max_noise=20)
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    plain = LLM(small_vocab_target, device="cpu", dtype="float32", page_size=4, max_total_tokens=1024)
    assert [o.token_ids for o in outs] == [p.token_ids for p in plain.generate(prompts, params)]
    assert shadow.chain_batches and shadow.extends


def test_chain_graph_pads_and_keeps_budgets(small_vocab_target, heads):
    """A direct chain replay: 3 requests in the 4-bucket with budgets 1, 4, 2; pad rows and steps past
    a request's budget write only the dummy page."""
    llm = _llm(small_vocab_target, "eagle3", heads["eagle3"])
    drafter, engine = llm.engine.drafter, llm.engine
    graphs: DraftGraphs = drafter.graphs
    assert graphs.shapes.chain_steps == 4 and graphs.shapes.extend_lens == (6,)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=8)) for p in _prompts(3, seed=4)]
    engine.step()  # the prefills: every request holds a seed now
    reqs = [engine._requests[i] for i in ids]
    for req in reqs:
        assert engine.kv.reserve(req, len(req.token_ids) + 5)
    budgets = [1, 4, 2]
    kv = drafter.kv_cache
    before = kv.k.clone()
    drafter.graphs = None
    drafter.draft(reqs, [b + 1 for b in budgets])
    eager = [list(r.draft) for r in reqs]
    written = (kv.k != before).any(dim=0).flatten(1).any(dim=1)
    kv.k.copy_(before)
    drafter.graphs = graphs
    drafter.draft(reqs, [b + 1 for b in budgets])
    pending = graphs.pending.tolist()  # sampling requests (the default) are graphed too
    assert resolve_drafts([r.draft for r in reqs], pending) == eager and [len(d) for d in eager] == [2, 5, 3]
    graphed_written = (kv.k != before).any(dim=0).flatten(1).any(dim=1)
    page = kv.page_size
    graphed_written[DUMMY_PAGE * page : (DUMMY_PAGE + 1) * page] = False
    assert torch.equal(graphed_written, written)  # the same real slots, nothing else
    for req in reqs:
        req.draft = []
    while engine.has_unfinished():
        engine.step()


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_draft_graphs_equal_eager_on_gpu(smollm2_gguf, tmp_path, method):
    """Captured draft graphs on the GPU against eager drafting of the same states (fp32): the match
    rate of draft tokens (kernels may split keys differently, so near-ties can flip) and close
    tails and KV; outputs stay the target's own."""
    from specserve.model.loader import load_model

    loaded = load_model(str(smollm2_gguf), torch.device("cuda"), torch.float32)
    config, tensors = random_head(method, loaded.arch, seed=3, **HEADS[method])
    folder = save_head(tmp_path / method, config, tensors)
    llm = _llm(loaded, method, folder, graphs=None, device="cuda", max_total_tokens=8192, page_size=16)
    assert llm.engine.drafter.graphs is not None and llm.engine.drafter.graphs.captured
    shadow = Shadow(llm.engine.drafter, exact=False)
    prompts = [[(17 * i + 5 * j) % 4000 + 100 for j in range(20 + 7 * i)] for i in range(6)]
    params = [SamplingParams(max_new_tokens=24 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(6)]
    outs = llm.generate(prompts, params)
    plain = LLM(loaded, dtype="float32", max_total_tokens=8192, page_size=16).generate(prompts, params)
    assert shadow.chain_batches and shadow.counts["after_target"] > 0
    assert shadow.matched >= 0.98 * shadow.tokens, (shadow.matched, shadow.tokens)
    agree = sum(o.token_ids == p.token_ids for o, p in zip(outs, plain, strict=True))
    assert agree >= len(prompts) - 1, "fp32 speculative outputs should equal plain greedy"
