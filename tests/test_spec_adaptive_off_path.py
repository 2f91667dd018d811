"""The adaptive policy's off path stays cheap at any batch and decides as before: off with no tier
able to win whatever the acceptance, it reads no request's estimates and starts no shadow draft;
shadow evidence rescores every few decisions, a verify's at once; the probe's candidates are priced
once per scoring; the faster arithmetic gives the same figures bit for bit. (Issue 9: on the H100
adaptive's plain steps cost 1.9x / 1.3x a plain step at batch 16 / 64, the policy's host work.)"""

from __future__ import annotations

import random

import pytest

from specserve.spec.acceptance import AcceptanceTracker, _Counts, expected_prefix
from specserve.spec.adaptive import OFF, AdaptivePolicy, Tier, default_tiers
from specserve.spec.step_costs import DECODE, DRAFT, VERIFY, StepCosts

MS = 1e-3


def _dear_costs() -> StepCosts:
    """Batch 64 where a verify costs 2.4 ms a token per request and drafting 30 ms: no tier wins even
    with every draft accepted."""
    c = StepCosts()
    c.profile(VERIFY, [(64, q) for q in (1, 2, 3, 5, 9)], lambda b, q: 2.4 * MS * q)
    c.profile(DRAFT, [(64, 1), (1, 1)], lambda b, w: 30 * MS)
    return c


def _policy(costs: StepCosts, **kwargs) -> AdaptivePolicy:
    return AdaptivePolicy(default_tiers(8), costs, AcceptanceTracker(8), draft_per_step=False, **kwargs)


def _run(policy: AdaptivePolicy, batch: int, steps: int, seed: int) -> list[tuple]:
    """Decisions over a batch whose drafts match now and then; what each decided."""
    rng, ids, out = random.Random(seed), [f"r{i}" for i in range(batch)], []
    for step in range(steps):
        remaining = [300 - step + i % 7 for i in range(batch)]
        d = policy.decide(ids, remaining)
        out.append((d.tier, dict(d.steps), round(d.predicted_goodput, 6), d.switched, policy.probes))
        for rid, n in d.steps.items():
            if n:
                policy.acceptance.observe(rid, d.tier.topk, n, rng.randint(0, n), batch)
        if d.tier != policy.current:
            policy.observe_probe(batch)
    return out


def test_off_where_no_tier_can_win_reads_no_estimates_and_decides_as_scoring_would():
    reference = _policy(_dear_costs(), probe_every=4)
    reference._hopeless = lambda batch: False  # always scores, as before the gate
    gated = _policy(_dear_costs(), probe_every=4)
    assert _run(gated, 64, 60, 1) == _run(reference, 64, 60, 1)
    assert gated.hopeless and gated.current == OFF and gated.probes == 0

    def no_reading(*args, **kwargs):
        raise AssertionError("the off path read the acceptance estimates")

    gated.acceptance.rates_of = no_reading
    gated.acceptance.pooled_upper = no_reading
    for _ in range(40):
        assert gated.decide([f"r{i}" for i in range(64)]).tier == OFF


def test_the_gate_opens_where_a_tier_could_win_and_follows_the_batch():
    costs = _dear_costs()
    costs.profile(VERIFY, [(1, q) for q in (1, 2, 3, 5, 9)], lambda b, q: 1 * MS)  # batch 1: launch-bound
    costs.profile(DRAFT, [(1, 1)], lambda b, w: 0.01 * MS)
    policy = _policy(costs, probe_every=4)
    policy.decide([f"r{i}" for i in range(64)])
    policy.decide([f"r{i}" for i in range(64)])
    assert policy.current == OFF and policy.hopeless
    policy.decide(["r0"])  # a verify of 9 tokens costs a decode step: the 8-chain may well win
    assert not policy.hopeless


def test_shadow_evidence_rescores_every_few_decisions_a_verify_at_once():
    costs = StepCosts()
    costs.profile(VERIFY, [(1, q) for q in (1, 2, 3, 5, 9)], lambda b, q: 1 * MS)
    costs.profile(DRAFT, [(1, 1)], lambda b, w: 0.1 * MS)
    acceptance = AcceptanceTracker(8, prior=0.01)
    policy = AdaptivePolicy(
        default_tiers(8), costs, acceptance, draft_per_step=False, probe_every=10_000, shadow_rescore_every=4
    )
    first = policy.decide(["a"])
    assert first.tier == OFF
    for _ in range(50):
        acceptance.observe("a", 1, 8, 8, shadow=True)
    assert acceptance.version == 0 and acceptance.shadow_version == 50
    tiers = [policy.decide(["a"]).tier for _ in range(8)]
    # Scored at the 4th decision since the last scoring; then `patience` (3) wins switch it on.
    assert tiers[:5] == [OFF] * 5 and tiers[5] == Tier.chain(8)
    policy.current = OFF
    acceptance.observe("a", 1, 8, 8)  # a verify: the next decision rescores
    assert policy._scored.version != acceptance.version
    policy.decide(["a"])
    assert policy._scored.version == acceptance.version


def test_probe_candidates_are_priced_once_per_scoring():
    costs = StepCosts()
    costs.profile(VERIFY, [(64, q) for q in (1, 2, 3, 5, 9)], lambda b, q: (2 + 0.1 * q) * MS)
    costs.profile(DRAFT, [(64, 1), (1, 1)], lambda b, w: 0.5 * MS)
    costs.profile(DECODE, [(64, 1)], lambda b, w: 2 * MS)
    policy = _policy(costs, probe_every=2, rescore_every=1000, overlapped_off=True)
    policy.current = OFF
    acceptance = policy.acceptance
    for i in range(64):
        acceptance.observe(f"r{i}", 1, 8, 0, 64)  # nothing accepted: off stays best
    ids = [f"r{i}" for i in range(64)]
    priced = []
    original = policy.step_seconds
    policy.step_seconds = lambda tier, batch: priced.append(tier) or original(tier, batch)
    for _ in range(3):
        policy.decide(ids)
    assert policy._scored.probe is not None
    before = len(priced)
    policy.probe_share = 1e-9  # a probe dearer than decoding waits a long time for its share
    for _ in range(20):
        assert policy.decide(ids).tier == OFF
    assert len(priced) == before  # the waiting probe is not priced anew each step


def test_step_seconds_from_aggregates_equal_the_per_request_sum():
    costs = StepCosts()
    costs.profile(
        VERIFY, [(b, q) for b in (4, 16) for q in (1, 2, 3, 5, 9)], lambda b, q: (1 + 0.01 * b * q) * MS
    )
    costs.profile(DRAFT, [(b, 1) for b in (1, 4, 16)], lambda b, w: 0.02 * b * MS)
    for per_step in (False, True):
        policy = AdaptivePolicy(default_tiers(8), costs, AcceptanceTracker(8), draft_per_step=per_step)
        for depths in ([0, 3, 8, 0], [8] * 16, [1, 0, 0, 0], [0] * 4):
            tier = Tier.chain(8)
            want = policy._seconds(tier, len(depths), depths)
            deepest, drafting = max(depths), sum(1 for d in depths if d)
            assert policy._step_seconds(tier, len(depths), deepest, drafting, sum(depths)) == want
            assert policy._seconds(tier, len(depths), tuple(depths)) == want


def test_faster_fades_and_rates_are_the_same():
    rng = random.Random(3)
    counts, accepted, tested = _Counts(8), [0.0] * 8, [0.0] * 8
    for _ in range(200):
        drafted = rng.randint(1, 8)
        kept = rng.randint(0, drafted)
        n, alpha = min(drafted, kept + 1), rng.choice((0.1, 0.02, 0.5))
        counts.add_many([(n, kept)], alpha)
        for i in range(8):  # the per-position loop it replaced
            accepted[i] *= 1.0 - alpha
            tested[i] *= 1.0 - alpha
        for i in range(n):
            tested[i] += 1.0
            accepted[i] += 1.0 if i < kept else 0.0
    # stored against one running fade factor: the same counts up to rounding
    assert counts.accepted == pytest.approx(accepted, rel=1e-12, abs=1e-300)
    assert counts.tested == pytest.approx(tested, rel=1e-12, abs=1e-300)
    tracker = AcceptanceTracker(8)
    for i in range(20):
        drafted = rng.randint(1, 8)
        tracker.observe(f"r{i % 5}", 1, drafted, rng.randint(0, drafted), 5, shadow=i % 2 == 0)
    pooled = tracker.pooled(1)
    for rid, rates in tracker.rates_of([f"r{i}" for i in range(7)], 1).items():
        own = tracker._requests.get((rid, 1))
        want = pooled if own is None else [own.rate(i, p, tracker.strength) for i, p in enumerate(pooled)]
        assert rates == want
        assert expected_prefix(rates)[0] == 1.0


@pytest.mark.parametrize("batch", [1, 16])
def test_decisions_where_tiers_win_are_those_of_always_scoring(batch):
    """Where a tier can win the gate never closes: decisions are those of scoring every step."""

    def costs() -> StepCosts:
        c = StepCosts()
        c.profile(
            VERIFY, [(b, q) for b in (1, 16) for q in (1, 2, 3, 5, 9)], lambda b, q: (1 + 0.01 * b * q) * MS
        )
        c.profile(DRAFT, [(b, 1) for b in (1, 16)], lambda b, w: 0.05 * MS)
        return c

    reference = _policy(costs(), probe_every=8)
    reference._hopeless = lambda b: False
    policy = _policy(costs(), probe_every=8)
    assert _run(policy, batch, 80, 7) == _run(reference, batch, 80, 7)


def test_shadow_drafts_start_only_where_their_evidence_could_change_the_decision():
    from types import SimpleNamespace

    from specserve.config import SpeculativeConfig
    from specserve.engine.adaptive_control import AdaptiveSpeculation
    from specserve.engine.request import ListMirror

    spec = SpeculativeConfig.from_value({"method": "ngram", "num_steps": 8, "adaptive": {"profile": False}})
    assert spec.adaptive.shadow_lookups == 2  # bounded whatever the batch: ~2 lookups' host time a step
    control = AdaptiveSpeculation(spec)
    lookups = []
    control.use_shadow(lambda tokens, seq, depth: lookups.append(len(tokens)) or [])
    control.overlapped_off = True
    reads = []

    class Params:  # counts how often the tokens each request has left are gathered
        @property
        def max_new_tokens(self) -> int:
            reads.append(1)
            return 10_000

    params = Params()
    reqs = [
        SimpleNamespace(
            request_id=f"r{i}",
            params=params,
            num_output=0,
            prompt_len=3,
            token_ids=[1, 2, 3],
            num_pending=0,
            token_mirror=ListMirror(),
        )
        for i in range(64)
    ]
    costs = control.costs
    costs.profile(VERIFY, [(64, q) for q in (1, 2, 3, 5, 9)], lambda b, q: 2.4 * MS * q)
    costs.profile(DRAFT, [(64, 1), (1, 1)], lambda b, w: 30 * MS)
    control.policy.current = OFF
    for _ in range(5):
        assert control.decide(reqs).num_steps == 0
    assert control.policy.hopeless and not lookups
    assert not reads  # off standing, no tier able to win: no request was read
    costs.profile(VERIFY, [(4, q) for q in (1, 2, 3, 5, 9)], lambda b, q: 1 * MS)  # batch 4: tiers may win
    costs.profile(DRAFT, [(4, 1), (1, 1)], lambda b, w: 0.01 * MS)
    control.decide(reqs[:4])
    assert not control.policy.hopeless and len(lookups) == 2 and len(reads) == 4


def test_shadow_lookups_are_per_plain_step():
    """Off in a device loop, an engine step runs a run of plain steps: it starts that many times the
    lookups a synchronous plain step does (at 2 an engine step, a batch of 64 gave each request one
    shadow in its 32 engine steps)."""
    from specserve.config import SpeculativeConfig
    from specserve.engine.adaptive_control import AdaptiveSpeculation

    spec = SpeculativeConfig.from_value({"method": "ngram", "num_steps": 8, "adaptive": {"profile": False}})
    host, looped = AdaptiveSpeculation(spec), AdaptiveSpeculation(spec)
    host.use_shadow(lambda tokens, seq, depth: [])
    looped.use_shadow(lambda tokens, seq, depth: [], plain_steps=8)
    assert (host.shadow.lookups, looped.shadow.lookups) == (2, 16)
