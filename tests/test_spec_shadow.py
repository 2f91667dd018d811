"""Shadow drafts: n-gram lookups scored against the tokens plain steps then produce, as a verify of
them would have been (accepted leading tokens of the depth drafted), with pending (overlapped)
tokens waited for, a bounded number of lookups a step, and, in the engine, the policy turning
speculation on over looping text with no probe at all, losslessly."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from specserve import LLM, SamplingParams
from specserve.engine.request import ListMirror
from specserve.spec.adaptive import OFF
from specserve.spec.ngram import NgramDrafter
from specserve.spec.shadow import ShadowDrafts
from specserve.spec.step_costs import DECODE, DRAFT, VERIFY

FUTURE = -1


@dataclass
class _Req:
    request_id: str
    token_ids: list[int]
    num_pending: int = 0
    token_mirror: ListMirror = field(default_factory=ListMirror)


def _shadows(depth: int = 4, lookups: int = 8) -> tuple[ShadowDrafts, list[tuple]]:
    seen: list[tuple] = []
    drafter = NgramDrafter(1, 4)
    return ShadowDrafts(drafter.lookup, depth, lookups, lambda *a: seen.append(a)), seen


def _grow(req: _Req, *tokens: int) -> None:
    req.token_ids.extend(tokens)


def test_a_loop_is_scored_as_its_whole_draft_accepted():
    shadows, seen = _shadows()
    req = _Req("a", [9, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1])
    shadows.start([req])  # the lookup drafts 2 3 4 5
    for token in (2, 3, 4):
        _grow(req, token)
        shadows.score([req])
        assert not seen
    _grow(req, 5)
    shadows.score([req])
    assert seen == [("a", 4, 4, 1)]


def test_a_miss_ends_the_shadow_with_what_matched_before_it():
    shadows, seen = _shadows()
    req = _Req("a", [9, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1])
    shadows.start([req])
    _grow(req, 2, 7)  # 2 as drafted, then 7 where 3 was
    shadows.score([req, _Req("b", [5, 6])])
    assert seen == [("a", 4, 1, 2)]


def test_no_match_is_position_one_rejected_and_pending_tokens_are_waited_for():
    shadows, seen = _shadows()
    fresh = _Req("a", [4, 5, 6, 7])  # nothing repeats: no draft
    shadows.start([fresh])
    shadows.score([fresh])
    assert seen == [("a", 4, 0, 1)]
    looped = _Req("b", [9, 1, 2, 1, FUTURE], num_pending=1)  # the overlapped step's token unknown
    shadows.start([looped])  # anchored after the known 1: drafts 2 1 ...
    looped.token_ids[-1], looped.num_pending = 2, 0
    _grow(looped, FUTURE)
    looped.num_pending = 1
    shadows.score([looped])
    assert len(seen) == 1  # 2 matched, the next token still pending
    looped.token_ids[-1], looped.num_pending = 5, 0
    shadows.score([looped])
    assert seen[-1] == ("b", 4, 1, 1)


def test_lookups_a_step_are_bounded_and_go_round_the_requests():
    shadows, seen = _shadows(lookups=2)
    reqs = [_Req(str(i), [4, 5, 6, 7 + i]) for i in range(5)]  # no matches: each settles at once
    started = []
    for _ in range(5):
        shadows.start(reqs)
        started.append(sorted(shadows._open))
        shadows.score(reqs)
    assert all(len(ids) == 2 for ids in started)
    assert {i for ids in started for i in ids} == {str(i) for i in range(5)}
    assert shadows.scored == 10


def test_drop_and_forget_lose_the_open_shadows():
    shadows, seen = _shadows()
    a, b = _Req("a", [1, 2, 1]), _Req("b", [3, 4, 3])
    shadows.start([a, b])
    shadows.forget("a")
    shadows.drop()
    _grow(a, 2)
    _grow(b, 4)
    shadows.score([a, b])
    assert not seen and not shadows._open


@pytest.fixture(scope="module")
def target_llm_parts(small_vocab_target):
    return small_vocab_target, LLM(small_vocab_target, device="cpu", dtype="float32", max_total_tokens=4096)


def _looping_llm(target, shadow_lookups: int) -> LLM:
    """A policy that starts off (a low prior) and never probes within the run."""
    adaptive = {
        "profile": False,
        "cost_alpha": 0.0,
        "calibration_fade": None,  # the step times are this CPU's, the costs are scripted
        "prior": 0.05,
        "probe_every": 100_000,
        "shadow_lookups": shadow_lookups,
    }
    spec = {"method": "ngram", "num_steps": 4, "adaptive": adaptive}
    return LLM(target, device="cpu", dtype="float32", max_total_tokens=4096, speculative=spec)


def test_the_policy_turns_speculation_on_over_a_loop_without_probes(target_llm_parts):
    target, plain = target_llm_parts
    prompt = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9]
    params = SamplingParams(max_new_tokens=120, temperature=0.0, ignore_eos=True)
    want = plain.generate([prompt], params)[0].token_ids
    runs = {}
    for lookups in (0, 8):
        llm = _looping_llm(target, lookups)
        adaptive = llm.engine.adaptive
        costs = adaptive.costs  # launch-bound: a verify of up to 5 tokens costs a decode step
        costs.profile(VERIFY, [(1, q) for q in range(1, 6)], lambda b, q: 1e-3)
        costs.profile(DECODE, [(1, 1)], lambda b, q: 1e-3)
        costs.profile(DRAFT, [(1, 1)], lambda b, w: 1e-5)
        adaptive.policy.current = OFF  # as after a stretch of text nothing predicted
        assert llm.generate([prompt], params)[0].token_ids == want  # lossless either way
        runs[lookups] = adaptive
    assert runs[0].shadow is None and sum(n for t, n in runs[0].tier_steps.items() if t != OFF) == 0
    # With shadows the first few plain steps' lookups show the loop and the policy switches on
    # (on the CPU: off 10 steps, shadow evidence rescored every 8 decisions, then the 4-chain for the
    # rest), with no probe.
    shadowed = runs[8]
    assert shadowed.shadow is not None and shadowed.shadow.scored > 0 and shadowed.policy.probes == 0
    assert shadowed.tier_steps[OFF] < 20 and sum(n for t, n in shadowed.tier_steps.items() if t != OFF) > 0
