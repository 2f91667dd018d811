"""The device loop with a head drafting (`specserve/engine/head_loop.py`): EAGLE / EAGLE-3 chains on the device.

On the CPU each loop iteration runs eagerly over the same static buffers a GPU captures. Its tokens
must be plain greedy decoding's; every chain it drafts must be what the head proposes for that
token sequence computed from scratch (head_reference.py: so the fixed-shape extend, its positions,
KV and seeds are right); its acceptance must equal the synchronous path's, draft for draft; and
when the loop hands requests back to the synchronous path (a sampling request arrives), the
synchronous drafts from the handed-back state must still be the from-scratch ones.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from head_reference import reference_step_logits

from specserve import LLM, SamplingParams
from specserve.config import SpeculativeConfig
from specserve.engine.device_loop import DeviceLoop
from specserve.engine.head_loop import HeadDeviceLoop
from specserve.model.head_checkpoint import random_head, save_head
from specserve.train.data import GenerationSettings, generate_responses
from specserve.train.trainer import TrainConfig, train_head

from engine_utils import (
    assert_same_logprobs,
    check_loop_reservations,
    cycle_tiers,
    gpu_switches_equal_plain,
    loop_llm,
    switched_on_device,
)

VOCAB = 96
# The random EAGLE-3 head is a deeper one (its further layer through the fused stream kernels); the
# trained one below has one layer, as the shipped head.
HEADS = {
    "eagle3": {"draft_vocab_size": 64, "layers_per_module": 2},
    "eagle": {"layers_per_module": 2},
    "mtp": {"num_modules": 3},
}


@pytest.fixture(scope="module")
def heads(small_vocab_target, tmp_path_factory):
    """Seeded random heads, and EAGLE-3 / EAGLE / MTP heads trained for seconds on the tiny target's
    own greedy answers ("trained-*"): random heads' greedy drafts are almost never accepted, and the
    loop's extend must pick the last of several accepted rows."""
    root = tmp_path_factory.mktemp("head_loop_heads")
    folders = {}
    for method, kwargs in HEADS.items():
        config, tensors = random_head(method, small_vocab_target.arch, seed=5, **kwargs)
        folders[method] = save_head(root / method, config, tensors)
    llm = LLM(small_vocab_target, device="cpu", dtype="float32", max_running_requests=128)
    settings = GenerationSettings(max_new_tokens=40, batch=128)
    samples = generate_responses(
        llm, _prompts(128, seed=0), root / "answers.npz", settings, log=lambda _: None
    )
    for method in ("eagle3", "eagle", "mtp"):
        cfg = TrainConfig(
            method=method, steps=4, lr=3e-3, warmup_steps=10, tokens_per_batch=1024, max_steps=150,
            checkpoint_every=1000, save_dtype="float32", num_modules=3 if method == "mtp" else 1,
        )  # fmt: skip
        train_head(
            small_vocab_target,
            samples,
            cfg,
            root / f"trained-{method}",
            progress_bar=False,
            log=lambda _: None,
        )
        folders[f"trained-{method}"] = root / f"trained-{method}"
    return folders


@pytest.fixture
def launches(monkeypatch):
    """Steps each device-loop launch queued (negative: resumed on the run before)."""
    calls: list[int] = []
    original = DeviceLoop.launch

    def counting(self, reqs, limits, stop_ids, iterations, resume=False):
        calls.append(-iterations if resume else iterations)
        return original(self, reqs, limits, stop_ids, iterations, resume)

    monkeypatch.setattr(DeviceLoop, "launch", counting)
    return calls


def _llm(target, method=None, folder=None, device_steps=4, num_steps=4, **kw) -> LLM:
    spec = None
    if method is not None:
        spec = {
            "method": method,
            "draft_model": str(folder),
            "num_steps": num_steps,
            "device_steps": device_steps,
        }
    return loop_llm(target, spec, max_total_tokens=2048, **kw)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 30))] for _ in range(count)]


def _record_loop_drafts(loop: HeadDeviceLoop) -> list[tuple[list[int], list[int]]]:
    """Every active row's (verified tokens, drafts) as the loop's verify input takes them."""
    records, original = [], loop.prepare

    def recording(hist, lengths, limits, *args, given, **kw):
        for b in range(hist.shape[0]):
            if lengths[b] < limits[b]:
                records.append((hist[b, : lengths[b]].tolist(), given[b].tolist()))
        return original(hist, lengths, limits, *args, given=given, **kw)

    loop.prepare = recording
    return records


def _record_sync_drafts(llm: LLM) -> list[tuple[list[int], list[int]]]:
    drafter, records = llm.engine.drafter, []
    original = drafter.draft

    def recording(reqs, budgets):
        original(reqs, budgets)
        pending = drafter.graphs.pending if drafter.graphs is not None else None
        for r in reqs:
            if r.draft and r.params.greedy:
                drafts = [pending[-1 - d].item() if d < 0 else d for d in r.draft]
                records.append((list(r.token_ids), drafts))

    drafter.draft = recording
    return records


def _check_against_reference(target, head, records, every: int = 2) -> int:
    checked = 0
    for verified, drafts in records[::every]:
        ref = reference_step_logits(target.model, head, verified, drafts)
        assert [head.to_target_ids(logits.argmax())[None].item() for logits in ref] == drafts
        checked += 1
    return checked


@pytest.mark.parametrize(
    ("method", "head"),
    [
        ("eagle3", "trained-eagle3"),
        ("eagle", "trained-eagle"),
        ("eagle3", "eagle3"),
        ("mtp", "trained-mtp"),  # three modules: each extends over the verify rows, shifted one back
    ],
)
def test_loop_equals_plain_and_the_reference(small_vocab_target, heads, launches, method, head):
    prompts = _prompts(128, seed=0)[::32]  # prompts the trained heads learned the answers of
    params = [SamplingParams(max_new_tokens=10 + 6 * i, temperature=0.0, ignore_eos=True) for i in range(4)]
    plain = _llm(small_vocab_target).generate(prompts, params)
    llm = _llm(small_vocab_target, method, heads[head])
    loop = llm.engine.device_loop
    assert isinstance(loop, HeadDeviceLoop)
    records = _record_loop_drafts(loop)
    carried, launch = [], loop.launch

    def carrying(reqs, limits, stop_ids, iterations, resume=False):
        carried.append(resume and any(r.finished for r in reqs))
        return launch(reqs, limits, stop_ids, iterations, resume)

    loop.launch = carrying
    looped = llm.generate(prompts, params)
    assert [o.token_ids for o in looped] == [o.token_ids for o in plain]
    assert max(launches) > 0 and min(launches) < 0, "fresh runs and runs chained on them"
    assert any(carried), "a run went on over a finished request's row (its head state idle)"
    assert _check_against_reference(small_vocab_target, llm.engine.drafter.head, records) >= 10
    launches.clear()
    long = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    lone = llm.generate(prompts[:1], long)[0]
    assert lone.token_ids == _llm(small_vocab_target).generate(prompts[:1], long)[0].token_ids
    assert len([n for n in launches if n > 0]) == 1, f"one fresh run, then runs chained on it: {launches}"
    sync = _llm(small_vocab_target, method, heads[head], device_steps=0).generate(prompts, params)
    for o, s in zip(looped, sync, strict=True):
        assert o.meta["spec_accept_histogram"] == s.meta["spec_accept_histogram"]
        assert o.meta["spec_verify_ct"] == s.meta["spec_verify_ct"]
    if head.startswith("trained"):
        deep = sum(sum(o.meta["spec_accept_histogram"][2:]) for o in looped)
        assert deep >= 5, f"verifies that accepted 2+ drafts: {deep}"


def test_hand_back_to_the_synchronous_path(small_vocab_target, heads, launches):
    """Greedy requests run in the loop until a request asking for more top logprobs than the loop
    records arrives; the synchronous path then drafts for them from the state the loop handed back,
    and later the loop takes them again."""
    prompts = _prompts(128, seed=0)[5:8]
    greedy = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    sampling = SamplingParams(
        max_new_tokens=6, temperature=0.9, seed=2, ignore_eos=True, return_logprob=True, top_logprobs_num=33
    )
    reference = _llm(small_vocab_target).generate(prompts[:2], greedy)
    llm = _llm(small_vocab_target, "eagle3", heads["trained-eagle3"])
    engine = llm.engine
    loop_records = _record_loop_drafts(engine.device_loop)
    sync_records = _record_sync_drafts(llm)
    engine.add_request(prompts[0], greedy, request_id="a")
    engine.add_request(prompts[1], greedy, request_id="b")
    finished, steps = {}, 0
    while engine.has_unfinished():
        steps += 1
        if steps == 4:
            assert launches, "the loop ran the greedy pair"
            engine.add_request(prompts[2], sampling, request_id="c")
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
    assert [finished["a"], finished["b"]] == [o.token_ids for o in reference]
    before = len([n for n in launches if n > 0])
    assert before >= 2, "the loop took the pair again after the logprobs request finished"
    head = engine.drafter.head
    handed = [r for r in sync_records if len(r[0]) > len(prompts[0])]
    assert handed, "the synchronous path drafted for requests the loop handed back"
    _check_against_reference(small_vocab_target, head, handed, every=1)
    _check_against_reference(small_vocab_target, head, loop_records, every=3)


SAMPLED = [
    SamplingParams(max_new_tokens=30, temperature=0.8, seed=1, ignore_eos=True),
    SamplingParams(max_new_tokens=37, temperature=0.6, top_k=5, seed=2, ignore_eos=True),
    SamplingParams(max_new_tokens=23, temperature=0.7, top_p=0.9, ignore_eos=True),
    SamplingParams(max_new_tokens=41, temperature=0.0, ignore_eos=True),
]


def test_sampled_chains_equal_the_synchronous_path(small_vocab_target, heads, launches):
    """Sampling requests beside a greedy one in the head's loop: its drafts are the head's argmax
    (the from-scratch ones), the accept test the host path's rejection sampling of deterministic
    drafts with its noise, so every request's tokens, accepts and verifies are the synchronous
    path's; drafts do get accepted, and runs go on over several steps."""
    prompts = _prompts(128, seed=0)[3::32]
    sync = _llm(small_vocab_target, "eagle3", heads["trained-eagle3"], device_steps=0).generate(
        prompts, SAMPLED
    )
    llm = _llm(small_vocab_target, "eagle3", heads["trained-eagle3"])
    records = _record_loop_drafts(llm.engine.device_loop)
    looped = llm.generate(prompts, SAMPLED)
    assert [o.token_ids for o in looped] == [o.token_ids for o in sync]
    for o, s in zip(looped, sync, strict=True):
        assert o.meta["spec_accept_histogram"] == s.meta["spec_accept_histogram"]
    assert max(launches) > 0 and min(launches) < 0, "fresh runs and runs chained on them"
    assert sum(o.meta["spec_accepted_tokens"] for o in looped[:3]) >= 5, "sampled drafts accepted"
    assert len({tuple(o.token_ids) for o in looped}) == len(prompts)
    assert _check_against_reference(small_vocab_target, llm.engine.drafter.head, records, every=3) >= 5


def _with_logprobs(params: list[SamplingParams]) -> list[SamplingParams]:
    """The same requests, each but the last asking for logprobs: top k of 0..2, named ids on some."""
    return [
        dataclasses.replace(
            p, return_logprob=True, top_logprobs_num=i, token_ids_logprob=(5, 9) if i % 2 else None
        )
        for i, p in enumerate(params[:-1])
    ] + params[-1:]


def test_logprob_requests_run_in_the_head_loop(small_vocab_target, heads, launches):
    """Sampling and greedy requests asking for logprobs run in the head's loop: the synchronous
    path's tokens, accepts and logprobs."""
    prompts = _prompts(128, seed=0)[3::32]
    params = _with_logprobs(SAMPLED)
    sync = _llm(small_vocab_target, "eagle3", heads["trained-eagle3"], device_steps=0).generate(
        prompts, params
    )
    looped = _llm(small_vocab_target, "eagle3", heads["trained-eagle3"]).generate(prompts, params)
    assert_same_logprobs(looped, sync, tol=1e-5)
    for o, s in zip(looped, sync, strict=True):
        assert o.meta["spec_accept_histogram"] == s.meta["spec_accept_histogram"]
    assert max(launches) > 0 and min(launches) < 0
    assert sum(o.meta["spec_accepted_tokens"] for o in looped[:3]) >= 5, "drafts accepted"


def test_adaptive_tiers(small_vocab_target, heads, launches):
    """Adaptive speculation with a head: a loop per chain tier (sharing the chain buckets), runs of
    whichever tier the policy holds; plain greedy tokens, and every loop's drafts the from-scratch
    ones."""
    prompts = _prompts(128, seed=0)[9:12]
    params = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    plain = _llm(small_vocab_target).generate(prompts, params)
    spec = {
        "method": "eagle3",
        "draft_model": str(heads["trained-eagle3"]),
        "num_steps": 4,
        "adaptive": {"tiers": ["off", 1, 2, 4]},
        "device_steps": 4,
    }
    llm = loop_llm(small_vocab_target, spec, max_total_tokens=2048)
    loops = llm.engine.device_loops
    assert sorted(loops) == [1, 2, 4] and all(isinstance(loop, HeadDeviceLoop) for loop in loops.values())
    records = [_record_loop_drafts(loop) for loop in loops.values()]
    looped = llm.generate(prompts, params)
    assert [o.token_ids for o in looped] == [o.token_ids for o in plain]
    single = llm.generate(prompts[:1], params)[0]
    assert single.token_ids == plain[0].token_ids
    assert launches, "the policy's held tiers ran in their loops"
    flat = [r for rec in records for r in rec]
    assert _check_against_reference(small_vocab_target, llm.engine.drafter.head, flat, every=3) >= 3


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_a_switch_of_chain_length_goes_on_on_the_device(small_vocab_target, heads, monkeypatch, method):
    """The policy switches tier at every step (chains 4, 1, 2): each new length's run goes on from
    the head state the last run left in the shared chain buckets (its seeds, tails, positions; each
    row's chain steps set for the new length), queued behind it; plain greedy tokens, and every
    chain the from-scratch one. The MTP chain's three modules: a chain of 1 or 2 leaves a module's
    tail to the extend alone."""
    prompts = _prompts(128, seed=0)[::32]
    params = [SamplingParams(max_new_tokens=24 + 12 * i, temperature=0.0, ignore_eos=True) for i in range(4)]
    plain = _llm(small_vocab_target).generate(prompts, params)
    spec = {
        "method": method,
        "draft_model": str(heads[f"trained-{method}"]),
        "num_steps": 4,
        "adaptive": {"tiers": ["off", 1, 2, 4], "profile": False},
        "device_steps": 4,
    }
    llm = loop_llm(small_vocab_target, spec, max_total_tokens=2048)
    records = [_record_loop_drafts(loop) for loop in llm.engine.device_loops.values()]
    decided = cycle_tiers(llm.engine, [4, 1, 2])
    flights = check_loop_reservations(monkeypatch)
    looped = llm.generate(prompts, params)
    assert [o.token_ids for o in looped] == [o.token_ids for o in plain]
    assert set(decided) == {1, 2, 4}
    assert switched_on_device(flights) >= 4, [(f.loop.num_steps, f.resumed) for f in flights]
    deep = sum(sum(o.meta["spec_accept_histogram"][2:]) for o in looped)
    assert deep >= 5, f"verifies that accepted 2+ drafts: {deep}"
    flat = [r for rec in records for r in rec]
    assert _check_against_reference(small_vocab_target, llm.engine.drafter.head, flat, every=2) >= 10


def test_settings(small_vocab_target, heads):
    SpeculativeConfig(method="eagle3", draft_model="h", num_steps=4, device_steps=8).validate()
    for bad in (dict(topk=2), dict(num_steps=1)):
        with pytest.raises(ValueError, match="speculative.device_steps"):
            SpeculativeConfig.from_value(
                {"method": "eagle3", "draft_model": "h", "num_steps": 4, "device_steps": 8, **bad}
            ).validate()
    # an MTP chain of several modules drafts in the loop too, by default
    assert isinstance(
        _llm(small_vocab_target, "mtp", heads["mtp"], device_steps=None).engine.device_loop, HeadDeviceLoop
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("method", "kwargs"), [("eagle3", {}), ("mtp", {"num_modules": 2})])
def test_gpu_captured_head_loop_equals_plain(
    smollm2_gguf, mtbench_questions, launches, tmp_path, method, kwargs
):
    """fp32 SmolLM2 on the GPU with a seeded random EAGLE-3 head, or an MTP chain of two modules: the
    captured loop's tokens are plain greedy decoding's, batch 1 and 3, in chained runs."""
    from specserve.model.loader import load_model

    common = dict(device="cuda", dtype="float32", max_total_tokens=1 << 14, cuda_graph_max_batch=4)
    arch = load_model(str(smollm2_gguf), torch.device("cpu"), torch.float32).arch
    config, tensors = random_head(method, arch, seed=1, **kwargs)
    folder = save_head(tmp_path / method, config, tensors)
    params = SamplingParams(max_new_tokens=64, temperature=0.0)
    prompts = mtbench_questions[:3]
    plain = LLM(str(smollm2_gguf), **common)
    want = plain.generate(prompts, params)
    del plain
    spec = {"method": method, "draft_model": str(folder), "num_steps": 4, "device_steps": 8}
    looped = LLM(str(smollm2_gguf), speculative=spec, **common)
    assert isinstance(looped.engine.device_loop, HeadDeviceLoop) and looped.engine.device_loop.loop_graphs
    got = looped.generate(prompts, params)
    got_one = looped.generate(prompts[:1], params)[0]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got_one.token_ids == want[0].token_ids
    assert min(launches) < 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_captured_sampled_head_loop_equals_the_synchronous_path(
    smollm2_gguf, mtbench_questions, launches
):
    """fp32 SmolLM2 on the GPU with the shipped EAGLE-3 head: sampling requests (with a greedy one)
    in the captured head loop, their iteration captured for the run's filters, take the synchronous
    path's tokens and accepts (drafts the head's argmax, the host's rejection test), batch 4."""
    from pathlib import Path

    import specserve

    common = dict(device="cuda", dtype="float32", max_total_tokens=1 << 14, cuda_graph_max_batch=4)
    head = Path(specserve.__file__).parent / "heads" / "smollm2-135m-instruct"
    spec = {"method": "eagle3", "draft_model": str(head), "num_steps": 3}
    params = [dataclasses.replace(p, max_new_tokens=80) for p in SAMPLED]
    prompts = mtbench_questions[:4]
    sync = LLM(str(smollm2_gguf), speculative={**spec, "device_steps": 0}, **common)
    want = sync.generate(prompts, params)
    del sync
    looped = LLM(str(smollm2_gguf), speculative={**spec, "device_steps": 8}, **common)
    got = looped.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.meta["spec_accept_histogram"] for o in got] == [o.meta["spec_accept_histogram"] for o in want]
    assert min(launches) < 0 and looped.engine.device_loop.run_graphs
    assert sum(o.meta["spec_accepted_tokens"] for o in got[:3]) > 20, "sampled drafts accepted"
    # The same requests asking for logprobs: the host path's tokens, and its logprobs within fp32 rounding.
    params = _with_logprobs(params)
    del looped
    sync = LLM(str(smollm2_gguf), speculative={**spec, "device_steps": 0}, **common)
    want = sync.generate(prompts, params)
    del sync
    looped = LLM(str(smollm2_gguf), speculative={**spec, "device_steps": 8}, **common)
    launches.clear()
    assert_same_logprobs(looped.generate(prompts, params), want)
    assert min(launches) < 0 and any(key[2] is not None for key in looped.engine.device_loop.run_graphs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_captured_head_loops_switch_on_the_device(smollm2_gguf, mtbench_questions, monkeypatch):
    """fp32 SmolLM2 on the GPU with the shipped EAGLE-3 head: the captured loops of chains 4, 1 and 2
    in turn, switched at every step on the device over the shared chain buckets: plain greedy
    decoding's tokens, batch 3, drafts accepted as deep as a static chain's."""
    from pathlib import Path

    import specserve

    common = dict(device="cuda", dtype="float32", max_total_tokens=1 << 14, cuda_graph_max_batch=4)
    head = Path(specserve.__file__).parent / "heads" / "smollm2-135m-instruct"
    params = SamplingParams(max_new_tokens=96, temperature=0.0)
    spec = {
        "method": "eagle3",
        "draft_model": str(head),
        "num_steps": 4,
        "adaptive": {"tiers": ["off", 1, 2, 4]},
        "device_steps": 4,
    }
    order = [4, 1, 2]
    got = gpu_switches_equal_plain(
        smollm2_gguf, mtbench_questions[:3], params, spec, order, monkeypatch, **common
    )
    tokens = sum(len(o.token_ids) for o in got)
    verifies = sum(o.meta["spec_verify_ct"] for o in got)
    assert tokens / verifies > 1.5, f"{tokens} tokens in {verifies} verifies: the chains' seeds are right"
