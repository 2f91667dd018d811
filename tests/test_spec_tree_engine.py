"""Draft trees inside the engine: accepted-path compaction (invariant 6), tree drafts against a
from-scratch computation, logprobs, sampling, the Triton path, and a stress run with aborts and
retractions under a tiny KV pool.

The target is a small-vocabulary random model; the standalone drafter is the target itself (its
trees' best paths are accepted, so the compaction moves KV on most steps), the heads are random.
"""

from __future__ import annotations

import random

import pytest
import torch
from head_reference import reference_step_logits

from specserve import LLM, SamplingParams
from specserve.engine.request import Request
from specserve.engine.scheduler import ScheduledItem
from specserve.engine.stats import SpecSettings
from specserve.engine.step_input import build_step_input
from specserve.model.head_checkpoint import random_head, save_head

from engine_utils import assert_logprobs_equal, last_logits

VOCAB = 96
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def target(small_vocab_target):
    return small_vocab_target


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    shapes = {"eagle": {}, "eagle3": {"draft_vocab_size": 64}, "mtp": {"num_modules": 3}}
    return {m: save_head(root / m, *random_head(m, target.arch, seed=5, **kw)) for m, kw in shapes.items()}


@pytest.fixture(scope="module")
def plain(target):
    return LLM(target, device="cpu", dtype="float32", max_total_tokens=4096)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        motif = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 5))]
        out.append([rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 20))] + motif * 3)
    return out


def _llm(target, method: str, draft_model=None, **kwargs) -> LLM:
    spec = {"method": method, "num_steps": 4, "topk": 4, "num_draft_tokens": 16}
    spec.update(kwargs.pop("spec", {}))
    if method == "standalone":
        spec["draft_model"] = str(target.location.path)  # the target itself
    elif draft_model is not None:
        spec["draft_model"] = str(draft_model)
    kwargs.setdefault("max_total_tokens", 4096)
    return LLM(target, device="cpu", dtype="float32", speculative=spec, **kwargs)


def _count_moves(llm: LLM) -> list[int]:
    moves: list[int] = []
    runner = llm.engine.runner
    original = runner.move_kv

    def counting(src, dst, segments):
        moves.append(len(src))
        original(src, dst, segments)

    runner.move_kv = counting
    return moves


def _kv_of(engine, req: Request, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ps = engine.kv.page_size
    slots = torch.tensor([req.pages[p // ps] * ps + p % ps for p in range(length)])
    return engine.kv_cache.k[:, slots].clone(), engine.kv_cache.v[:, slots].clone()


def _prefill_kv(engine, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's KV of `tokens` computed from scratch by one prefill (in a plain engine's cache)."""
    req = Request("kv-probe", list(tokens), SamplingParams(max_new_tokens=1), seed=0)
    assert engine.kv.reserve(req, len(tokens))
    try:
        engine.runner.execute(
            build_step_input([ScheduledItem.of(req, len(tokens))], engine.kv.page_size, engine.device)
        )
        return _kv_of(engine, req, len(tokens))
    finally:
        engine.kv.free(req)


@pytest.mark.parametrize(("method", "page_size"), [("standalone", 1), ("standalone", 16), ("ngram", 16)])
def test_accepted_path_compaction(target, plain, method, page_size):
    """Invariant 6: after every step, each request's KV at positions 0..num_computed-1 is what a
    prefill of its tokens writes: the accepted nodes' KV sits at the next positions, in order, and no
    rejected branch's entry survives there (the moves really happened: counted)."""
    llm = _llm(target, method, page_size=page_size)
    moves = _count_moves(llm)
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in _prompts(3, seed=1)]
    checked = 0
    while engine.has_unfinished():
        engine.step()
        for req in engine.scheduler.running:
            if req.num_output == 0:
                continue
            n = req.num_computed
            k, v = _kv_of(engine, req, n)
            ref_k, ref_v = _prefill_kv(plain.engine, req.token_ids[:n])
            assert (k - ref_k).abs().max() < 1e-4 and (v - ref_v).abs().max() < 1e-4, (req.request_id, n)
            checked += 1
    assert checked >= 10 and len(ids) == 3
    if method == "standalone":
        assert sum(moves) > 5, "no accepted path needed moving: the compaction went untested"


def _record_trees(llm: LLM) -> list[tuple]:
    """Every tree drafted: (verified tokens, tree, output count, request)."""
    drafter, records = llm.engine.drafter, []
    original = drafter.draft_tree

    def recording(reqs, depths, topk, num_nodes):
        original(reqs, depths, topk, num_nodes)
        records.extend(
            (list(r.token_ids), r.draft_tree, r.num_output, r) for r in reqs if r.draft_tree is not None
        )

    drafter.draft_tree = recording
    return records


def _row_paths(tree) -> list[list[int]]:
    paths: list[list[int]] = [[]]
    for token, parent in zip(tree.tokens, tree.parents.tolist(), strict=True):
        paths.append([*paths[parent], token])
    return paths


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_head_trees_equal_a_from_scratch_computation(target, heads, method, temperature):
    """Every expanded node of every tree (its candidates: the top k, for sampling requests too, a
    head's trees being deterministic) equals the head run from scratch along that node's path
    (head_reference.py): the forest feeds, the tree masks, the MTP hidden-state chaining per path and
    the extend over the accepted path are all exact. Chunked prefill and pages of 4 included."""
    llm = _llm(
        target, method, heads[method], page_size=4, max_batched_tokens=24, spec={"num_steps": 4, "topk": 3}
    )
    records = _record_trees(llm)
    params = SamplingParams(max_new_tokens=16, temperature=temperature, top_k=40, seed=1, ignore_eos=True)
    llm.generate(_prompts(3, seed=2), params)
    head = llm.engine.drafter.head
    checked = 0
    for verified, tree, _, _ in records[::4]:
        assert tree.q is None, "a head's tree carries no q"
        paths = _row_paths(tree)
        for r, path in enumerate(paths):
            cands = [int(t) for t in tree.cand_tokens[r] if t >= 0]
            if not cands:
                continue
            logits = reference_step_logits(target.model, head, verified, [*path, 0])[len(path)]
            expected = head.to_target_ids(logits.topk(len(cands)).indices).tolist()
            assert cands == expected, (method, r)
            checked += 1
    assert checked >= 10


def test_standalone_trees_equal_the_targets_top_k(target, plain):
    llm = _llm(target, "standalone", page_size=16)
    records = _record_trees(llm)
    llm.generate(_prompts(2, seed=3), GREEDY)
    checked = 0
    for verified, tree, _, _ in records[::3]:
        for r, path in enumerate(_row_paths(tree)):
            cands = [int(t) for t in tree.cand_tokens[r] if t >= 0]
            if cands:
                logits = last_logits(plain.engine, [verified + path])[0]
                assert cands == logits.topk(len(cands)).indices.tolist()
                checked += 1
    assert checked >= 10


@pytest.mark.parametrize("method", ["ngram", "standalone"])
def test_logprobs_equal_prefill_scoring(target, plain, method):
    """Invariant 3 with trees: output logprobs (token, top-k, chosen ids) are read at the rows the
    tokens were drawn at, and equal scoring the same sequence with a prefill-only request."""
    llm = _llm(target, method)
    prompt = _prompts(1, seed=4)[0]
    probes = [1, 5, 50]
    asked = dict(return_logprob=True, top_logprobs_num=3, token_ids_logprob=probes)
    out = llm.generate(
        [prompt], SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True, **asked)
    )[0]
    assert out.meta["spec_accepted_tokens"] > 0
    scored = plain.generate(
        [prompt + out.token_ids], SamplingParams(max_new_tokens=0, logprob_start_len=len(prompt), **asked)
    )[0].meta
    assert_logprobs_equal(out.meta, scored)


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_sampled_trees_are_reproducible_whatever_the_batch(target, heads, method):
    llm = _llm(target, method, heads.get(method))
    prompts = _prompts(3, seed=5)
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    alone = llm.generate([prompts[0]], params)[0]
    together = llm.generate(prompts, [params, SamplingParams(max_new_tokens=5), params])
    assert alone.token_ids == together[0].token_ids
    assert alone.meta["spec_verify_ct"] > 0


def test_the_triton_path_inside_the_engine(target, monkeypatch):
    """verify_tree and kv_move under the interpreter give the tokens their torch references give."""
    prompts = _prompts(2, seed=6)
    sampled = SamplingParams(max_new_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)

    def run():
        llm = _llm(target, "standalone", page_size=4, spec={"num_steps": 3, "topk": 2, "num_draft_tokens": 5})
        moves = _count_moves(llm)
        return [o.token_ids for o in llm.generate(prompts, greedy) + llm.generate(prompts, sampled)], moves

    expected, _ = run()
    monkeypatch.setenv("SPECSERVE_TRITON_CPU", "1")
    got, moves = run()
    assert got == expected and sum(moves) > 0


def test_stress_arrivals_aborts_and_retractions(target, plain):
    """210 requests arriving at random steps, some aborted (waiting or mid-tree), a KV pool so small
    that running requests are retracted: every request ends (length or abort), every completed one
    equals plain greedy decoding, and the KV accounting holds after every step."""
    rng = random.Random(8)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 12))] * 2 for _ in range(210)]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    reference = {tuple(p): o.token_ids for p, o in zip(prompts, plain.generate(prompts, params), strict=True)}
    llm = _llm(
        target,
        "standalone",
        page_size=4,
        max_total_tokens=256,
        max_running_requests=12,
        enable_prefix_cache=True,
        spec={"num_steps": 3, "topk": 8, "num_draft_tokens": 24},
    )
    engine = llm.engine
    pending = list(enumerate(prompts))
    ids: dict[str, list[int]] = {}
    aborted: set[str] = set()
    finished: dict[str, object] = {}
    while pending or engine.has_unfinished():
        for _ in range(rng.randrange(0, 12)):
            if pending:
                i, prompt = pending.pop(0)
                ids[engine.add_request(prompt, params, request_id=f"r{i}")] = prompt
        live = [rid for rid in ids if rid not in finished and rid not in aborted]
        if live and rng.random() < 0.3:
            victim = rng.choice(live)
            assert engine.abort(victim)
            aborted.add(victim)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.check_kv_accounting()
    assert set(finished) == set(ids)
    assert engine.scheduler.num_retracted > 0
    completed = [rid for rid, out in finished.items() if out.finish_reason == "length"]
    assert {out.finish_reason for out in finished.values()} <= {"length", "abort"}
    assert len(completed) > 150 and len(aborted) > 10
    for rid in completed:
        assert finished[rid].token_ids == reference[tuple(ids[rid])], rid
    assert sum(finished[rid].meta["spec_accepted_tokens"] for rid in completed) > 0
    engine.check_kv_accounting()


def test_speculation_can_be_switched_per_step(target):
    """`spec_settings` changes the shape between steps (chain, tree, off) without losing a token."""
    llm = _llm(target, "standalone", page_size=4)
    engine = llm.engine
    prompts = _prompts(2, seed=9)
    reference = [o.token_ids for o in LLM(target, device="cpu", dtype="float32").generate(prompts, GREEDY)]
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    shapes = [SpecSettings(2, 1, 2), SpecSettings(), SpecSettings(4, 4, 16), SpecSettings(3, 8, 64)]
    done, step = {}, 0
    while engine.has_unfinished():
        engine.spec_settings = shapes[step % len(shapes)]
        for out in engine.step():
            done[out.request_id] = out
        step += 1
    assert [done[i].token_ids for i in ids] == reference
