"""A one-module head's draft trees searched on the device (specserve/spec/tree_graphs.py) against the
host's EAGLE-2 search (`TreeSearch`): the same trees, call by call, and the same engine outputs.

On the CPU the tree graphs' static buffers run without capture, the same padded path. Batches of 1..5
requests with a graph max batch of 4 pad to buckets (5 takes the host search), and lengths that end
near each other give requests different depths.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.kv_cache import DUMMY_PAGE
from specserve.model.head_checkpoint import random_head, save_head
from specserve.spec.draft_graphs import DRAFT_GRAPHS_ENV
from specserve.spec.tree_graphs import TreeGraphs, TreeShape

from engine_utils import assert_same_outputs, motif_prompts

VOCAB = 96
HEADS = {"eagle3": {"draft_vocab_size": 64}, "eagle": {"layers_per_module": 2}}
# (num_steps, topk, num_draft_tokens): a tree cut to its best 16, and one smaller than its 16 nodes.
SHAPES = {"deep": (4, 4, 16), "small": (2, 3, 16)}


@pytest.fixture(scope="module")
def heads(small_vocab_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("tree_graph_heads")
    return {
        m: save_head(root / m, *random_head(m, small_vocab_target.arch, seed=11, **kw))
        for m, kw in HEADS.items()
    }


def _llm(target, method, folder, shape, graphs: bool = True, **spec) -> LLM:
    steps, topk, nodes = shape
    speculative = {
        "method": method, "draft_model": str(folder), "num_steps": steps, "topk": topk,
        "num_draft_tokens": nodes, "device_steps": 0, **spec,
    }  # fmt: skip
    return LLM(
        target,
        device="cpu",
        dtype="float32",
        page_size=4,
        max_total_tokens=2048,
        attention_backend="triton",
        cuda_graphs=graphs,
        cuda_graph_max_batch=4,
        speculative=speculative,
    )


def _params(count: int, temperature: float = 0.0) -> list[SamplingParams]:
    """Lengths ending a few tokens apart: the last rounds draft to different depths per request."""
    return [
        SamplingParams(
            max_new_tokens=9 + 2 * i,
            temperature=temperature if i % 2 else 0.0,
            seed=i,
            ignore_eos=True,
            return_logprob=True,
        )
        for i in range(count)
    ]


class TreeShadow:
    """Each graphed tree search, searched again by the host from the same states, and compared."""

    def __init__(self, drafter) -> None:
        self.calls: list[tuple[int, tuple[int, ...]]] = []  # (requests, depths) of each graphed search
        self.nodes = 0
        self.written: torch.Tensor | None = None  # the head's KV slots the last graphed search changed
        graphed, host, kv = drafter._graph_trees, drafter._host_trees, drafter.kv_cache

        def compare(active, topk, num_nodes):
            before = kv.k.clone()
            trees = graphed(active, topk, num_nodes)
            if trees is None:
                return None
            # NaN == NaN here: slots never written may hold any bits (the cache is not zeroed)
            same = (kv.k == before) | (kv.k.isnan() & before.isnan())
            self.written = (~same).any(dim=0).flatten(1).any(dim=1)
            self.calls.append((len(active), tuple(d for _, d in active)))
            for mine, theirs in zip(trees, host(active, topk, num_nodes), strict=True):
                assert (mine is None) == (theirs is None)
                if mine is None:
                    continue
                assert mine.tokens == theirs.tokens
                self.nodes += mine.num_nodes
                for name in ("parents", "cand_tokens", "cand_rows"):
                    assert np.array_equal(getattr(mine, name), getattr(theirs, name)), name
                assert mine.q is None and theirs.q is None
            return trees

        drafter._graph_trees = compare


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("method", list(HEADS))
def test_graphed_trees_equal_the_host_search(small_vocab_target, heads, method, shape):
    """Every graphed search's trees equal the host search's from the same states (nodes, parents,
    candidates and their rows), in padded buckets, with mixed depths and sampling requests (a head
    drafts its top k for them too); a batch past the graphs' largest takes the host search."""
    llm = _llm(small_vocab_target, method, heads[method], SHAPES[shape])
    drafter = llm.engine.drafter
    assert isinstance(drafter.tree_graphs, TreeGraphs)
    assert drafter.tree_graphs.shapes == (TreeShape(*SHAPES[shape]),)
    shadow = TreeShadow(drafter)
    for count in (3, 1, 5):
        prompts = motif_prompts(count, VOCAB, seed=count, max_noise=12)
        llm.generate(prompts, _params(count, temperature=0.8))
    assert {n for n, _ in shadow.calls} >= {1, 3}, shadow.calls
    assert max(n for n, _ in shadow.calls) <= 4
    assert any(len(set(depths)) > 1 for _, depths in shadow.calls), "no mixed depths"
    assert shadow.nodes > 0


@pytest.mark.parametrize("method", list(HEADS))
def test_graphed_trees_stay_lossless(small_vocab_target, heads, method, monkeypatch):
    """Engine outputs with tree graphs equal the host search's (the same trees: the same accepts, the
    same sampled tokens and logprobs) and, greedy, plain decoding's."""
    prompts = motif_prompts(4, VOCAB, seed=3, max_noise=10)
    greedy, sampled = _params(4), _params(4, temperature=0.8)
    llm = _llm(small_vocab_target, method, heads[method], SHAPES["deep"])
    outs = llm.generate(prompts, greedy)
    outs_sampled = llm.generate(prompts, sampled)
    plain = LLM(small_vocab_target, device="cpu", dtype="float32", page_size=4, max_total_tokens=1024)
    assert [o.token_ids for o in outs] == [r.token_ids for r in plain.generate(prompts, greedy)]
    if method == "eagle3":  # the random EAGLE head's drafts are never accepted on these prompts
        assert sum(o.meta["spec_accepted_tokens"] for o in outs) > 0
    monkeypatch.setenv(DRAFT_GRAPHS_ENV, "0")
    host = _llm(small_vocab_target, method, heads[method], SHAPES["deep"])
    assert host.engine.drafter.tree_graphs is None
    for ours, theirs in (
        (outs, host.generate(prompts, greedy)),
        (outs_sampled, host.generate(prompts, sampled)),
    ):
        assert [o.meta["spec_accepted_tokens"] for o in ours] == [
            t.meta["spec_accepted_tokens"] for t in theirs
        ]
        assert_same_outputs(ours, theirs)


def test_graphed_search_writes_only_its_own_slots(small_vocab_target, heads):
    """A direct search: 3 requests in the 4-bucket, 1, 4 and 2 deep, each holding just the slots
    its tree needs (`tree_slots`, fewer than the deepest step feeds), the page table's other columns
    stale: the head's KV is written only there and on the dummy page, and the trees are the host
    search's."""
    llm = _llm(small_vocab_target, "eagle3", heads["eagle3"], (4, 4, 8))
    engine, drafter = llm.engine, llm.engine.drafter
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=8)) for p in motif_prompts(3, VOCAB, seed=9)]
    engine.step()  # the prefills: every request holds a seed now
    reqs, depths = [engine._requests[i] for i in ids], [1, 4, 2]
    kv, page = drafter.kv_cache, drafter.kv_cache.page_size
    allowed = torch.zeros(kv.k.shape[1], dtype=torch.bool)
    allowed[DUMMY_PAGE * page : (DUMMY_PAGE + 1) * page] = True
    for req, depth in zip(reqs, depths, strict=True):
        slots = drafter.tree_slots(depth, 4, 8)
        assert engine.kv.reserve(req, len(req.token_ids) + slots)
        for index in range(req.num_computed, len(req.token_ids) + slots):
            allowed[req.pages[index // page] * page + index % page] = True
    # Columns past a request's pages keep what earlier searches left: here a page the prompts fill.
    drafter.tree_graphs.page_table.fill_(reqs[1].pages[0])
    shadow = TreeShadow(drafter)
    drafter.draft_tree(reqs, depths, 4, 8)
    assert shadow.calls == [(3, (1, 4, 2))]
    assert shadow.written.any() and not (shadow.written & ~allowed).any()
    assert [len(r.draft) for r in reqs] == [4, 8, 8]
    for req in reqs:
        req.draft, req.draft_tree = [], None


def test_tree_graphs_only_for_one_module_heads(small_vocab_target, tmp_path):
    """A chain of MTP modules keeps the host search (the graphs feed one step module)."""
    folder = save_head(tmp_path / "mtp", *random_head("mtp", small_vocab_target.arch, seed=2, num_modules=3))
    llm = _llm(small_vocab_target, "mtp", folder, SHAPES["deep"])
    assert llm.engine.drafter.graphs is not None and llm.engine.drafter.tree_graphs is None


def test_tree_shape_layout():
    """Node ids by depth: k at depth 1, k² a depth after; the best N kept, or every node of a small tree."""
    shape = TreeShape(4, 4, 16)
    assert [shape.level(d) for d in (1, 2, 3, 4)] == [0, 4, 20, 36]
    assert shape.capacity == 52 and shape.kept == 16 and shape.fed == 12
    assert TreeShape(2, 3, 16).kept == 12 and TreeShape(1, 8, 32).kept == 8
    assert [shape.size(d) for d in (0, 1, 2)] == [0, 4, 20]


@pytest.mark.gpu
def test_tree_graphs_on_gpu_equal_the_host_search(smollm2_gguf, tmp_path):
    """Captured tree graphs (fp32, the SmolLM2 target, a random EAGLE-3 head) against the host search
    of the same states: near-ties may flip where kernels split keys differently, so most trees must
    be equal, and outputs stay plain greedy's."""
    from specserve.model.loader import load_model

    loaded = load_model(str(smollm2_gguf), torch.device("cuda"), torch.float32)
    config, tensors = random_head("eagle3", loaded.arch, seed=3, draft_vocab_size=2048)
    folder = save_head(tmp_path / "eagle3", config, tensors)
    spec = {"method": "eagle3", "draft_model": str(folder), "num_steps": 5, "topk": 8, "num_draft_tokens": 32}
    llm = LLM(loaded, dtype="float32", max_total_tokens=8192, page_size=16, speculative=spec)
    drafter = llm.engine.drafter
    assert drafter.tree_graphs is not None and drafter.tree_graphs.captured
    equal = total = 0
    graphed, host = drafter._graph_trees, drafter._host_trees

    def compare(active, topk, num_nodes):
        nonlocal equal, total
        trees = graphed(active, topk, num_nodes)
        for mine, theirs in zip(trees or [], host(active, topk, num_nodes), strict=True):
            total += 1
            equal += mine is not None and theirs is not None and mine.tokens == theirs.tokens
        return trees

    drafter._graph_trees = compare
    prompts = [[(17 * i + 5 * j) % 4000 + 100 for j in range(20 + 7 * i)] for i in range(6)]
    params = [SamplingParams(max_new_tokens=24 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(6)]
    outs = llm.generate(prompts, params)
    plain = LLM(loaded, dtype="float32", max_total_tokens=8192, page_size=16).generate(prompts, params)
    assert total > 10 and equal >= 0.9 * total, (equal, total)
    agree = sum(o.token_ids == p.token_ids for o, p in zip(outs, plain, strict=True))
    assert agree >= len(prompts) - 1, "fp32 speculative outputs should equal plain greedy"
