"""CUDA graphs of decode and verify steps: bucket choice, padding, and graphed steps equal to eager ones.

On the CPU the graphed path runs its static buffers and padding without capture (the Triton
backend's torch references); on a GPU the graphs are captured and replayed. Either way the padded
step must produce exactly what the eager step does: tokens equal, logprobs within 1e-4.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.request import Request
from specserve.engine.scheduler import ScheduledItem
from specserve.engine.step_input import PREFILL_GRAPH, build_step_input, unpack_step_input
from specserve.executor.cuda_graphs import CudaGraphs, GraphBuckets, gc_paused
from specserve.model.head_checkpoint import random_head, save_head
from specserve.model.loader import load_model
from specserve.model.tokenizer import load_tokenizer

from engine_utils import assert_same_outputs
from tiny_models import save_tiny_llama3

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 96  # a small vocabulary: outputs repeat, so n-gram drafts come and get accepted


@pytest.fixture(scope="module")
def target(smollm2_gguf, tmp_path_factory):
    folder = save_tiny_llama3(tmp_path_factory.mktemp("graphs") / "t", load_tokenizer(smollm2_gguf), VOCAB)
    return load_model(str(folder), torch.device(DEVICE), torch.float32)


@pytest.fixture
def graphed_runs(monkeypatch):
    """Counts the steps that ran through a graph bucket."""
    calls = []
    original = CudaGraphs.run

    def counting(self, step, capture=(), future=None):
        calls.append((step.attention.batch_size, step.attention.max_query_len))
        return original(self, step, capture, future)

    monkeypatch.setattr(CudaGraphs, "run", counting)
    return calls


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[10 + (i % rng.randrange(2, 6)) for i in range(rng.randrange(6, 30))] for _ in range(count)]


def _llm(target, graphs: bool, page_size: int = 1, **kwargs) -> LLM:
    return LLM(
        target,
        device=DEVICE,
        dtype="float32",
        page_size=page_size,
        max_total_tokens=2048,
        attention_backend="triton",
        cuda_graphs=graphs,
        cuda_graph_max_batch=4,
        **kwargs,
    )


def _params(count: int) -> list[SamplingParams]:
    """Different lengths, so the batch shrinks through eager (5 running) and graphed (<= 4) steps."""
    return [
        SamplingParams(max_new_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True, return_logprob=True)
        for i in range(count)
    ]


def test_buckets():
    buckets = GraphBuckets.for_engine(max_batch=40, max_draft=4)
    assert buckets.batch_sizes == (1, 2, 4, 8, 16, 24, 32, 40)
    assert buckets.query_lens == (1, 5)
    assert buckets.pick(3, 1) == (4, 1)
    assert buckets.pick(9, 2) == (16, 5)
    assert buckets.pick(40, 5) == (40, 5)
    assert buckets.pick(41, 1) is None and buckets.pick(1, 6) is None
    assert GraphBuckets.for_engine(max_batch=3, max_draft=0) == GraphBuckets((1, 2, 3), (1,))
    trees = GraphBuckets.for_engine(max_batch=40, max_draft=0, tree_len=65)
    assert trees.query_lens == (1, 65) and trees.masked_lens == (65,) and trees.max_masked_batch == 16
    assert trees.pick(9, 1) == (16, 1) and trees.pick(3, 40, tree=True) == (4, 65)
    assert trees.pick(17, 65, tree=True) is None and trees.pick(30, 1) == (32, 1)
    assert (24, 65) not in trees.shapes() and (16, 65) in trees.shapes()
    assert buckets.pick(2, 3, tree=True) is None  # no masked bucket: a tree step stays eager
    assert buckets.prefill_lens == () and buckets.pick_prefill(1, 5, 1) is None


def test_prefill_buckets():
    buckets = GraphBuckets.for_engine(max_batch=40, max_draft=4, prefill_rows=128)
    assert buckets.prefill_lens == (16, 32, 64, 128) and buckets.query_lens == (1, 5)
    assert buckets.prefill_shapes() == [(1, 16), (2, 16), (4, 16), (8, 16), (1, 32), (2, 32), (4, 32)] + [
        (1, 64),
        (2, 64),
        (1, 128),
    ]
    assert buckets.pick_prefill(1, 100, 1) == (1, 128)
    assert buckets.pick_prefill(3, 20, 3) == (4, 32)
    assert buckets.pick_prefill(2, 129, 1) is None  # past the longest
    assert buckets.pick_prefill(2, 100, 1) is None  # (2, 128) is past the rows
    assert buckets.pick_prefill(1, 10, 2) is None  # two logit rows for one request: input logprobs


def test_padding_touches_no_real_slot():
    reqs = [
        Request(f"r{i}", list(range(3, 3 + n)), SamplingParams(max_new_tokens=4), 0)
        for i, n in enumerate((5, 9, 2))
    ]
    for req, pages in zip(reqs, ([7, 8], [3, 4, 5], [9]), strict=True):
        req.pages = pages
    # Each decodes its last token; r1 also verifies one draft.
    items = [ScheduledItem(r, r.prompt_len - 1, 1, True) for r in reqs]
    items[1] = ScheduledItem(reqs[1], reqs[1].prompt_len - 1, 2, True, (11,))
    step = build_step_input(items, 4, torch.device("cpu"), lambda b, q: (4, 3))
    assert step.graphed and step.layout()[0] == 12 and step.attention.batch_size == 4
    assert step.attention.max_query_len == 3
    assert step.attention.query_start.tolist() == [0, 1, 3, 4, 4]
    assert step.attention.seq_lens.tolist() == [5, 10, 2, 0]
    assert step.attention.slot_mapping[4:].tolist() == [0] * 8  # pad tokens write the dummy slot
    assert step.positions[4:].tolist() == [0] * 8
    assert step.logit_rows.tolist() == [0, 1, 2, 3]  # the real rows only
    copy = unpack_step_input(step.layout(), step.packed.clone())
    assert copy.graphed and torch.equal(copy.attention.page_table, step.attention.page_table)
    # A step whose logit rows are not its token rows (a prefill) stays eager without prefill buckets.
    prefill = [ScheduledItem.of(r, r.prompt_len) for r in reqs]
    assert not build_step_input(prefill, 4, torch.device("cpu"), lambda b, q: (4, 16)).graphed
    # With them it is padded like a verify step, its logit rows the real last rows.
    step = build_step_input(prefill, 4, torch.device("cpu"), None, None, lambda b, q, r: (4, 16))
    assert step.graphed == PREFILL_GRAPH and step.layout()[0] == 64 and step.num_tokens == 16
    assert step.attention.query_start.tolist() == [0, 5, 14, 16, 16]
    assert step.logit_rows.tolist() == [4, 13, 15]
    assert step.attention.slot_mapping[16:].tolist() == [0] * 48
    assert unpack_step_input(step.layout(), step.packed.clone()).graphed == PREFILL_GRAPH


@pytest.mark.parametrize("page_size", [1, 16])
# Steps from the host (no device loop, which takes these logprob requests too): steps through the
# runner's buckets are what this test compares.
@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_steps": 3, "device_steps": 0}])
def test_graphed_steps_equal_eager(target, graphed_runs, page_size, speculative):
    prompts = _prompts(5)
    host = {"decode_steps": 0} if speculative is None else {}  # plain decoding's loop takes them too
    reference = _llm(target, False, page_size, speculative=speculative, **host).generate(prompts, _params(5))
    assert not graphed_runs
    llm = _llm(target, True, page_size, speculative=speculative, **host)
    assert_same_outputs(llm.generate(prompts, _params(5)), reference)
    assert len({b for b, _ in graphed_runs}) >= 2  # several batch buckets, with pad requests
    if speculative:  # verify steps ran in the (batch, num_steps + 1) graphs, and drafts were accepted
        assert 4 in {q for _, q in graphed_runs}
        assert sum(o.meta["spec_accepted_tokens"] for o in reference) > 0


@pytest.mark.parametrize("method", ["ngram", "standalone"])
def test_graphed_tree_steps_equal_eager(target, graphed_runs, method):
    """Draft-tree verify steps replay masked buckets (query len num_draft_tokens + 1, the tree mask
    copied in; decode steps beside them in unmasked ones): outputs equal eager steps."""
    spec = {"method": method, "num_steps": 3, "topk": 2, "num_draft_tokens": 4}
    if method == "standalone":
        spec["draft_model"] = str(target.location.path)
    prompts = _prompts(5, seed=2)
    reference = _llm(target, False, 4, speculative=spec).generate(prompts, _params(5))
    assert not graphed_runs
    outs = _llm(target, True, 4, speculative=spec).generate(prompts, _params(5))
    assert_same_outputs(outs, reference)
    assert 5 in {q for _, q in graphed_runs}
    assert sum(o.meta["spec_accepted_tokens"] for o in reference) > 0


def test_hidden_state_drafter_reads_graphed_features(target, graphed_runs, tmp_path):
    """EAGLE-3 fuses residual streams the graph captured: its drafts and outputs equal eager ones."""
    config, tensors = random_head("eagle3", target.arch, seed=5)
    folder = save_head(tmp_path / "eagle3", config, tensors)
    spec = {"method": "eagle3", "draft_model": str(folder), "num_steps": 3, "device_steps": 0}  # host steps
    prompts = _prompts(3, seed=1)
    reference = _llm(target, False, speculative=spec).generate(prompts, _params(3))
    outs = _llm(target, True, speculative=spec).generate(prompts, _params(3))
    assert_same_outputs(outs, reference)
    assert [o.meta["spec_accepted_tokens"] for o in outs] == [
        r.meta["spec_accepted_tokens"] for r in reference
    ]
    assert graphed_runs


@pytest.mark.parametrize("speculative", [None, "eagle3"])
def test_prefill_steps_replay_prefill_buckets(target, graphed_runs, extend_runs, speculative, tmp_path):
    """Prompts (with decodes beside them) replay the prefill buckets, EAGLE-3's extend over them
    its prefill extend buckets; outputs equal eager steps. A request asking for its prompt's
    logprobs (a logit row a prompt token) stays eager, and so does a prompt past the largest bucket."""
    spec = None
    if speculative:
        config, tensors = random_head("eagle3", target.arch, seed=5)
        folder = save_head(tmp_path / "h", config, tensors)
        spec = {"method": "eagle3", "draft_model": str(folder), "num_steps": 3}
    eager = _llm(target, False, 16, speculative=spec)
    llm = _llm(target, True, 16, speculative=spec, cuda_graph_prefill_tokens=128)
    prompts = _prompts(3, seed=3)
    assert_same_outputs(llm.generate(prompts, _params(3)), eager.generate(prompts, _params(3)))
    assert [q for _, q in graphed_runs if q >= 16], "no prefill step replayed a prefill bucket"
    if speculative:
        assert any(q >= 16 for _, q in extend_runs), "the head's extend over a prompt ran eagerly"
    graphed_runs.clear()
    # 140 tokens: past (1, 128); prompt logprobs: a logit row a token. Both stay eager.
    prompts = [[11] * 140, prompts[0]]
    params = _params(1) + [
        SamplingParams(
            max_new_tokens=5, temperature=0.0, ignore_eos=True, return_logprob=True, logprob_start_len=0
        )
    ]
    outs, reference = llm.generate(prompts, params), eager.generate(prompts, params)
    assert_same_outputs(outs, reference)
    mine, theirs = (o.meta["input_token_logprobs"] for o in (outs[1], reference[1]))
    assert len(mine) == len(theirs) == len(prompts[1])
    assert all(a[0] is None or abs(a[0] - b[0]) <= 1e-4 for a, b in zip(mine, theirs, strict=True))
    assert not [q for _, q in graphed_runs if q >= 16]


@pytest.fixture
def extend_runs(monkeypatch):
    """The extend buckets a head drafter's graphs ran."""
    from specserve.spec.draft_graphs import DraftGraphs

    calls = []
    original = DraftGraphs.run_extend

    def counting(self, feeds, features, rows, previous):
        calls.append(self.extend_bucket(len(feeds), max(len(t) for _, _, t in feeds)))
        return original(self, feeds, features, rows, previous)

    monkeypatch.setattr(DraftGraphs, "run_extend", counting)
    return calls


@pytest.mark.gpu
def test_smollm2_graphs_equal_eager_on_gpu(smollm2_gguf, mtbench_questions):
    """Captured graphs replayed at batch 1..16 (and past the largest bucket, eager) equal eager steps,
    in fp32 (bitwise-equal tokens expected; logprobs within 1e-4) with and without n-gram drafts."""
    loaded = load_model(str(smollm2_gguf), torch.device("cuda"), torch.float32)
    pool = {"max_total_tokens": 16384}  # several engines share the GPU
    eager = LLM(loaded, dtype="float32", cuda_graphs=False, **pool)
    prompts = [eager._chat_ids([{"role": "user", "content": q}]) for q in mtbench_questions[:20]]
    params = [
        SamplingParams(max_new_tokens=16 + 4 * i, temperature=0.0, ignore_eos=True, return_logprob=True)
        for i in range(len(prompts))
    ]
    for spec in (None, {"method": "ngram", "num_steps": 4}):
        reference = LLM(loaded, dtype="float32", cuda_graphs=False, speculative=spec, **pool)
        reference = reference.generate(prompts, params)
        graphed = LLM(loaded, dtype="float32", cuda_graph_max_batch=16, speculative=spec, **pool)
        assert graphed.engine.runner.graphs is not None and graphed.engine.runner.graphs.captured
        assert_same_outputs(graphed.generate(prompts, params), reference)


@pytest.mark.parametrize("enabled", [True, False])
def test_no_garbage_collection_inside_a_capture_and_the_collector_s_state_kept(enabled):
    """A collection inside a capture that frees an older graph makes CUDA fail the capture."""
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with pytest.raises(RuntimeError), gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("a failed capture")
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()
