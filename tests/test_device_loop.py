"""The device loop (`specserve/engine/device_loop.py`): greedy n-gram chains queued back to back,
and plain greedy decoding the same way (chains of no drafts, `decode_steps`).

On the CPU the loop runs the verify bucket's static buffers eagerly (no capture), the same code
that replays graphs on a GPU. Its tokens must be exactly plain greedy decoding's, through length
limits, stop ids, EOS and stop strings, a batch that shrinks, requests that arrive mid-run and
requests the loop cannot take (sampling, logprobs); its verifies must be counted as the
synchronous path counts them; the KV accounting check runs after every test (conftest).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.config import SpeculativeConfig
from specserve.engine import device_loop
from specserve.engine.device_loop import DeviceLoop, LoopFlight, carries
from specserve.engine.engine import Engine
from specserve.engine.loop_logprobs import LogprobShape
from specserve.engine.sampler import GREEDY, SamplingFlags

from engine_utils import (
    assert_same_logprobs,
    check_loop_reservations,
    cycle_tiers,
    gpu_switches_equal_plain,
    loop_llm,
    switched_on_device,
)

LOOP = {"method": "ngram", "num_steps": 4, "device_steps": 4}
# The loops most tests run: n-gram chains, and plain decoding in the loop (no speculation).
KINDS = ["ngram", "plain"]


@pytest.fixture
def launches(monkeypatch):
    """Steps each device-loop launch queued (negative: resumed on the run before, on the device)."""
    calls: list[int] = []
    original = DeviceLoop.launch

    def counting(self, reqs, limits, stop_ids, iterations, resume=False):
        calls.append(-iterations if resume else iterations)  # negative: a run chained on one in flight
        return original(self, reqs, limits, stop_ids, iterations, resume)

    monkeypatch.setattr(DeviceLoop, "launch", counting)
    return calls


@pytest.fixture
def flights(monkeypatch):
    """The runs device-loop engines launched."""
    seen: list[LoopFlight] = []
    original = Engine._loop_launch

    def spying(self, flight):
        new = original(self, flight)
        if new is not None:
            seen.append(new)
        return new

    monkeypatch.setattr(Engine, "_loop_launch", spying)
    return seen


def _llm(target, speculative=None, **kwargs) -> LLM:
    return loop_llm(target, speculative, **kwargs)


def _looped(target, kind: str, **kwargs) -> LLM:
    """An engine whose greedy requests run in the device loop: n-gram chains, or plain decoding."""
    if kind == "plain":
        return _llm(target, decode_steps=4, **kwargs)
    return _llm(target, LOOP, **kwargs)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[10 + (i % rng.randrange(2, 6)) for i in range(rng.randrange(6, 30))] for _ in range(count)]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_plain(small_vocab_target, launches, kind):
    prompts = _prompts(4)
    params = [SamplingParams(max_new_tokens=9 + 7 * i, temperature=0.0, ignore_eos=True) for i in range(4)]
    plain = _llm(small_vocab_target).generate(prompts, params)
    llm = _looped(small_vocab_target, kind)
    looped = llm.generate(prompts, params)
    assert [o.token_ids for o in looped] == [o.token_ids for o in plain]
    assert max(launches) == 4 and min(launches) < 0, "fresh runs and runs chained on them"
    if kind == "plain":
        # Its prefills were overlapped: the loop started once their steps in flight settled.
        assert llm.engine._overlap
        assert all(not o.meta.get("spec_verify_ct") for o in looped), "plain decoding verifies nothing"
        return
    for o, p in zip(looped, params, strict=True):
        assert len(o.token_ids) == p.max_new_tokens
        hist = o.meta["spec_accept_histogram"]
        assert sum(hist) == o.meta["spec_verify_ct"]
        assert sum(n * c for n, c in enumerate(hist)) == o.meta["spec_accepted_tokens"]
    accepted = sum(o.meta["spec_accepted_tokens"] for o in looped)
    assert accepted > 0, "the tiny model's repetitive outputs should accept drafts"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("page_size", "glue"), [(1, "torch"), (16, "torch"), (4, "triton")])
def test_stops_match_plain(small_vocab_target, launches, monkeypatch, page_size, glue, kind):
    """Stop ids, EOS and stop strings end each request where plain decoding ends it, wherever they
    fall in a loop's steps; a lone request and a batch alike. `triton`: the loop's glue through its
    kernels (`kernels/loop_glue.py`, under the Triton interpreter on the CPU), the rest unchanged."""
    if glue == "triton":
        monkeypatch.setattr("specserve.engine.device_loop.use_triton", lambda device: True)
    prompts = _prompts(3, seed=3)
    plain_llm = _llm(small_vocab_target, page_size=page_size)
    free = plain_llm.generate(prompts, SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True))
    params = []
    for i, out in enumerate(free):
        stop_at = out.token_ids[5 + 4 * i]  # a token the answer produces, so the request stops early
        params.append(SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=[stop_at]))
    text = free[0].text
    params[0] = SamplingParams(
        max_new_tokens=40, temperature=0.0, stop=[text[len(text) // 2 : len(text) // 2 + 3]]
    )
    plain = plain_llm.generate(prompts, params)
    llm = _looped(small_vocab_target, kind, page_size=page_size)
    looped = llm.generate(prompts, params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in looped] == [
        (o.token_ids, o.text, o.finish_reason) for o in plain
    ]
    alone = llm.generate(prompts[1:2], params[1:2])[0]
    assert alone.token_ids == plain[1].token_ids
    assert launches
    assert (llm.engine.device_loop.prepare.__name__ == "loop_prepare") == (glue == "triton")


@pytest.mark.parametrize("kind", KINDS)
def test_requests_it_cannot_take_fall_back(small_vocab_target, launches, kind):
    """A request asking for more top logprobs than the loop records in the batch: the synchronous
    path runs."""
    prompts = _prompts(2, seed=5)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    other = SamplingParams(
        max_new_tokens=12, temperature=0.0, ignore_eos=True, return_logprob=True, top_logprobs_num=33
    )
    plain = _llm(small_vocab_target).generate(prompts, [greedy, other])
    looped = _looped(small_vocab_target, kind).generate(prompts, [greedy, other])
    assert [o.token_ids for o in looped] == [o.token_ids for o in plain]
    assert not launches


LOGPROBS = [
    SamplingParams(
        max_new_tokens=25, temperature=0.0, ignore_eos=True, return_logprob=True, top_logprobs_num=3
    ),
    SamplingParams(max_new_tokens=22, temperature=0.0, ignore_eos=True),
    SamplingParams(
        max_new_tokens=27,
        temperature=0.9,
        seed=3,
        ignore_eos=True,
        return_logprob=True,
        token_ids_logprob=(10, 11, 12),
    ),
    SamplingParams(
        max_new_tokens=20,
        temperature=1.0,
        top_k=5,
        seed=8,
        ignore_eos=True,
        return_logprob=True,
        top_logprobs_num=5,
        token_ids_logprob=(13,),
    ),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("picks", [[0, 1], [2], [0, 1, 2, 3]], ids=["greedy", "sampled", "mixed"])
def test_logprob_requests_run_in_the_loop(small_vocab_target, launches, kind, picks):
    """Requests asking for logprobs (the token's, top k, named ids; greedy and sampled, beside one
    that asks for none) run in the loop, each row recording them in the iteration: the synchronous
    path's tokens and logprobs (the same arithmetic, `logprob_columns`, over logits the CPU's
    differently padded forwards round apart by an ulp or so)."""
    prompts = _prompts(len(picks), seed=41)
    params = [LOGPROBS[i] for i in picks]
    sync = _llm(small_vocab_target, None if kind == "plain" else {**LOOP, "device_steps": 0})
    expected = sync.generate(prompts, params)
    looped = _looped(small_vocab_target, kind).generate(prompts, params)
    assert launches and max(launches) == 4
    assert_same_logprobs(looped, expected, tol=1e-5)
    for o, p in zip(looped, params, strict=True):
        if p.return_logprob:
            assert len(o.meta["output_token_logprobs"]) == p.max_new_tokens
        if p.top_logprobs_num:
            assert all(len(top) == p.top_logprobs_num for top in o.meta["output_top_logprobs"])


SAMPLED = [
    SamplingParams(max_new_tokens=30, temperature=0.8, seed=1, ignore_eos=True),
    SamplingParams(max_new_tokens=30, temperature=1.0, top_k=5, seed=2, ignore_eos=True),
    SamplingParams(max_new_tokens=30, temperature=0.7, top_p=0.9, ignore_eos=True),
    SamplingParams(max_new_tokens=30, temperature=1.2, min_p=0.1, seed=4, ignore_eos=True),
    SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True),
]


@pytest.mark.parametrize(
    "picks",
    [[0], [0, 3], [1, 4, 0], [2, 0, 3, 4]],
    ids=["temperature", "min-p", "top-k-and-greedy", "top-p-min-p-greedy"],
)
def test_sampled_requests_decode_in_the_plain_loop(small_vocab_target, launches, picks):
    """Plain decoding's loop draws sampling requests as the host path does (the same counter-hashed
    noise, the same filters' code path for the same batch): the same tokens, request by request,
    whatever the mix of temperature, top-k, top-p, min-p and greedy rows."""
    prompts = _prompts(len(picks), seed=29)
    params = [SAMPLED[i] for i in picks]
    host = _llm(small_vocab_target).generate(prompts, params)
    looped = _looped(small_vocab_target, "plain").generate(prompts, params)
    assert [o.token_ids for o in looped] == [o.token_ids for o in host]
    assert launches and max(launches) == 4
    assert len({tuple(o.token_ids) for o in looped}) == len(picks), "distinct draws"


@pytest.mark.parametrize(
    "picks",
    [[0], [0, 3], [1, 4, 0], [2, 0, 3, 4]],
    ids=["temperature", "min-p", "top-k-and-greedy", "top-p-min-p-greedy"],
)
def test_sampled_chains_equal_the_synchronous_path(small_vocab_target, launches, picks):
    """N-gram chains of sampling requests in the loop: the host path's rejection test of each
    deterministic draft (accepted with the target's probability of it, else a draw from the rest)
    with its counter-hashed noise, drafts counted only where the host proposes them (never at a
    request's last token): the synchronous path's tokens and accepts, request by request."""
    prompts = _prompts(len(picks), seed=37)
    params = [dataclasses.replace(SAMPLED[i], max_new_tokens=21 + 5 * n) for n, i in enumerate(picks)]
    sync = _llm(small_vocab_target, {**LOOP, "device_steps": 0}).generate(prompts, params)
    looped = _looped(small_vocab_target, "ngram").generate(prompts, params)
    assert [o.token_ids for o in looped] == [o.token_ids for o in sync]
    for o, s in zip(looped, sync, strict=True):
        assert o.meta["spec_accept_histogram"] == s.meta["spec_accept_histogram"]
    assert launches and max(launches) == 4
    assert sum(o.meta["spec_accepted_tokens"] for o in looped) > 0, "sampled drafts accepted"


@pytest.mark.parametrize("seed", range(6))
def test_sampled_verify_rows_equal_verify_chains(seed):
    """`SamplingRows.verify` then the loop's accept, on random peaked logits with random drafts
    (many of them the argmax, so the accept test passes often), lookups of every length and rooms
    of 1..6 tokens: each request takes exactly what the host path's `verify_chains` emits for the
    drafts the host would propose (those before the request's last token)."""
    from types import SimpleNamespace

    from specserve.engine.device_loop import SamplingRows
    from specserve.engine.sampler import SamplingRow, sampling_columns, sampling_flags
    from specserve.spec.verify import verify_chains
    from specserve_kernels.loop_glue import loop_accept_ref

    gen = torch.Generator().manual_seed(seed)
    batch, k, vocab = 6, 3, 24
    logits = torch.randn(batch * (k + 1), vocab, generator=gen) * 3
    best = logits.argmax(dim=1).view(batch, k + 1)[:, :k]
    drafts = torch.where(
        torch.rand(batch, k, generator=gen) < 0.7, best, torch.randint(vocab, (batch, k), generator=gen)
    )
    valid = torch.arange(k)[None, :] < torch.randint(k + 1, (batch, 1), generator=gen)
    fixed = [(0.9, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.1, 0, 0.9, 0.0), (0.0, 0, 1.0, 0.0)] * 2
    reqs = [SimpleNamespace(sampling_fixed=fixed[b], seed=100 + b, prompt_len=3 + b) for b in range(batch)]
    lengths = torch.tensor([3 + b + 2 * b for b in range(batch)])  # output index 2b
    rooms = torch.randint(1, 7, (batch,), generator=gen)
    limits = lengths + rooms
    rows = SamplingRows(batch, torch.device("cpu"))
    rows.write(reqs, batch)
    floats, top_k = sampling_columns(fixed[:batch])
    flags = sampling_flags(floats[0], top_k, floats[1], floats[2])
    target, matched = rows.verify(logits, lengths, limits, drafts, valid, flags)
    hist = torch.zeros(batch, 64, dtype=torch.int64)
    records = torch.zeros(batch, k + 3, dtype=torch.int64)
    stops = torch.full((batch, 2), -1, dtype=torch.int64)
    loop_accept_ref(target, matched, valid, hist, lengths.clone(), limits.clone(), stops, records)
    taken = [target[b, : records[b, k + 1]].tolist() for b in range(batch)]
    host_drafts = [drafts[b, : min(int(valid[b].sum()), int(rooms[b]) - 1)].tolist() for b in range(batch)]
    host_rows, host_logits = [], []
    for b, chain in enumerate(host_drafts):
        for j in range(len(chain) + 1):
            host_rows.append(SamplingRow(*fixed[b], 100 + b, 2 * b + j))
            host_logits.append(logits[b * (k + 1) + j])
    emitted, _ = verify_chains(torch.stack(host_logits), host_rows, host_drafts)
    assert taken == emitted


def test_sampled_switches_of_chain_length(small_vocab_target, monkeypatch):
    """Sampling requests through switches of tier at every step (chains and off): the run a switch
    queues draws them with the rows' sampling settings the loops share; a greedy row beside them
    stays plain greedy decoding's, and sampling rows are drawn (not taken greedily)."""
    prompts = _prompts(3, seed=41)
    greedy = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
    params = [greedy, SAMPLED[0], dataclasses.replace(SAMPLED[1], max_new_tokens=44)]
    plain = _llm(small_vocab_target).generate(prompts, greedy)
    spec = {**LOOP, "adaptive": {"tiers": ["off", 1, 2, 4], "profile": False}}
    llm = _llm(small_vocab_target, spec)
    cycle_tiers(llm.engine, [4, 0, 1, 2])
    flights = check_loop_reservations(monkeypatch)
    looped = llm.generate(prompts, params)
    assert looped[0].token_ids == plain[0].token_ids
    assert all(o.token_ids != p.token_ids for o, p in zip(looped[1:], plain[1:], strict=True))
    assert switched_on_device(flights) >= 4
    assert all(not f.flags.all_greedy for f in flights if len(f.live()) == 3)


def test_a_switch_waits_for_its_sampled_iteration(small_vocab_target):
    """Where iterations are captured, a switch of tier is queued behind a sampled run only if the new
    tier's iteration for the run's filters is captured already (a capture runs over inactive rows,
    which a queued run's are not); else the engine starts a fresh run, which captures it."""
    spec = {**LOOP, "adaptive": {"tiers": ["off", 2, 4], "profile": False}}
    loops = _llm(small_vocab_target, spec).engine.device_loops
    two, four = loops[2], loops[4]
    two.graphs.captured = True  # as on CUDA: the engine's loops share its graphs
    sampled = SamplingFlags(False, True, False, False)
    two.state.flags = sampled
    bucket = four.bucket(3)
    four.loop_graphs[bucket] = object()
    assert not four.follows(two, 3), "its greedy iteration is not the run's"
    four.run_graphs[(bucket, sampled, None)] = object()
    assert four.follows(two, 3)
    two.state.logprobs = LogprobShape(4, 0)
    assert not four.follows(two, 3), "nor is its iteration without logprobs"
    four.run_graphs[(bucket, sampled, LogprobShape(4, 0))] = object()
    assert four.follows(two, 3)
    two.state.flags, two.state.logprobs = GREEDY, None
    assert four.follows(two, 3)
    del four.loop_graphs[bucket]
    assert not four.follows(two, 3) and two.follows(two, 3)


def test_a_run_whose_requests_filters_change_starts_afresh(small_vocab_target, flights):
    """The only top-p request finishes first: the host draws the others without the sorted filter
    from then on, so the loop's next run is a fresh one with the survivors' filters (not a
    resumed one with the old), and the tokens stay the host path's."""
    prompts = _prompts(3, seed=31)
    params = [
        SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.8, seed=5, ignore_eos=True),
        SamplingParams(max_new_tokens=40, temperature=0.9, seed=6, ignore_eos=True),
        SamplingParams(max_new_tokens=40, temperature=1.1, seed=7, ignore_eos=True),
    ]
    host = _llm(small_vocab_target).generate(prompts, params)
    looped = _looped(small_vocab_target, "plain").generate(prompts, params)
    assert [o.token_ids for o in looped] == [o.token_ids for o in host]
    filters = [(f.resumed, f.flags.any_top_p) for f in flights]
    assert filters[0] == (False, True) and (False, False) in filters, filters
    assert not any(resumed and top_p for resumed, top_p in filters[filters.index((False, False)) :])


@pytest.mark.parametrize("kind", KINDS)
def test_arrivals_between_runs(small_vocab_target, launches, kind):
    """A request added while others decode waits at most one run, then joins; tokens unchanged."""
    prompts = _prompts(3, seed=7)
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    reference = _llm(small_vocab_target).generate(prompts, params)
    engine = _looped(small_vocab_target, kind).engine
    engine.add_request(prompts[0], params, request_id="a")
    finished = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        if steps == 3:
            engine.add_request(prompts[1], params, request_id="b")
            engine.add_request(prompts[2], params, request_id="c")
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
    assert [finished[r] for r in "abc"] == [o.token_ids for o in reference]
    assert len(launches) >= 3


@pytest.mark.parametrize("kind", KINDS)
def test_abort_while_in_flight(small_vocab_target, launches, kind):
    """A request aborted while a run of it is in flight: the others go on unchanged."""
    prompts = _prompts(3, seed=11)
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    reference = _llm(small_vocab_target).generate(prompts, params)
    engine = _looped(small_vocab_target, kind).engine
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(i))
    finished = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if steps == 4:
            assert engine._loop_flight is not None, "a run in flight"
            assert engine.abort("1")
    assert finished["1"].finish_reason == "abort"
    assert [finished[i].token_ids for i in "02"] == [reference[0].token_ids, reference[2].token_ids]


@pytest.mark.parametrize("share", [4, 0])
@pytest.mark.parametrize("kind", KINDS)
def test_runs_go_on_over_finished_rows(small_vocab_target, flights, monkeypatch, share, kind):
    """Requests that finish mid-chain (their length, a stop id, a stop string, which only the host
    sees, and an abort) leave their rows idle in the runs queued after them: the chain goes on
    without a fresh run while more than 1/CARRY_SHARE of its rows run, the others' tokens are plain
    decoding's and no page leaks (conftest's check). CARRY_SHARE 0: every finish starts a fresh run."""
    monkeypatch.setattr(device_loop, "CARRY_SHARE", share)
    prompts = _prompts(4, seed=19)
    plain_llm = _llm(small_vocab_target)
    free = plain_llm.generate(prompts, SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True))
    # Finishes spread over the chain: a stop string (which the device never sees: its row runs on,
    # its KV to the dummy page) first, a stop id first seen well into its answer later.
    text, ids = free[1].text, free[2].token_ids
    stop = next(
        text[i : i + n] for i in range(4, len(text)) for n in range(3, 9) if text.find(text[i : i + n]) == i
    )
    stop_id = next(t for i, t in enumerate(ids) if i >= 24 and ids.index(t) == i)
    params = [
        SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=48, temperature=0.0, stop=[stop]),
        SamplingParams(max_new_tokens=48, temperature=0.0, stop_token_ids=[stop_id]),
        SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True),
    ]
    plain = plain_llm.generate(prompts, params)
    engine = _looped(small_vocab_target, kind).engine
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt, p, request_id=str(i))
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert [(finished[str(i)].token_ids, finished[str(i)].finish_reason) for i in range(4)] == [
        (o.token_ids, o.finish_reason) for o in plain
    ]
    carried = [f for f in flights if f.retired]
    if share:
        assert carried and all(f.resumed and len(f.reqs) == 4 for f in carried)
        assert any(1 in f.retired for f in carried), "the stop string's row ran on idle"
        assert all(4 * (len(f.reqs) - len(f.retired)) > len(f.reqs) for f in carried)
    else:
        assert not carried
    assert len([f for f in flights if not f.resumed]) > (1 if share else 2), "a fresh run at the batch's tail"


@pytest.mark.parametrize("kind", KINDS)
def test_abort_in_a_run_that_goes_on_over_a_finished_row(small_vocab_target, flights, kind):
    """An abort while a run carries a finished request's idle row: the others are unchanged."""
    prompts = _prompts(4, seed=19)
    lengths = (6, 60, 60, 60)
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    reference = _llm(small_vocab_target).generate(prompts, params)
    engine = _looped(small_vocab_target, kind).engine
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt, p, request_id=str(i))
    finished, aborted = {}, False
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        flight = engine._loop_flight
        if not aborted and flight is not None and flight.retired:
            aborted = engine.abort("2")
    assert aborted, "a run carried the first request's row"
    assert finished["2"].finish_reason == "abort"
    assert [finished[i].token_ids for i in "013"] == [reference[i].token_ids for i in (0, 1, 3)]


def test_carries():
    """Which requests a chain goes on over: its rows, or some of them with the rest finished and
    more than 1/CARRY_SHARE running; never a newcomer or a row whose request left unfinished."""

    class Req:  # hashed by identity, as `Request`
        finished = False

    reqs = [Req() for _ in range(5)]
    flight = LoopFlight(None, reqs[:4], [0] * 4, 1, None, resumed=False)
    assert carries(flight, reqs[:4])
    assert not carries(flight, reqs[1:4]), "the missing row's request left unfinished (retracted)"
    reqs[0].finished = reqs[1].finished = True
    assert carries(flight, reqs[2:4])
    assert not carries(flight, [reqs[2], reqs[4]]), "a newcomer"
    reqs[2].finished = True
    assert not carries(flight, reqs[3:4]), "a quarter of the rows"


@pytest.mark.parametrize("kind", KINDS)
def test_context_end(small_vocab_target, launches, kind):
    """Requests that reach max_model_len: the loop stops them (or leaves them to the synchronous
    path) where plain decoding does."""
    prompts = _prompts(2, seed=9)
    params = SamplingParams(max_new_tokens=None, temperature=0.0, ignore_eos=True)
    plain = _llm(small_vocab_target, max_model_len=48).generate(prompts, params)
    looped = _looped(small_vocab_target, kind, max_model_len=48).generate(prompts, params)
    assert [o.token_ids for o in looped] == [o.token_ids for o in plain]
    assert all(o.finish_reason == "length" for o in looped)
    assert all(len(p) + len(o.token_ids) == 48 for p, o in zip(prompts, looped, strict=True))
    assert launches


def test_adaptive_tiers(small_vocab_target, launches):
    """Adaptive speculation: each chain tier has its loop; whatever the policy picks, the tokens
    are plain greedy decoding's."""
    prompts = _prompts(3, seed=13)
    params = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    plain = _llm(small_vocab_target).generate(prompts, params)
    spec = {"method": "ngram", "num_steps": 4, "adaptive": {"tiers": ["off", 2, 4]}, "device_steps": 4}
    llm = _llm(small_vocab_target, spec)
    assert sorted(llm.engine.device_loops) == [0, 2, 4], "off is a loop too (plain decoding)"
    # shadow lookups are per plain step: an engine step off runs a run of 4
    assert llm.engine.adaptive.shadow.lookups == 2 * 4
    looped = llm.generate(prompts, params)
    assert [o.token_ids for o in looped] == [o.token_ids for o in plain]
    single = llm.generate(prompts[:1], params)[0]
    assert single.token_ids == plain[0].token_ids


@pytest.mark.parametrize("order", [[4, 1, 2], [4, 0, 1, 0, 2]])
def test_a_switch_of_chain_length_goes_on_on_the_device(small_vocab_target, monkeypatch, order):
    """The policy switches tier at every step (chains 4, 1, 2: each switch to a shorter chain
    reserves pages for the longer run still in flight; off, 0, between them: plain decoding's
    loop): each new length's run is queued behind the run in flight over the loops' shared state,
    no settle between them, and the tokens are plain greedy decoding's through requests finishing
    at their limits and stop ids."""
    prompts = _prompts(4, seed=23)
    reference = _llm(small_vocab_target).generate(
        prompts, SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    )
    stop_id = reference[3].token_ids[40]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 64, 50)] + [
        SamplingParams(max_new_tokens=64, temperature=0.0, stop_token_ids=[stop_id])
    ]
    plain = _llm(small_vocab_target).generate(prompts, params)
    spec = {
        "method": "ngram",
        "num_steps": 4,
        "adaptive": {"tiers": ["off", 1, 2, 4], "profile": False},
        "device_steps": 4,
    }
    llm = _llm(small_vocab_target, spec)
    loops = llm.engine.device_loops
    assert len({id(loop.state) for loop in loops.values()}) == 1, "one state for every chain length"
    decided = cycle_tiers(llm.engine, order)
    for graph in llm.engine.runner.graphs.graphs.values():  # as synchronous steps of other layouts leave them
        graph.attention.query_start.zero_()
    flights = check_loop_reservations(monkeypatch)
    looped = llm.generate(prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in looped] == [(o.token_ids, o.finish_reason) for o in plain]
    assert set(decided) == set(order)
    assert {f.loop.num_steps for f in flights} == set(order)
    assert switched_on_device(flights) >= 4, [(f.loop.num_steps, f.resumed) for f in flights]
    fresh = [f for f in flights if not f.resumed]
    runs = [(f.loop.num_steps, f.resumed, f.steps, len(f.reqs)) for f in flights]
    assert len(fresh) <= 2, f"a fresh run at the start, and once most rows had finished: {runs}"


@pytest.mark.parametrize(
    ("order", "priced", "expected"),
    [([2, 0], True, {True}), ([2, 0], False, {False}), ([2] * 4 + [0] * 4, False, {True, False})],
)
def test_runs_next_to_a_switch_price_their_tier_only_where_set(small_vocab_target, order, priced, expected):
    """`switch_runs_priced` off, a loop run queued behind another chain length's run, or with one
    queued behind it, prices nothing (its step's wall is not its own on a GPU): its step is kept
    among the transitions. On, as every resumed run, it is a steady step of its tier."""
    spec = {
        "method": "ngram",
        "num_steps": 2,
        "adaptive": {"tiers": ["off", 2], "profile": False, "switch_runs_priced": priced},
        "device_steps": 4,
    }
    llm = _llm(small_vocab_target, spec)
    adaptive = llm.engine.adaptive
    assert adaptive.switch_runs_priced is priced
    cycle_tiers(llm.engine, order)
    seen: list[bool] = []
    observe = adaptive.observe_loop

    def spy(batch, depth, seconds, context=1.0, settle=0.0, steady=True):
        seen.append(steady)
        observe(batch, depth, seconds, context, settle, steady)

    adaptive.observe_loop = spy
    params = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    plain = _llm(small_vocab_target).generate(_prompts(3, seed=5), params)
    looped = llm.generate(_prompts(3, seed=5), params)
    assert [o.token_ids for o in looped] == [o.token_ids for o in plain]
    assert set(seen) == expected, seen
    diagnostics = adaptive.diagnostics(3)  # every run went on over the batch's 3 rows
    assert bool(diagnostics["steady_steps"]) == (True in expected), diagnostics
    assert bool(diagnostics["transition_steps"]) == (False in expected), diagnostics


@pytest.mark.parametrize("kind", KINDS)
def test_a_loop_steps_target_is_its_wait_for_the_device_alone(small_vocab_target, monkeypatch, kind):
    """A loop step launches the next run before it reads the one in flight: the launch (and the
    host work meanwhile) is the step's, not its `target` phase, which is the wait for the device
    (a switch of chain length once looked like 16-20 ms of waiting, launch and decision included).
    On a clock that moves only while a run is launched, every loop step's `target` stays 0."""
    from types import SimpleNamespace

    from specserve.engine import stats as stats_module

    clock = [0.0]
    monkeypatch.setattr(stats_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    launch = Engine._loop_launch

    def slow_launch(self, flight):
        new = launch(self, flight)
        clock[0] += 100.0  # the host's launch: a hundred clock seconds
        return new

    monkeypatch.setattr(Engine, "_loop_launch", slow_launch)
    llm = _looped(small_vocab_target, kind)
    phases: list[dict[str, float]] = []
    llm.engine.attach_stats_sink(SimpleNamespace(record_step=lambda stats: phases.append(dict(stats.phases))))
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    llm.generate(_prompts(2, seed=3), params)
    settled = [p for p in phases if "postprocess" in p and p.get("step", 0.0) >= 100.0]
    assert settled, phases  # loop steps that launched a run and read one
    assert all(p.get("target", 0.0) == 0.0 for p in settled), settled


def test_settings():
    with pytest.raises(ValueError, match="speculative.device_steps"):
        SpeculativeConfig(method="ngram", num_steps=4, topk=2, device_steps=4).validate()
    with pytest.raises(ValueError, match="speculative.device_steps"):
        SpeculativeConfig(method="ngram", device_steps=-1).validate()
    SpeculativeConfig(method="ngram", device_steps=0, topk=2).validate()


def test_needs_graphs(small_vocab_target):
    with pytest.raises(ValueError, match="speculative.device_steps"):
        LLM(small_vocab_target, device="cpu", dtype="float32", cuda_graphs=False, speculative=LOOP)
    with pytest.raises(ValueError, match="decode_steps"):
        LLM(small_vocab_target, device="cpu", dtype="float32", cuda_graphs=False, decode_steps=4)


def test_plain_loop_settings(small_vocab_target):
    """`decode_steps`: in [0, 64], without speculation only; by default off where graphs run
    uncaptured (the CPU), so the synchronous path stays the reference there."""
    from specserve.config import EngineConfig

    for bad in (-1, 65, 1.5):
        with pytest.raises(ValueError, match="decode_steps"):
            EngineConfig(decode_steps=bad)
    with pytest.raises(ValueError, match="decode_steps"):
        EngineConfig(decode_steps=4, speculative=SpeculativeConfig(method="ngram"))
    assert not _llm(small_vocab_target).engine.device_loops
    assert not _llm(small_vocab_target, decode_steps=0).engine.device_loops
    assert _llm(small_vocab_target, decode_steps=4).engine.device_loop.num_steps == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_captured_loop_equals_plain(smollm2_gguf, mtbench_questions, launches):
    """On a GPU, SmolLM2 in fp32 (bf16 would let the verify bucket's kernels and the decode step's
    round differently and flip near-ties): the captured loop emits plain greedy decoding's tokens,
    batch 1 and 5; plain decoding's own loop (the default on CUDA) too."""
    common = dict(device="cuda", dtype="float32", max_total_tokens=1 << 15, cuda_graph_max_batch=8)
    params = SamplingParams(max_new_tokens=96, temperature=0.0)
    prompts = mtbench_questions[:5]
    plain = LLM(str(smollm2_gguf), decode_steps=0, **common)  # every step from the host
    assert not plain.engine.device_loops
    want = plain.generate(prompts, params)
    del plain
    for spec in ({"method": "ngram", "num_steps": 5, "device_steps": 8}, None):
        looped = LLM(str(smollm2_gguf), speculative=spec, **common)
        assert looped.engine.device_loop.loop_graphs, "captured per batch bucket"
        launches.clear()
        got = looped.generate(prompts, params)
        got_one = looped.generate(prompts[:1], params)[0]
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert got_one.token_ids == want[0].token_ids
        assert launches
        del looped


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_captured_sampling_loop_equals_the_host_path(smollm2_gguf, mtbench_questions, launches):
    """On a GPU, in fp32: plain decoding's loop, its sampled iterations captured per filter set as
    runs need them, draws the host path's tokens for sampling requests (temperature, top-k, top-p,
    min-p and greedy rows together), batch 5 and batch 2."""
    common = dict(device="cuda", dtype="float32", max_total_tokens=1 << 15, cuda_graph_max_batch=8)
    params = [dataclasses.replace(p, max_new_tokens=96) for p in SAMPLED]
    prompts = mtbench_questions[:5]
    host = LLM(str(smollm2_gguf), decode_steps=0, **common)
    want = host.generate(prompts, params)
    want_two = host.generate(prompts[:2], params[:2])
    del host
    looped = LLM(str(smollm2_gguf), **common)
    got = looped.generate(prompts, params)
    got_two = looped.generate(prompts[:2], params[:2])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.token_ids for o in got_two] == [o.token_ids for o in want_two]
    assert launches and looped.engine.device_loop.run_graphs, "captured as runs needed them"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_captured_logprob_loops_equal_the_host_path(smollm2_gguf, mtbench_questions, launches):
    """On a GPU, in fp32: requests asking for logprobs (greedy and sampled, top k and named ids,
    beside one asking none) in plain decoding's captured loop and an n-gram chain's, their
    iterations captured per (bucket, filters, logprob shape): the host path's tokens, and its
    logprobs within fp32 rounding."""
    common = dict(device="cuda", dtype="float32", max_total_tokens=1 << 15, cuda_graph_max_batch=8)
    params = [dataclasses.replace(p, max_new_tokens=96) for p in LOGPROBS]
    prompts = mtbench_questions[:4]
    for loop, host in (
        ({}, {"decode_steps": 0}),
        ({"speculative": {**LOOP, "device_steps": 8}}, {"speculative": {**LOOP, "device_steps": 0}}),
    ):
        reference = LLM(str(smollm2_gguf), **host, **common)
        want = reference.generate(prompts, params)
        del reference
        looped = LLM(str(smollm2_gguf), **loop, **common)
        launches.clear()
        assert_same_logprobs(looped.generate(prompts, params), want)
        assert launches and any(key[2] is not None for key in looped.engine.device_loop.run_graphs)
        del looped


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_captured_sampled_chains_equal_the_synchronous_path(smollm2_gguf, mtbench_questions, launches):
    """On a GPU, in fp32: n-gram chains of sampling requests (temperature, top-k, top-p, min-p and
    greedy rows together) in the captured loop, their iterations captured per filter set as runs
    need them: the synchronous speculative path's tokens and accepts, batch 5 and batch 2."""
    common = dict(device="cuda", dtype="float32", max_total_tokens=1 << 15, cuda_graph_max_batch=8)
    params = [dataclasses.replace(p, max_new_tokens=96) for p in SAMPLED]
    prompts = mtbench_questions[:5]
    spec = {"method": "ngram", "num_steps": 4}
    sync = LLM(str(smollm2_gguf), speculative={**spec, "device_steps": 0}, **common)
    want = sync.generate(prompts, params)
    want_two = sync.generate(prompts[:2], params[:2])
    del sync
    looped = LLM(str(smollm2_gguf), speculative={**spec, "device_steps": 8}, **common)
    got = looped.generate(prompts, params)
    got_two = looped.generate(prompts[:2], params[:2])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.token_ids for o in got_two] == [o.token_ids for o in want_two]
    assert [o.meta["spec_accept_histogram"] for o in got] == [o.meta["spec_accept_histogram"] for o in want]
    assert launches and looped.engine.device_loop.run_graphs, "captured as runs needed them"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_captured_switches_equal_plain(smollm2_gguf, mtbench_questions, monkeypatch):
    """On a GPU, the captured loops of chains 5, 0 (off), 1 and 3 in turn over their shared state, switched at
    every step on the device: plain greedy decoding's tokens, batch 5."""
    common = dict(device="cuda", dtype="float32", max_total_tokens=1 << 15, cuda_graph_max_batch=8)
    params = SamplingParams(max_new_tokens=96, temperature=0.0)
    spec = {"method": "ngram", "num_steps": 5, "adaptive": {"tiers": ["off", 1, 3, 5]}, "device_steps": 4}
    gpu_switches_equal_plain(
        smollm2_gguf, mtbench_questions[:5], params, spec, [5, 0, 1, 3], monkeypatch, **common
    )


def test_loop_verifies_count_short_drafts_as_misses():
    """A loop verify feeds the estimates as a synchronous one does: a lookup shorter than the tier
    is rejected just past its end, so the deep positions are not taken for certain."""
    from types import SimpleNamespace

    from specserve.engine.adaptive_control import AdaptiveSpeculation

    spec = SpeculativeConfig.from_value({"method": "ngram", "num_steps": 8, "adaptive": {"profile": False}})
    control = AdaptiveSpeculation(spec)
    req = SimpleNamespace(request_id="r")
    for _ in range(40):  # every draft came out 2 long and was accepted whole
        control.observe_chain(req, 8, 2, batch=1)
    rates = control.acceptance.rates("r", 1)
    assert rates[0] > 0.9 and rates[1] > 0.9 and rates[2] < 0.1
    assert control.acceptance.expected_tokens("r", 1, 8) < 3.2
