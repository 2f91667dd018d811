"""Adaptive speculation inside the engine: the tier it settles on as acceptance and batch size change
(a scripted drafter whose drafts are right with a set probability per position, fixed step costs),
losslessness while tiers switch every step (chains, trees, off; n-gram, standalone and heads, whose
drafts after an off stretch must equal a from-scratch computation), sampling (χ²), metrics, start-up
profiling, CUDA-graph buckets per tier, and the settings at every edge (config, serve config, CLI).
"""

from __future__ import annotations

import argparse
import itertools
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from head_reference import reference_step_logits

from specserve import LLM, SamplingParams
from specserve.cli_spec_args import add_speculative_arguments, parse_spec, spec_name, speculative_from_args
from specserve.config import AdaptiveConfig, EngineConfig, SpeculativeConfig
from specserve.engine.adaptive_control import AdaptiveSpeculation
from specserve.engine.cost_profile import profile_batches
from specserve.engine.engine import graph_buckets
from specserve.engine.sampler import SamplingBatch, SamplingRow, filtered_probs
from specserve.metrics import EngineMetrics
from specserve.model.head_checkpoint import random_head, save_head
from specserve.model.loader import load_model
from specserve.model.tokenizer import load_tokenizer
from specserve.spec.acceptance import expected_tokens
from specserve.spec.adaptive import OFF, Decision, Tier
from specserve.spec.drafter import Drafter
from specserve.spec.step_costs import DECODE, DRAFT, VERIFY

from engine_utils import assert_follows, last_logits, motif_prompts

VOCAB = 96
MS = 1e-3
LONG = 300  # tokens each scripted request generates
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def target(small_vocab_target):
    return small_vocab_target


@pytest.fixture(scope="module")
def plain(target):
    return LLM(target, device="cpu", dtype="float32", max_total_tokens=8192)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    shapes = {"eagle": {}, "mtp": {"num_modules": 3}}
    return {m: save_head(root / m, *random_head(m, target.arch, seed=5, **kw)) for m, kw in shapes.items()}


# ---- a scripted drafter: right with probability rates[j] at draft position j ----------------------


class ScriptedDrafter(Drafter):
    """Proposes the target's own greedy continuation (`answers`, per request id), each draft right
    with probability `rate` (independently per position, so the conditional acceptance of every
    position is exactly `rate`), else a token greedy verify rejects."""

    def __init__(self, answers: dict[str, list[int]], seed: int = 0) -> None:
        self.answers, self.rate, self.rng = answers, 0.9, random.Random(seed)
        self.rates: dict[str, float] = {}  # a request's own rate (else `rate`)

    def draft(self, reqs, budgets) -> None:
        for req, budget in zip(reqs, budgets, strict=True):
            answer, n = self.answers[req.request_id], req.num_output
            rate = self.rates.get(req.request_id, self.rate)
            right = [answer[n + j] if n + j < len(answer) else 0 for j in range(budget)]
            req.draft = [t if self.rng.random() < rate else (t + 1) % VOCAB for t in right]


def _gpu_like_costs(costs, batches=range(1, 9), lens=range(1, 10)) -> None:
    """A launch-bound target at small batch (1 ms whatever the tokens), compute-bound at large; every
    shape a run can meet is in the table, and cost_alpha 0 keeps it: decisions are deterministic.
    (Its callers turn off the correction by measured steps: this CPU's step times are not the table's.)"""
    costs.profile(VERIFY, [(b, q) for b in batches for q in lens], lambda b, q: max(1.0, 0.03 * b * q) * MS)
    costs.profile(DRAFT, [(b, 1) for b in batches], lambda b, w: 0.15 * MS)


def _best(tiers, rate: float, batch: int) -> Tier:
    def goodput(t: Tier) -> float:
        seconds = max(1.0, 0.03 * batch * t.query_len) + 0.15 * t.num_steps
        return batch * expected_tokens([rate] * 8, t.num_steps) / seconds

    return max(tiers, key=goodput)


def test_engine_settles_on_the_best_tier_as_acceptance_and_batch_change(target, plain):
    spec = {
        "method": "ngram",
        "num_steps": 8,
        "adaptive": {"profile": False, "cost_alpha": 0.0, "calibration_fade": None, "probe_every": 8},
    }
    llm = LLM(
        target, device="cpu", dtype="float32", max_total_tokens=8192, speculative=spec, max_running_requests=8
    )
    engine, adaptive = llm.engine, llm.engine.adaptive
    _gpu_like_costs(adaptive.costs)
    prompts = motif_prompts(8, VOCAB, seed=3, max_noise=12)
    long = SamplingParams(max_new_tokens=LONG, temperature=0.0, ignore_eos=True)
    answers = [o.token_ids for o in plain.generate(prompts, long)]
    drafter = engine.drafter = ScriptedDrafter({})
    engine.adaptive.shadow = None  # the scripted drafter sets acceptance; n-gram shadows would not
    phase = itertools.count()

    def run(rate: float, batch: int, waves: int = 1) -> list[tuple[int, int, Tier]]:
        """`waves` x `batch` requests at once (8 run, the rest wait); (decoding requests, waiting
        requests, tier) of every step."""
        drafter.rate, seen, ids = rate, [], []
        for i in range(batch * waves):
            rid = f"p{next(phase)}"
            drafter.answers[rid] = answers[i % batch]
            ids.append(engine.add_request(prompts[i % batch], long, rid))
        while engine.has_unfinished():
            decoding = sum(r.decoding for r in engine.scheduler.running)
            waiting = len(engine.scheduler.waiting)
            outs = engine.step()
            seen.append((decoding, waiting, adaptive.policy.current))
            for out in outs:
                if out.finished:
                    assert out.token_ids == answers[ids.index(out.request_id) % batch]
        return seen

    tiers = adaptive.tiers
    assert tiers == (OFF, Tier.chain(1), Tier.chain(2), Tier.chain(4), Tier.chain(8))
    assert run(0.9, 1)[-1][2] == _best(tiers, 0.9, 1) == Tier.chain(8)  # predictable text
    assert run(0.05, 1)[-1][2] == _best(tiers, 0.05, 1) == OFF  # text nobody predicts: plain decoding
    assert run(0.9, 1)[-1][2] == Tier.chain(8)  # probes while off bring speculation back
    # The same text at batch 8, while requests wait (a finished one makes room: goodput counts):
    # shorter drafts. Then nobody waits, and the tiers are judged by how soon the batch finishes.
    seen = run(0.9, 8, waves=2)
    queued = [tier for decoding, waiting, tier in seen if decoding == 8 and waiting]
    assert queued[-1] == _best(tiers, 0.9, 8) == Tier.chain(4)
    assert adaptive.policy.diagnostics()["objective"] == "drain"
    assert adaptive.policy.switches >= 3


def test_a_mixed_batch_drafts_per_request_depths_losslessly(target, plain):
    """Eager passes (the CPU: no CUDA graph) cost by their tokens and requests wait: the policy gives
    the requests whose drafts are right the full depth and those whose drafts always fail none (a
    decode row in the verify pass), predicted above every tier run the static way; the output is
    still the target's own, and the KV pages all come back (the fixture)."""
    spec = {
        "method": "ngram",
        "num_steps": 8,
        "adaptive": {"profile": False, "cost_alpha": 0.0, "calibration_fade": None},
    }
    llm = LLM(
        target, device="cpu", dtype="float32", max_total_tokens=8192, speculative=spec, max_running_requests=4
    )
    engine, adaptive = llm.engine, llm.engine.adaptive
    assert adaptive.shapes is not None and adaptive.shapes.max_batch == 0  # eager
    adaptive.costs.profile(  # by tokens: 0.5 ms plus 20 µs a token; a lookup 20 µs a request
        VERIFY, [(b, q) for b in range(1, 9) for q in (1, 2, 3, 5, 9)], lambda b, q: (0.5 + 0.02 * b * q) * MS
    )
    adaptive.costs.profile(DRAFT, [(b, 1) for b in range(1, 9)], lambda b, w: 0.02 * b * MS)
    prompts = motif_prompts(8, VOCAB, seed=4, max_noise=12)
    params = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
    answers = [o.token_ids for o in plain.generate(prompts, params)]
    drafter = engine.drafter = ScriptedDrafter({})
    engine.adaptive.shadow = None  # the scripted drafter sets acceptance; n-gram shadows would not
    ids = []
    for i, prompt in enumerate(prompts):  # good and poor in turn: each batch of 4 mixes them
        rid = f"{'good' if i % 2 == 0 else 'poor'}{i}"
        drafter.answers[rid] = answers[i]
        drafter.rates[rid] = 0.97 if i % 2 == 0 else 0.0
        ids.append(engine.add_request(prompt, params, rid))
    mixed = []  # decisions over good and poor requests while others waited
    outs = {}
    while engine.has_unfinished():
        waiting = len(engine.scheduler.waiting)
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
        steps = adaptive._steps
        if waiting and {r[:4] for r in steps} == {"good", "poor"} and not adaptive.tier.off:
            mixed.append(
                (dict(steps), adaptive.tier, adaptive.predicted_goodput, _static_goodputs(adaptive, steps))
            )
    assert [outs[i].token_ids for i in ids] == answers
    split = [decision for decision in mixed if len(set(decision[0].values())) > 1]
    assert split, mixed
    steps, tier, predicted, static = split[-1]
    assert tier == Tier.chain(8)
    assert all(n == 8 for r, n in steps.items() if r.startswith("good"))
    assert all(n == 0 for r, n in steps.items() if r.startswith("poor"))
    # the static way (every request at a tier's depth, or none) was predicted below it
    assert all(predicted > g for g in static.values()), (predicted, static)


def _static_goodputs(adaptive, steps: dict[str, int]) -> dict[str, float]:
    """What the policy predicted, when it split the batch, of every tier run the static way."""
    policy, rids = adaptive.policy, list(steps)
    return {
        t.name: sum(adaptive.acceptance.expected_tokens(r, 1, t.num_steps) for r in rids)
        / policy.step_seconds(t, len(rids))
        for t in policy.tiers
    }


# ---- losslessness while the tier changes every step -------------------------------------------------


def _cycle_tiers(engine, seed: int = 0) -> list[Tier]:
    """Replace the policy's choice with a seeded random walk over its tiers (long stretches off too),
    each request given a random number of draft steps (none too: a decode row in a verify step):
    every switch the engine can meet, often. Every tier comes once before the walk turns random, so
    each runs whatever the seed (and however many tiers there are)."""
    adaptive, rng, chosen = engine.adaptive, random.Random(seed), []
    first = list(adaptive.tiers)

    def decide(request_ids, remaining=None, verifies=1):
        tier = first.pop(0) if first else OFF if rng.random() < 0.4 else rng.choice(adaptive.tiers)
        chosen.append(tier)
        steps = {r: 0 if tier.off else rng.randint(0, tier.num_steps) for r in request_ids}
        return Decision(tier, steps, 1.0, False)

    adaptive.policy.decide = decide
    return chosen


def _adaptive_llm(target, method: str, draft_model=None, **kwargs) -> LLM:
    spec = {
        "method": method,
        "num_steps": 4,
        "topk": 4,
        "num_draft_tokens": 8,
        "adaptive": {"profile": False},
    }
    if draft_model is not None:
        spec["draft_model"] = str(draft_model)
    kwargs.setdefault("max_total_tokens", 4096)
    return LLM(target, device="cpu", dtype="float32", speculative=spec, **kwargs)


def test_only_steady_steps_reach_the_cost_tables(target):
    """The real engine's phases, a scripted schedule: after the prompts' prefill, stretches of plain
    steps and of a 2-chain over the same batch. Each stretch's first step is a transition (a plain
    step's wall is the wait for the step before; a chain step after plain ones settles the one in
    flight), so the tables get one measurement fewer than the stretch's steps (no wall-clock figure
    is asserted)."""
    llm = _adaptive_llm(target, "ngram")
    engine, adaptive = llm.engine, llm.engine.adaptive
    chain = Tier.chain(2)
    schedule = [OFF] * 5 + [chain] * 5 + [OFF] * 4

    def decide(request_ids, remaining=None, verifies=1):
        tier = schedule.pop(0) if schedule else OFF
        return Decision(tier, dict.fromkeys(request_ids, tier.num_steps), 1.0, False)

    adaptive.policy.decide = decide
    for i, prompt in enumerate(motif_prompts(3, VOCAB, seed=4)):
        engine.add_request(
            prompt, SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True), f"r{i}"
        )
    engine.step()  # the prefill (the standing tier, the deepest, runs it synchronously)
    for _ in range(14):
        engine.step()
    assert engine._overlap_off  # n-gram: plain steps overlapped
    assert adaptive.costs.samples(DECODE, 3, 1) == 4 + 3  # each plain stretch less its first step
    assert adaptive.costs.samples(VERIFY, 3, chain.query_len) == 4
    assert adaptive.costs.samples(DRAFT, 3, 1) == 4
    d = adaptive.diagnostics(3)
    assert d["steady_steps"] == {"off": 7, "2": 4} and d["transition_steps"] == {"off": 2, "2": 1}
    for _ in range(300):
        if not engine.has_unfinished():
            break
        engine.step()


def test_the_policy_hears_which_steps_ended_a_request(target):
    """A step that finished a request corrects no tier (its tokens stop at the request's end): the
    engine says so of exactly the steps whose outputs finished one."""
    llm = _adaptive_llm(target, "ngram")
    engine, adaptive = llm.engine, llm.engine.adaptive
    chain = Tier.chain(2)
    adaptive.policy.decide = lambda ids, remaining=None, verifies=1: Decision(
        chain, dict.fromkeys(ids, 2), 1.0, False
    )
    heard: list[bool] = []
    observe = adaptive.observe_step

    def spy(items, stats, ended=False):
        heard.append(ended)
        observe(items, stats, ended)

    adaptive.observe_step = spy
    for i, (prompt, tokens) in enumerate(zip(motif_prompts(2, VOCAB, seed=5), (6, 14), strict=True)):
        engine.add_request(
            prompt, SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True), f"r{i}"
        )
    finished: list[bool] = []
    while engine.has_unfinished():
        outputs = engine.step()
        finished.append(any(out.finished for out in outputs))
    assert heard == finished and heard.count(True) >= 1 and heard.count(False) >= 2


@pytest.mark.parametrize(("method", "page_size"), [("ngram", 1), ("standalone", 4), ("eagle", 1), ("mtp", 4)])
def test_greedy_is_lossless_across_switches(target, plain, heads, method, page_size):
    draft = {"standalone": target.location.path, **heads}.get(method)
    llm = _adaptive_llm(target, method, draft, page_size=page_size, max_batched_tokens=40)
    engine = llm.engine
    chosen = _cycle_tiers(engine)
    launches = []  # plain steps overlapped (n-gram and standalone: they need no target features)
    original = engine._launch
    engine._launch = lambda *args: launches.append(1) or original(*args)
    prompts = motif_prompts(5, VOCAB, seed=11)
    outs = llm.generate(prompts, GREEDY)
    assert bool(launches) == (method in ("ngram", "standalone"))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, GREEDY)]
    assert {t.topk for t in chosen if not t.off} == {1, 4} and OFF in chosen
    if method in ("ngram", "standalone"):  # (random heads' drafts are rarely right)
        assert sum(o.meta["spec_accepted_tokens"] for o in outs) > 0


def test_hybrid_model_is_lossless_across_switches(smollm2_gguf, tmp_path):
    """A hybrid (Mamba-2) target: recurrent states committed per verify, plain steps overlapped, trees
    and chains and off in turn; no start-up profile (costs are learnt from its steps)."""
    from tiny_models import save_tiny_bamba

    folder = save_tiny_bamba(tmp_path / "bamba", load_tokenizer(smollm2_gguf), VOCAB)
    hybrid = load_model(str(folder), torch.device("cpu"), torch.float32)
    plain = LLM(hybrid, device="cpu", dtype="float32", max_total_tokens=4096)
    spec = {"method": "ngram", "num_steps": 4, "topk": 4, "num_draft_tokens": 8, "adaptive": True}
    llm = LLM(hybrid, device="cpu", dtype="float32", max_total_tokens=4096, speculative=spec)
    assert not llm.engine.adaptive.costs.measured()
    chosen = _cycle_tiers(llm.engine, seed=5)
    prompts = motif_prompts(4, VOCAB, seed=11)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, GREEDY)]
    assert OFF in chosen and {t.topk for t in chosen if not t.off} == {1, 4}


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_head_drafts_after_plain_steps_equal_a_from_scratch_computation(target, heads, method):
    """A head skips its extend on steps without drafting (the features wait in a backlog, or are
    extended over in one go past MAX_BACKLOG positions) and catches up before it drafts again: every
    chain it drafts is still the one a from-scratch computation over the verified tokens gives."""
    llm = _adaptive_llm(target, method, heads[method], page_size=4)
    engine = llm.engine
    chosen = _cycle_tiers(engine, seed=3)
    drafter, records = engine.drafter, []
    original = drafter.draft

    def recording(reqs, budgets):
        original(reqs, budgets)
        assert all(r.draft for r in reqs), "a request drafts nothing: the head did not catch up"
        records.extend((list(r.token_ids), list(r.draft)) for r in reqs)

    drafter.draft = recording
    prompts = motif_prompts(3, VOCAB, seed=5, max_noise=20)
    params = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    steps = 0
    while engine.has_unfinished():
        if steps == 20:  # one long stretch off: the backlog passes MAX_BACKLOG and is extended early
            engine.adaptive.policy.decide = lambda *args, **kwargs: Decision(OFF, {}, 1.0, False)
        if steps == 60:
            chosen = _cycle_tiers(engine, seed=4)
        engine.step()
        steps += 1
    assert all(not engine.is_active(i) for i in ids)
    assert OFF in chosen and len(records) >= 10
    for verified, drafts in records:
        ref = reference_step_logits(target.model, drafter.head, verified, drafts)
        assert [int(logits.argmax()) for logits in ref] == drafts


def test_a_batch_that_starts_while_off_prefills_under_a_speculative_tier(target, plain, heads):
    """Left off by the batch before (its tail), the policy decides nothing on a step of prefills
    alone, and that step runs under the last speculative tier it chose: synchronous, the head
    extending over the prompts' features at once (off, the prefill was a plain step the head
    skipped and the first speculative step caught it up synchronously). Then as decided, lossless."""
    llm = _adaptive_llm(target, "eagle", heads["eagle"], page_size=4)
    engine, control = llm.engine, llm.engine.adaptive
    prompts = motif_prompts(3, VOCAB, seed=21)
    llm.generate(prompts[:1], GREEDY)
    control.tier = control.policy.current = OFF  # as a batch's tail may leave it
    calls = []
    for name in ("after_target", "skip_target"):
        original = getattr(engine.drafter, name)
        setattr(engine.drafter, name, lambda *a, _n=name, _o=original: calls.append(_n) or _o(*a))
    launched = []
    original_launch = engine._launch
    engine._launch = lambda *args: launched.append(1) or original_launch(*args)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    finished = {o.request_id: o.token_ids for o in engine.step() if o.finished}  # the prefills
    assert calls == ["after_target"] and not launched
    assert control.tier.off  # the standing tier is the policy's, untouched
    while engine.has_unfinished():
        finished.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    assert [finished[i] for i in ids] == [o.token_ids for o in plain.generate(prompts, GREEDY)]


def test_a_step_of_prefills_alone_runs_the_last_speculative_tier_decided():
    spec = SpeculativeConfig.from_value({"method": "ngram", "num_steps": 4, "adaptive": {"profile": False}})
    control = AdaptiveSpeculation(spec)
    assert control.decide([]).num_steps == 4  # none decided yet: the largest tier
    control.policy.decide = lambda *args, **kwargs: Decision(Tier.chain(2), {"r": 2}, 1.0, False)
    req = SimpleNamespace(
        request_id="r", params=SimpleNamespace(max_new_tokens=9), num_output=0, prompt_len=3
    )
    assert control.decide([req]).num_steps == 2
    control.policy.decide = lambda *args, **kwargs: Decision(OFF, {"r": 0}, 1.0, False)
    assert control.decide([req]).num_steps == 0 and control.decide([]).num_steps == 2


def test_sampling_follows_the_target_across_switches(target):
    """χ² over (first, second, third) output tokens at temperature 1, top-k 3: requests arrive every
    step, so each step verifies some second tokens under a tier chosen at random, with random
    per-request budgets. The drafter is the target itself: its chains are always accepted, its trees
    are the target's top candidates, tested one after another (recursive rejection, residuals)."""
    llm = _adaptive_llm(
        target, "standalone", target.location.path, max_total_tokens=65536, max_running_requests=256
    )
    engine = llm.engine
    chosen = _cycle_tiers(engine, seed=7)
    prompt = motif_prompts(1, VOCAB, seed=2)[0]
    outs = {}
    for s in range(800):
        params = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=3, seed=s, ignore_eos=True)
        engine.add_request(prompt, params, f"r{s}")
        if s % 40 == 39:
            outs.update((o.request_id, o) for o in engine.step() if o.finished)
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    verified = [o.meta.get("spec_accept_histogram", []) for o in outs.values()]
    assert sum(h[0] for h in verified if h) > 50 and sum(h[1] for h in verified if len(h) > 1) > 50
    assert {t.topk for t in chosen if not t.off} == {1, 4}
    samples = [tuple(o.token_ids) for o in outs.values()]

    def probs(prefixes):
        logits = last_logits(llm.engine, [prompt + list(p) for p in prefixes])
        rows = SamplingBatch.build([SamplingRow(1.0, 3, 1.0, 0.0, 0, 0)] * len(prefixes), "cpu")
        return filtered_probs(logits, rows)

    first = probs([()])[0]
    support = first.nonzero().flatten().tolist()
    second = dict(zip(support, probs([(a,) for a in support]), strict=True))
    pairs = [(a, b) for a in support for b in second[a].nonzero().flatten().tolist()]
    third = dict(zip(pairs, probs(pairs), strict=True))
    cells = {
        (a, b, c): i
        for i, (a, b, c) in enumerate(
            (a, b, c) for a, b in pairs for c in third[(a, b)].nonzero().flatten().tolist()
        )
    }
    expected = np.array([float(first[a] * second[a][b] * third[(a, b)][c]) for a, b, c in cells])
    assert all(s in cells for s in samples), "a token outside the filtered support was emitted"
    assert_follows([cells[s] for s in samples], expected)


# ---- metrics, profiling, CUDA-graph buckets ------------------------------------------------------


def test_metrics_show_the_tier_switches_and_goodput(target, plain):
    spec = {
        "method": "ngram",
        "num_steps": 4,
        "adaptive": {"profile": False, "cost_alpha": 0.0, "calibration_fade": None},
    }
    llm = LLM(target, device="cpu", dtype="float32", max_total_tokens=4096, speculative=spec)
    engine = llm.engine
    _gpu_like_costs(engine.adaptive.costs)
    metrics = EngineMetrics("m")
    engine.attach_stats_sink(metrics)
    prompts = motif_prompts(2, VOCAB, seed=3, max_noise=12)
    long = SamplingParams(max_new_tokens=120, temperature=0.0, ignore_eos=True)
    answers = [o.token_ids for o in plain.generate(prompts, long)]
    drafter = engine.drafter = ScriptedDrafter({"a": answers[0], "b": answers[1]})
    engine.adaptive.shadow = None  # the scripted drafter sets acceptance; n-gram shadows would not
    settings, changes = [engine.speculative_settings()], 0
    for rate, rid in ((0.95, "a"), (0.0, "b")):
        drafter.rate = rate
        engine.add_request(prompts["ab".index(rid)], long, rid)
        while engine.has_unfinished():
            engine.step()
            if engine.speculative_settings() != settings[-1]:
                settings.append(engine.speculative_settings())
                changes += 1
    assert settings[-1].num_steps == 0 and any(s.num_steps == 4 for s in settings)  # on, then off
    assert metrics.sample("specserve_spec_adapt_switches_total") == changes >= 1
    for name, value in zip(("num_steps", "topk", "num_draft_tokens"), settings[-1], strict=True):
        assert metrics.sample(f"specserve_spec_{name}") == value
    assert metrics.sample("specserve_spec_ema_accept_length") > 1
    assert metrics.sample("specserve_spec_predicted_goodput_tokens_per_second") == pytest.approx(
        engine.adaptive.predicted_goodput
    )
    assert metrics.sample("specserve_spec_measured_goodput_tokens_per_second") > 0
    assert "specserve_spec_predicted_goodput_tokens_per_second" in metrics.exposition()


def test_start_up_profile_times_every_tier_on_the_cpu(target, heads):
    spec = {"method": "eagle", "draft_model": str(heads["eagle"]), "num_steps": 4, "topk": 2}
    llm = LLM(
        target, device="cpu", dtype="float32", max_total_tokens=2048, speculative={**spec, "adaptive": True}
    )
    engine, adaptive = llm.engine, llm.engine.adaptive
    batches = profile_batches(engine)
    assert batches == [1, 8]
    measured = adaptive.costs.measured()
    lens = {t.query_len for t in adaptive.tiers}
    assert lens == {1, 2, 3, 4, 5, 9} and {t.topk for t in adaptive.tiers} == {1, 2}  # 9: the 4x2x8 tree
    assert {(VERIFY, b, q) for b in batches for q in lens} | {
        (DRAFT, b, k) for b in batches for k in (1, 2)
    } == set(measured)
    assert all(seconds > 0 for seconds in measured.values())
    engine.check_kv_accounting()  # profiling took no page
    prompts = motif_prompts(3, VOCAB, seed=1)
    plain_outs = LLM(target, device="cpu", dtype="float32", max_total_tokens=2048).generate(prompts, GREEDY)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [o.token_ids for o in plain_outs]


def test_cuda_graph_buckets_exist_for_every_tier():
    def buckets(spec):
        return graph_buckets(EngineConfig(device="cpu", speculative=SpeculativeConfig.from_value(spec)))

    assert buckets({"method": "ngram", "num_steps": 8}).query_lens == (1, 9)
    assert buckets({"method": "ngram", "num_steps": 8, "adaptive": True}).query_lens == (1, 2, 3, 5, 9)
    tree = buckets({"method": "ngram", "num_steps": 4, "topk": 4, "num_draft_tokens": 16, "adaptive": True})
    assert tree.query_lens == (1, 2, 3, 5, 17) and tree.masked_lens == (17,)
    custom = {"method": "ngram", "num_steps": 6, "adaptive": {"tiers": ["off", 3, "6"]}}
    assert buckets(custom).query_lens == (1, 4, 7)


# ---- settings: Python API, serve config, CLI -----------------------------------------------------


def test_adaptive_settings_from_every_edge(target):
    assert SpeculativeConfig.from_value({"adaptive": True}) == SpeculativeConfig(adaptive=AdaptiveConfig())
    config = SpeculativeConfig.from_value(
        {
            "method": "ngram",
            "num_steps": 6,
            "topk": 2,
            "adaptive": {"tiers": ["off", 2, "6x2x8", [6, 1, 6]], "patience": 1},
        }
    )
    assert (
        config.adaptive.tiers == ((0, 1, 0), (2, 1, 2), (6, 2, 8), (6, 1, 6))
        and config.adaptive.patience == 1
    )
    assert SpeculativeConfig.from_value({"method": "ngram", "adaptive": False}).adaptive is None
    # {"method": "default", ...}: the model's default drafter (n-gram for a path), adapted
    default = SpeculativeConfig.from_value({"method": "default", "adaptive": True}, str(target.location.path))
    assert default.method == "ngram" and default.adaptive == AdaptiveConfig()
    llm = LLM(
        target,
        device="cpu",
        dtype="float32",
        max_total_tokens=1024,
        speculative={"adaptive": {"profile": False}},
    )
    assert llm.engine.adaptive is not None and llm.engine.adaptive.tiers[0] == OFF

    from specserve.serve.config import ServeConfig

    served = ServeConfig(
        device="cpu", speculative={"method": "ngram", "num_steps": 8, "adaptive": {"hysteresis": 0.1}}
    )
    assert served.engine_config().speculative.adaptive == AdaptiveConfig(hysteresis=0.1)

    parser = argparse.ArgumentParser()
    add_speculative_arguments(parser)
    assert speculative_from_args(parser.parse_args(["--speculative", "ngram", "--adaptive"])) == {
        "method": "ngram",
        "num_steps": 4,
        "adaptive": True,
    }
    assert speculative_from_args(parser.parse_args(["--adaptive"]))["adaptive"] is True  # the default drafter
    assert speculative_from_args(parser.parse_args([])) is None
    assert parse_spec("ngram:adaptive") == {"method": "ngram", "num_steps": 8, "adaptive": True}
    tree = parse_spec("ngram:adaptive-6x4x16")
    assert tree == {"method": "ngram", "num_steps": 6, "topk": 4, "num_draft_tokens": 16, "adaptive": True}
    assert spec_name(tree) == "specserve-ngram-6x4x16-adaptive"
    assert spec_name(parse_spec("ngram:6x4x16")) == "specserve-ngram-6x4x16"


@pytest.mark.parametrize(
    ("method", "given", "used"),
    [("ngram", None, 0.05), ("eagle3", None, 0.15), ("standalone", None, 0.15), ("eagle3", 0.02, 0.02)],
)
def test_hysteresis_defaults_by_drafter(method, given, used):
    """Left out (null), the policy's hysteresis is the drafter's: 0.05 for n-gram's copying
    stretches, 0.15 for a model drafter's noisy, smoothly drifting estimates; a given one stands."""
    from specserve.engine.adaptive_control import AdaptiveSpeculation
    from specserve.serve.config import ServeConfig

    adaptive = {"profile": False} if given is None else {"profile": False, "hysteresis": given}
    spec = SpeculativeConfig.from_value({"method": method, "num_steps": 4, "adaptive": adaptive})
    assert AdaptiveSpeculation(spec).policy.hysteresis == used
    served = ServeConfig(device="cpu", speculative={"method": "ngram", "num_steps": 4, "adaptive": adaptive})
    assert served.speculative["adaptive"].get("hysteresis") == given


@pytest.mark.parametrize(
    ("adaptive", "field"),
    [
        ({"hysteresis": -1}, "hysteresis"),
        ({"hysteresis": "some"}, "hysteresis"),
        ({"patience": 0}, "patience"),
        ({"probe_every": 1.5}, "probe_every"),
        ({"min_reach": 1}, "min_reach"),
        ({"prior": 1.0}, "prior"),
        ({"request_alpha": 1}, "request_alpha"),  # would fade a request's counts to nothing: no crash
        ({"pooled_alpha": 1.0}, "pooled_alpha"),
        ({"cost_alpha": "fast"}, "cost_alpha"),
        ({"calibration_fade": 1.0}, "calibration_fade"),
        ({"calibration_fade": "slow"}, "calibration_fade"),
        ({"drain_strength": 0}, "drain_strength"),
        ({"drain_strength": "strong"}, "drain_strength"),
        ({"drain_thinning": "sometimes"}, "drain_thinning"),
        ({"switch_runs_priced": "maybe"}, "switch_runs_priced"),
        ({"tiers": []}, "tiers"),
        ({"tiers": ["9"]}, "tiers"),  # past the configured num_steps
        ({"tiers": ["2x2x2"]}, "tiers"),  # a tree while topk is 1
        ({"tiers": ["4x1x3"]}, "tiers"),  # a chain verifies num_steps tokens
        ({"tiers": ["many"]}, "tiers"),
        ({"bogus": 1}, "adaptive"),  # unknown settings ['bogus']
        ("yes", "adaptive"),
    ],
)
def test_bad_adaptive_settings_name_the_field(adaptive, field):
    from pydantic import ValidationError

    from specserve.serve.config import ServeConfig

    spec = {"method": "ngram", "num_steps": 4, "adaptive": adaptive}
    with pytest.raises(
        ValueError, match=rf"speculative\.adaptive{'' if field == 'adaptive' else '.' + field}: "
    ):
        EngineConfig(speculative=SpeculativeConfig.from_value(spec))
    with pytest.raises(ValidationError, match="speculative.adaptive"):
        ServeConfig(device="cpu", speculative=spec)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_spec("ngram:adaptive-x")


def test_the_drains_settings_reach_the_policy_from_a_spec_string_and_the_serve_config():
    """`drain_thinning` and `drain_strength` as a bench `--spec` gives them and as `serve deploy`'s
    config does: both reach the policy; left out, neither is on."""
    from specserve.cli_spec_args import parse_spec
    from specserve.engine.adaptive_control import AdaptiveSpeculation
    from specserve.serve.config import ServeConfig

    spec = parse_spec("ngram:adaptive-4,drain_thinning=true,drain_strength=20")
    spec["adaptive"]["profile"] = False
    policy = AdaptiveSpeculation(SpeculativeConfig.from_value(spec)).policy
    assert policy.drain_thinning is True and policy.drain_strength == 20
    served = ServeConfig(device="cpu", speculative=spec)
    assert served.speculative["adaptive"]["drain_thinning"] is True
    plain = parse_spec("ngram:adaptive-4")
    plain["adaptive"] = {"profile": False}
    policy = AdaptiveSpeculation(SpeculativeConfig.from_value(plain)).policy
    assert policy.drain_thinning is False and policy.drain_strength is None


def test_switch_runs_priced_reaches_the_control_from_a_spec_string_and_the_serve_config():
    """Opt-in (`false`) as a bench `--spec` gives it and as `serve deploy`'s config does; left out, on."""
    from specserve.cli_spec_args import parse_spec
    from specserve.engine.adaptive_control import AdaptiveSpeculation
    from specserve.serve.config import ServeConfig

    spec = parse_spec("ngram:adaptive-4,switch_runs_priced=false")
    spec["adaptive"]["profile"] = False
    assert AdaptiveSpeculation(SpeculativeConfig.from_value(spec)).switch_runs_priced is False
    assert ServeConfig(device="cpu", speculative=spec).speculative["adaptive"]["switch_runs_priced"] is False
    plain = {"method": "ngram", "num_steps": 4, "adaptive": {"profile": False}}
    assert AdaptiveSpeculation(SpeculativeConfig.from_value(plain)).switch_runs_priced is True
