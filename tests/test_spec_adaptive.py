"""The adaptive speculation policy: acceptance estimates, step-cost tables, and the tier it picks as
acceptance and batch size change (a scripted drafter whose drafts survive with a set probability)."""

from __future__ import annotations

import random

import pytest

from specserve.spec.acceptance import AcceptanceTracker, expected_tokens
from specserve.spec.adaptive import OFF, AdaptivePolicy, Tier, default_tiers
from specserve.spec.draft_depths import (
    VerifyShapes,
    drain_depths,
    goodput_depths,
    thinned_drain_seconds,
)
from specserve.spec.step_costs import DECODE, DRAFT, MIN_SAMPLES, VERIFY, StepCosts

MS = 1e-3


def test_expected_tokens_counts_the_bonus_and_each_surviving_draft():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([1.0] * 4, 4) == 5.0
    assert expected_tokens([0.9, 0.0, 1.0], 3) == pytest.approx(1.9)


def test_tracker_learns_per_position_and_per_request():
    t = AcceptanceTracker(4, request_alpha=0.5, pooled_alpha=0.5, prior=0.5, strength=1.0)
    t.observe("a", 1, drafted=4, accepted=1)  # position 1 accepted, 2 rejected, 3-4 untested
    pooled, own = t.pooled(1), t.rates("a", 1)
    assert pooled[0] == pytest.approx(0.75) and pooled[1] == pytest.approx(0.375)
    # untested: the configured prior, not position 2's low rate (acceptance may rise with depth)
    assert pooled[2] == pooled[3] == 0.5
    assert own[0] > pooled[0] > 0.5 > pooled[1] > own[1]  # a's own evidence over the pool's
    assert own[2:] == pooled[2:]
    assert t.rates("b", 1) == pooled  # a new request starts from the pool
    assert t.rates("a", 4) == [0.5] * 4  # trees are judged apart from chains
    t.observe("b", 1, drafted=2, accepted=2)
    assert t.rates("b", 1)[1] > t.rates("a", 1)[1]  # b's luck is not a's
    assert t.reach("b", 1)[:2] == pytest.approx([t.rates("b", 1)[0], t.rates("b", 1)[0] * t.rates("b", 1)[1]])
    t.forget("a")
    assert t.rates("a", 1) == t.pooled(1)
    with pytest.raises(ValueError, match="accepted"):
        t.observe("a", 1, drafted=2, accepted=3)


@pytest.mark.parametrize("request_alpha", [0.1, 0.9])  # 0.9: the running factor renormalises too
def test_a_device_loop_run_is_observed_request_by_request_and_step_by_step_for_the_pool(request_alpha):
    """`observe_run` (a loop run's verifies of every request at once): each request's own rates as
    `observe` makes them one at a time; the pool's counts fade by `pooled_alpha` once per step of
    the run and count that step's verifies alike (a step where fewer verified fades it less), as the
    plain statement below does; bad counts are refused."""
    rng = random.Random(7)
    run_all, by_request = AcceptanceTracker(8, request_alpha), AcceptanceTracker(8, request_alpha)
    tested, accepted = [0.0] * 8, [0.0] * 8
    for _ in range(60):
        runs = []
        for r in range(6):
            steps = rng.randint(0, 8)  # a request that finished early made fewer verifies
            runs.append(
                (f"r{r}", [(d, rng.randint(0, d)) for d in (rng.randint(1, 8) for _i in range(steps))])
            )
        run_all.observe_run(1, runs, 6)
        for rid, verifies in runs:
            for drafted, kept in verifies:
                by_request.observe(rid, 1, drafted, kept, 6)
        for step in range(max(len(v) for _, v in runs)):
            made = [v[step] for _, v in runs if len(v) > step]
            if not made:
                continue
            keep = (1.0 - run_all.pooled_alpha) ** (len(made) / 6)  # a whole step of 6: pooled_alpha
            tested[:] = [t * keep for t in tested]
            accepted[:] = [a * keep for a in accepted]
            for drafted, kept in made:
                for i in range(min(drafted, kept + 1)):
                    tested[i] += 1.0
                    accepted[i] += 1.0 if i < kept else 0.0
    ids = [f"r{r}" for r in range(6)]
    pool, own = run_all._pool(1), by_request._pool(1)
    assert pool.tested == pytest.approx(tested, rel=1e-9) and pool.accepted == pytest.approx(
        accepted, rel=1e-9
    )
    assert pool.tested != pytest.approx(own.tested, rel=1e-6)  # step by step, not request by request
    for rid in ids:  # a request's own estimates: its verifies in order, as one at a time
        mine, theirs = run_all._requests[(rid, 1)], by_request._requests[(rid, 1)]
        assert mine.accepted == pytest.approx(theirs.accepted, rel=1e-12, abs=1e-300)
        assert mine.tested == pytest.approx(theirs.tested, rel=1e-12, abs=1e-300)
    assert run_all.rates_of(ids, 1) != by_request.rates_of(ids, 1)  # the pools differ, the requests' own not
    assert run_all.version == by_request.version
    # accepted counts up to drafted; a verify that drafted nothing is left out; negatives refused
    version = run_all.version
    assert run_all.observe_run(1, [("r0", [(2, 3), (0, 0)]), ("r1", [(0, 0)])], 1) == [1, 0]
    assert run_all.version == version + 1
    over, full = AcceptanceTracker(8, request_alpha), AcceptanceTracker(8, request_alpha)
    over.observe_run(1, [("r0", [(2, 3)])], 1)
    full.observe_run(1, [("r0", [(2, 2)])], 1)
    assert over.rates("r0", 1) == full.rates("r0", 1) and over.pooled(1) == full.pooled(1)
    with pytest.raises(ValueError, match="never negative"):
        run_all.observe_run(1, [("r0", [(2, -1)])], 1)


def test_evidence_a_draft_length_no_longer_reaches_fades_back_to_the_prior():
    t = AcceptanceTracker(4, prior=0.8)
    t.observe("a", 1, drafted=4, accepted=2)  # one rejection at position 3
    assert t.rates("a", 1)[2] < 0.5
    for _ in range(200):  # then only one-token drafts, always accepted
        t.observe("a", 1, drafted=1, accepted=1)
    assert t.rates("a", 1)[2] > 0.9


def test_step_costs_interpolate_extrapolate_and_average():
    c = StepCosts(alpha=0.5, default=1e-6)
    c.profile(VERIFY, [(1, 1), (8, 1), (64, 1), (8, 5)], lambda b, w: (1 + b * w / 8) * MS)
    assert c.estimate(VERIFY, 8, 1) == pytest.approx(2 * MS)
    assert c.estimate(VERIFY, 4, 1) == pytest.approx((1.125 + (2 - 1.125) * 3 / 7) * MS)
    assert c.estimate(VERIFY, 128, 1) == pytest.approx(9 * MS * 2)  # past the end: in proportion
    assert c.estimate(VERIFY, 2, 5) == pytest.approx(6 * MS)  # below the smallest: its cost
    assert c.estimate(VERIFY, 8, 3) == pytest.approx(2 * MS * 3)  # width 1 is nearest: per token
    assert c.estimate(DRAFT, 4, 1) == pytest.approx(4e-6)  # nothing measured: the default
    # live: the mean of the last 2 / alpha - 1 = 3 measurements, less those over twice their median,
    # once there are MIN_SAMPLES of them
    c.observe(VERIFY, 8, 1, 4 * MS)
    c.observe(VERIFY, 8, 1, 2.5 * MS)
    assert c.estimate(VERIFY, 8, 1) == pytest.approx(2 * MS)  # till then the profile
    c.observe(VERIFY, 8, 1, 3 * MS)
    assert c.estimate(VERIFY, 8, 1) == pytest.approx(9.5 / 3 * MS)
    c.observe(VERIFY, 8, 1, 30 * MS)  # an outlier drops out, it does not lift the price by its excess
    assert c.estimate(VERIFY, 8, 1) == pytest.approx(2.75 * MS)  # of 2.5, 3 and 30
    c.observe(VERIFY, 0, 1, 1.0)  # an empty step says nothing
    assert (VERIFY, 0, 1) not in c.measured()


def _gpu_like_costs(draft_ms: float = 0.15) -> StepCosts:
    """A launch-bound target at small batch (1 ms whatever the tokens), compute-bound at large."""
    c = StepCosts()
    shapes = [(b, q) for b in (1, 4, 16, 64) for q in (1, 2, 3, 5, 9)]
    c.profile(VERIFY, shapes, lambda b, q: max(1.0, 0.03 * b * q) * MS)
    c.profile(DRAFT, [(b, 1) for b in (1, 4, 16, 64)], lambda b, w: draft_ms * MS)
    return c


def _true_goodput(tier: Tier, costs: StepCosts, rate: float, batch: int) -> float:
    """Tokens per second of `tier` when every draft survives with probability `rate`."""
    seconds = costs.estimate(VERIFY, batch, tier.query_len) + tier.num_steps * costs.estimate(DRAFT, batch, 1)
    return batch * expected_tokens([rate] * 8, tier.num_steps) / seconds


def _optimal(tiers, costs, rate: float, batch: int) -> Tier:
    return max(tiers, key=lambda t: _true_goodput(t, costs, rate, batch))


def _simulate(policy: AdaptivePolicy, rate: float, batch: int, steps: int, rng: random.Random) -> Tier:
    """Run `steps` decisions over `batch` requests whose drafts each survive with probability `rate`."""
    ids = [f"r{i}" for i in range(batch)]
    for _ in range(steps):
        decision = policy.decide(ids)
        for rid, n in decision.steps.items():
            accepted = 0
            while accepted < n and rng.random() < rate:
                accepted += 1
            if n:
                policy.acceptance.observe(rid, decision.tier.topk, n, accepted)
    return policy.current


@pytest.mark.parametrize(
    ("rate", "batch"), [(0.9, 1), (0.6, 1), (0.3, 1), (0.05, 1), (0.9, 16), (0.6, 64), (0.9, 64)]
)
def test_policy_settles_near_the_best_tier_for_the_acceptance_and_batch(rate, batch):
    """Against the best tier computed from the true rate: within 15% of its goodput for every seed
    (the estimates are noisy, so near-ties may go either way), and the best itself most often."""
    tiers = default_tiers(8)
    costs = _gpu_like_costs()
    best = _optimal(tiers, costs, rate, batch)
    chosen = []
    for seed in range(5):
        policy = AdaptivePolicy(tiers, costs, AcceptanceTracker(8), min_reach=0.0)
        chosen.append(_simulate(policy, rate, batch, 300, random.Random(seed)))
    goodputs = [_true_goodput(t, costs, rate, batch) for t in chosen]
    assert min(goodputs) >= 0.85 * _true_goodput(best, costs, rate, batch), (chosen, best)
    assert chosen.count(best) >= 3, (chosen, best)


def test_policy_follows_a_change_of_text_and_of_batch():
    tiers = default_tiers(8)
    costs = _gpu_like_costs()
    policy = AdaptivePolicy(tiers, costs, AcceptanceTracker(8, pooled_alpha=0.2), min_reach=0.0)
    rng = random.Random(2)
    assert _simulate(policy, 0.9, 1, 200, rng) == Tier.chain(8)  # predictable text
    assert _simulate(policy, 0.02, 1, 400, rng) == OFF  # text no drafter predicts
    assert _simulate(policy, 0.9, 1, 400, rng) == Tier.chain(8)  # probes bring it back
    assert _simulate(policy, 0.9, 64, 200, rng) == _optimal(tiers, costs, 0.9, 64)
    assert policy.switches >= 3


def test_hysteresis_waits_for_a_steady_winner():
    costs = _gpu_like_costs()
    acceptance = AcceptanceTracker(4, prior=0.9)
    policy = AdaptivePolicy([OFF, Tier.chain(4)], costs, acceptance, patience=3)
    assert policy.decide(["a"]).tier == Tier.chain(4)
    for _ in range(200):  # other requests' drafts all fail: OFF is now far better for a newcomer
        acceptance.observe("x", 1, drafted=4, accepted=0)
    acceptance.observe("a", 1, drafted=4, accepted=0)  # and its own first draft failed
    assert [policy.decide(["a"]).switched for _ in range(3)] == [False, False, True]
    assert policy.current == OFF and policy.switches == 1


def test_a_batch_of_fresh_requests_holds_the_standing_tier():
    """Requests that have verified nothing read the pool's rates alone, which earlier answers set: no
    tier is chosen on those, and a batch grown fourfold decides afresh once its requests verified."""
    costs = _gpu_like_costs()
    acceptance = AcceptanceTracker(4, prior=0.9)
    policy = AdaptivePolicy([OFF, Tier.chain(4)], costs, acceptance, patience=3)
    assert policy.decide(["a"]).tier == Tier.chain(4)  # the first decision: nothing stands yet
    for _ in range(200):  # the pool: every draft fails
        acceptance.observe("x", 1, drafted=4, accepted=0)
    fresh = ["b", "c", "d", "e"]  # four times batch 1
    assert [policy.decide(fresh).switched for _ in range(5)] == [False] * 5
    assert policy.current == Tier.chain(4) and policy.switches == 0
    acceptance.observe("b", 1, drafted=4, accepted=0)  # one of them verified: the grown batch decides
    assert policy.decide(fresh).switched and policy.current == OFF


def test_a_fresh_batch_grown_since_off_was_chosen_resumes_the_last_speculative_tier():
    """A batch's tail goes off for its last tokens; the next batch of fresh requests, four times as
    large, goes back to the speculative tier that stood and decides once its requests verified. A
    fresh batch no larger than the one off was chosen at stays off, as does a policy never on."""
    costs = _gpu_like_costs()
    acceptance = AcceptanceTracker(4, prior=0.9)
    policy = AdaptivePolicy([OFF, Tier.chain(4)], costs, acceptance, patience=3)
    assert policy.decide(["a", "b"]).tier == Tier.chain(4)
    for _ in range(200):  # the pool, and the tail's last request: every draft fails
        acceptance.observe("x", 1, drafted=4, accepted=0)
    acceptance.observe("a", 1, drafted=4, accepted=0)
    assert [policy.decide(["a"]).tier for _ in range(3)] == [Tier.chain(4)] * 2 + [OFF]
    fresh = ["c", "d", "e", "f"]  # four times batch 1
    decision = policy.decide(fresh)
    assert decision.switched and decision.tier == policy.current == Tier.chain(4)
    assert [policy.decide(fresh).tier for _ in range(3)] == [Tier.chain(4)] * 3  # held while fresh
    acceptance.observe("c", 1, drafted=4, accepted=0)  # verified: the grown batch decides at once
    assert policy.decide(fresh).switched and policy.current == OFF
    assert policy.switches == 3
    # off chosen at batch 4: the next fresh batch of 4 decides as ever (off)
    assert [policy.decide(["g", "h", "i", "j"]).tier for _ in range(3)] == [OFF] * 3
    never_on = AdaptivePolicy([OFF, Tier.chain(4)], costs, acceptance, patience=3)
    assert never_on.decide(["a"]).tier == OFF
    assert never_on.decide(fresh).tier == OFF


def test_probe_while_off_and_goodput_average():
    costs = _gpu_like_costs()
    acceptance = AcceptanceTracker(4, prior=0.01)
    policy = AdaptivePolicy([OFF, Tier.chain(4)], costs, acceptance, probe_every=4, probe_share=1.0)
    tiers = [policy.decide(["a"]).tier for _ in range(8)]
    assert tiers == [OFF, OFF, OFF, Tier.chain(4), OFF, OFF, OFF, Tier.chain(4)]
    assert policy.current == OFF and policy.switches == 0
    policy.observe_step(10, 0.01)
    policy.observe_step(20, 0.01)
    assert policy.measured_goodput == pytest.approx(1000 + 0.1 * 1000)


def test_requests_with_poor_odds_draft_less():
    acceptance = AcceptanceTracker(4, prior=0.9)
    policy = AdaptivePolicy([Tier.chain(4)], _gpu_like_costs(), acceptance, min_reach=0.3)
    for _ in range(20):
        acceptance.observe("good", 1, drafted=4, accepted=4)
        acceptance.observe("poor", 1, drafted=4, accepted=1)
    assert policy.decide(["good", "poor"]).steps == {"good": 4, "poor": 1}


def test_default_tiers():
    assert default_tiers(4) == (OFF, Tier.chain(1), Tier.chain(2), Tier.chain(4))
    assert Tier(5, 4, 16) in default_tiers(5, topk=4, num_draft_tokens=16)
    assert Tier.chain(3).query_len == 4 and OFF.query_len == 1


def test_scores_are_kept_until_the_batch_estimates_or_age_change():
    """Off, nothing is verified: the scores of the last decision stand for the same batch, for up to
    `rescore_every` decisions (the cost tables drift slowly); a new batch or a verify rescores."""
    costs = _gpu_like_costs()
    acceptance = AcceptanceTracker(4, prior=0.01)
    policy = AdaptivePolicy([OFF, Tier.chain(4)], costs, acceptance, rescore_every=4, probe_every=1000)
    first = policy.decide(["a"])
    assert first.tier == OFF
    costs.profile(VERIFY, [(1, 1)], lambda b, w: 10 * MS)  # decoding got ten times dearer
    assert [policy.decide(["a"]).predicted_goodput for _ in range(3)] == [first.predicted_goodput] * 3
    assert policy.decide(["a"]).predicted_goodput == pytest.approx(first.predicted_goodput / 10)  # aged out
    costs.profile(VERIFY, [(1, 1)], lambda b, w: 1 * MS)
    assert policy.decide(["a", "b"]).predicted_goodput == pytest.approx(2 * first.predicted_goodput)
    policy.rescore_every = 1000
    for _ in range(50):  # a verifies all its drafts now: that alone rescores
        acceptance.observe("a", 1, drafted=4, accepted=4)
    assert [policy.decide(["a"]).tier for _ in range(3)] == [OFF, OFF, Tier.chain(4)]


# ---- issue 9: n-gram-like (bimodal) acceptance and H100-like costs ---------------------------------


def _h100_costs(batches=(1, 4, 16, 64)) -> StepCosts:
    """Issue 9's H100: a target pass launch-bound near 1.1 ms up to ~16 tokens, then by tokens; an
    n-gram lookup ~0.2 ms of host time per request, one per draft whatever its depth."""
    c = StepCosts()
    passes = {1: 1.1, 2: 1.12, 3: 1.14, 5: 1.16, 9: 1.2}
    shapes = [(b, q) for b in batches for q in (1, 2, 3, 5, 9)]
    c.profile(VERIFY, shapes, lambda b, q: (passes[q] if b == 1 else max(1.1, 1.0 + 0.02 * b * q)) * MS)
    c.profile(DRAFT, [(b, 1) for b in batches], lambda b, w: 0.2 * b * MS)
    return c


def _bimodal(policy: AdaptivePolicy, match: float, follow: float, batch: int, steps: int, rng) -> list[Tier]:
    """`steps` decisions; each request's lookup matches with probability `match` (then each draft
    survives with `follow`), else drafts nothing (position 1 rejected). Probes get their verdict."""
    ids, tiers = [f"r{i}" for i in range(batch)], []
    for _ in range(steps):
        decision = policy.decide(ids)
        tiers.append(decision.tier)
        if decision.tier.off:  # a plain step costs what it was priced at (the engine measures it)
            kind = DECODE if policy.overlapped_off else VERIFY
            policy.costs.observe(kind, batch, 1, policy.step_seconds(decision.tier, batch))
        emitted = 0
        for rid, n in decision.steps.items():
            accepted = 0
            if n and rng.random() < match:
                while accepted < n and rng.random() < follow:
                    accepted += 1
            if n:
                policy.acceptance.observe(rid, decision.tier.topk, n, accepted)
            emitted += accepted + 1
        if decision.tier != policy.current:
            policy.observe_probe(emitted)
    return tiers


def _ngram_policy(costs: StepCosts, **kwargs) -> AdaptivePolicy:
    return AdaptivePolicy(default_tiers(8), costs, AcceptanceTracker(8), draft_per_step=False, **kwargs)


def test_bimodal_acceptance_at_batch_1_picks_the_deep_chain():
    """MT-Bench at batch 1: half the lookups match, and then drafts mostly survive. The 8-chain is
    best by far; the policy must find it even after a stretch of misses took it off (probes go deep
    under the upper confidence bound, untested positions are not condemned by position 1)."""
    costs = _h100_costs()
    rng = random.Random(0)
    policy = _ngram_policy(costs)
    assert _bimodal(policy, 0.55, 0.85, 1, 200, rng)[-1] == Tier.chain(8)
    policy = _ngram_policy(costs)
    _bimodal(policy, 0.0, 0.0, 1, 100, rng)  # nothing matches: off
    assert policy.current == OFF
    tiers = _bimodal(policy, 0.55, 0.85, 1, 400, rng)
    probes = [t for t in tiers if t != OFF][:1]
    assert probes == [Tier.chain(8)]  # the first probe is deep, not tier 1
    assert policy.current == Tier.chain(8)


def test_large_batch_with_low_acceptance_stays_off_and_probes_fade():
    costs = _h100_costs()
    policy = _ngram_policy(costs, probe_every=8)
    tiers = _bimodal(policy, 0.1, 0.5, 64, 400, random.Random(1))
    assert policy.current == OFF
    assert tiers.count(OFF) >= 390  # at most a few probes: each lost and doubled the interval


def test_probe_interval_backs_off_while_probes_lose_and_recovers_when_text_turns_predictable():
    costs = _h100_costs()
    policy = _ngram_policy(costs, probe_every=4, max_probe_every=64)
    rng = random.Random(2)
    _bimodal(policy, 0.0, 0.0, 4, 300, rng)
    assert policy.current == OFF and policy.probe_interval == 64 and policy.probes_won == 0
    assert policy.probes <= 10  # 4, 8, 16, 32, 64, 64, ... rather than 75 probes
    _bimodal(policy, 0.9, 0.95, 4, 200, rng)  # the text became predictable
    assert policy.probes_won >= 1 and policy.current == Tier.chain(8)


def test_no_probe_when_no_tier_could_beat_decoding():
    """Where even all-accepted drafts lose (drafting 64 requests costs several decode steps), a
    probe would only cost: none runs."""
    c = StepCosts()
    c.profile(VERIFY, [(64, q) for q in (1, 2, 3, 5, 9)], lambda b, q: 2.4 * MS * q)
    c.profile(DRAFT, [(64, 1)], lambda b, w: 30 * MS)
    policy = _ngram_policy(c, probe_every=2)
    tiers = _bimodal(policy, 0.0, 0.0, 64, 50, random.Random(3))
    assert set(tiers) == {OFF} and policy.probes == 0


def test_live_host_work_lifts_the_profile_of_shapes_not_yet_run():
    """A profile times device passes only; live verifies also pay host work. What one shape measured
    beyond its profile is charged to the shapes never run live, so they do not look cheaper."""
    c = StepCosts(alpha=1.0)
    c.profile(VERIFY, [(4, q) for q in (1, 5, 9)], lambda b, q: 1.0 * MS)
    c.observe(VERIFY, 4, 5, 1.5 * MS)
    assert c.estimate(VERIFY, 4, 5) == pytest.approx(1.5 * MS)
    assert c.estimate(VERIFY, 4, 9) == pytest.approx(1.5 * MS)  # profile + the residual
    assert c.estimate(VERIFY, 8, 9) == pytest.approx(2.5 * MS)  # past the profile: scaled, + residual
    assert StepCosts(alpha=0.0).measured() == {}
    frozen = StepCosts(alpha=0.0)
    frozen.observe(VERIFY, 4, 1, 1.0)
    assert frozen.measured() == {}  # alpha 0 keeps the profile: nothing learnt


def test_diagnostics_name_every_tier_and_position():
    policy = _ngram_policy(_h100_costs())
    _bimodal(policy, 0.55, 0.85, 1, 50, random.Random(4))
    d = policy.diagnostics()
    assert set(d["step_ms"]) == {"off", "1", "2", "4", "8"} and len(d["pooled_acceptance"][1]) == 8
    assert d["step_ms"]["8"] == pytest.approx(1.4)  # 1.2 ms verify + one 0.2 ms lookup
    assert d["profile_ms"]["8"] == pytest.approx(1.2)  # the verify's device pass as profiled
    assert set(d["profile_ms"]) == set(d["step_ms"])


# ---- issue 9, H100 at batch 16/64: predicted step costs must be the wall-clock ones -------------------


def test_residual_starts_at_the_first_gap_and_grows_with_the_batch():
    """Host work a profile misses: the first live step's gap counts whole (not a fifth of it), and a
    batch between or past the measured ones gets it in proportion to where it lies."""
    c = StepCosts(alpha=0.2)
    c.profile(VERIFY, [(b, q) for b in (1, 4, 16, 64) for q in (1, 9)], lambda b, q: 1.0 * MS)
    for _ in range(MIN_SAMPLES):
        c.observe(VERIFY, 4, 9, 1.4 * MS)
    assert c.residual(VERIFY, 4) == pytest.approx(0.4 * MS)
    for _ in range(MIN_SAMPLES):
        c.observe(VERIFY, 16, 9, 2.0 * MS)
    assert c.residual(VERIFY, 10) == pytest.approx(0.7 * MS)  # between: linear
    assert c.residual(VERIFY, 64) == pytest.approx(3.4 * MS)  # past: along the last segment
    assert c.estimate(VERIFY, 64, 1) == pytest.approx(4.4 * MS)


def test_a_loop_width_takes_no_residual_of_synchronous_steps():
    """A head's plain steps run synchronously, priced as one-token verifies: at batch 64 on the H100
    they cost 8.7 ms against a 1.7 ms profile, and that 7 ms residual was added to every chain's
    price, though their steps run in the device loop with no host work between forwards (priced
    8.2-9.2 ms where they cost 1.8-2.7). A loop width is its profile and its loop gap; a width run
    synchronously keeps the residual."""
    c = StepCosts(alpha=0.2)
    c.profile(VERIFY, [(64, q) for q in (1, 3, 4)], lambda b, q: (1.7 + 0.1 * q) * MS)
    for _ in range(MIN_SAMPLES):
        c.observe(VERIFY, 64, 1, 8.8 * MS)
    assert c.residual(VERIFY, 64) == pytest.approx(7.0 * MS)
    assert c.estimate(VERIFY, 64, 4) == pytest.approx(9.1 * MS)  # not known to loop: as before
    c.loop_widths[VERIFY] = frozenset({3, 4})
    assert c.estimate(VERIFY, 64, 4) == pytest.approx(2.1 * MS)  # not run yet: its profile
    for _ in range(MIN_SAMPLES):
        c.observe(VERIFY, 64, 3, 2.2 * MS, rows=True, context=200.0)
    c.context = 200.0
    assert c.estimate(VERIFY, 64, 3) == pytest.approx(2.2 * MS)  # its loop steps
    assert c.estimate(VERIFY, 64, 1) == pytest.approx(8.8 * MS)  # synchronous: with the residual


def test_plain_step_cost_borrows_the_profile_shape_not_the_batch_ratio():
    """An overlapped plain step is measured live only. Before one ran, it costs the device pass (its
    host work hides); past the batches measured, the nearest one plus what the profile adds."""
    c = StepCosts()
    device = {1: 0.6, 4: 0.65, 16: 0.9, 64: 1.7}
    c.profile(VERIFY, [(b, 1) for b in device], lambda b, q: device[b] * MS)
    assert c.knows(DECODE) and not c.measures(DECODE)
    assert c.estimate(DECODE, 64, 1) == pytest.approx(1.7 * MS)
    for _ in range(MIN_SAMPLES):
        c.observe(DECODE, 16, 1, 1.3 * MS)
    assert c.estimate(DECODE, 64, 1) == pytest.approx((1.3 + 1.7 - 0.9) * MS)  # not 4 x 1.3
    for _ in range(MIN_SAMPLES):
        c.observe(DECODE, 1, 1, 0.75 * MS)
    assert c.estimate(DECODE, 4, 1) == pytest.approx((0.75 + (1.3 - 0.75) * 3 / 15) * MS)


class _H100Clock:
    """Issue 9's H100 run, scripted: wall ms of an overlapped plain step and of a speculative step by
    phase at batch 1 and 64 (mixed workload rows); a profile sees 70% of the target phase."""

    PLAIN = {1: 0.75, 64: 2.52}
    SPEC = {1: (0.03, 1.42, 0.06), 64: (0.49, 3.32, 1.59)}  # draft, target, postprocess (8-chain)

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def profile(self, costs: StepCosts) -> None:
        costs.profile(
            VERIFY, [(self.batch, q) for q in (1, 2, 3, 5, 9)], lambda b, q: 0.7 * self.SPEC[b][1] * MS
        )
        costs.profile(DRAFT, [(self.batch, 1)], lambda b, w: self.SPEC[b][0] * MS)

    def run(
        self, policy: AdaptivePolicy, match: float, follow: float, steps: int, rng
    ) -> tuple[float, float]:
        """Tokens and scripted seconds of `steps` decisions, each step's cost fed back as the engine does."""
        ids, tokens, seconds = [f"r{i}" for i in range(self.batch)], 0, 0.0
        for _ in range(steps):
            decision = policy.decide(ids)
            if decision.tier.off:
                step = self.PLAIN[self.batch] * MS
                emitted = self.batch
                policy.costs.observe(DECODE, self.batch, 1, step)
            else:
                draft, target, post = (ms * MS for ms in self.SPEC[self.batch])
                step, emitted = draft + target + post, 0
                for rid, n in decision.steps.items():
                    accepted = 0
                    if rng.random() < match:
                        while accepted < n and rng.random() < follow:
                            accepted += 1
                    policy.acceptance.observe(rid, 1, n, accepted)
                    emitted += accepted + 1
                policy.costs.observe(VERIFY, self.batch, decision.tier.query_len, target + post)
                policy.costs.observe(DRAFT, self.batch, 1, draft)
                if decision.tier != policy.current:
                    policy.observe_probe(emitted, step)
            policy.observe_step(emitted, step)
            tokens, seconds = tokens + emitted, seconds + step
        return tokens, seconds


def test_large_batch_where_speculation_really_loses_settles_off_within_plain():
    """Batch 64: an 8-chain step costs 2.15 plain steps (host lookup, verify and postprocess that a
    device profile misses), and drafts accept ~1.1 tokens each: the policy must settle on off, and
    its probes and first steps may cost at most 5% against plain decoding."""
    clock, rng = _H100Clock(64), random.Random(5)
    costs = StepCosts()
    clock.profile(costs)
    policy = AdaptivePolicy(
        default_tiers(8), costs, AcceptanceTracker(8), draft_per_step=False, overlapped_off=True
    )
    tokens, seconds = clock.run(policy, 0.5, 0.7, 600, rng)
    assert policy.current == OFF
    plain = 64 / (clock.PLAIN[64] * MS)
    assert tokens / seconds >= 0.95 * plain
    d = policy.diagnostics(64)
    assert d["step_ms"]["off"] == pytest.approx(2.52, rel=0.01)
    assert d["step_ms"]["8"] == pytest.approx(5.4, rel=0.01)  # the wall step, host work included


def test_batch_1_where_speculation_wins_picks_the_deep_chain_and_its_throughput():
    clock, rng = _H100Clock(1), random.Random(6)
    costs = StepCosts()
    clock.profile(costs)
    policy = AdaptivePolicy(
        default_tiers(8), costs, AcceptanceTracker(8), draft_per_step=False, overlapped_off=True
    )
    tokens, seconds = clock.run(policy, 0.8, 0.9, 400, rng)
    assert policy.current == Tier.chain(8)
    static = AdaptivePolicy([Tier.chain(8)], StepCosts(), AcceptanceTracker(8), draft_per_step=False)
    static_tokens, static_seconds = _H100Clock(1).run(static, 0.8, 0.9, 400, random.Random(6))
    assert tokens / seconds >= 0.9 * static_tokens / static_seconds


def test_an_ngram_request_drafts_the_full_depth_after_a_miss():
    """A lookup costs the same however deep: a request fresh from misses still drafts the tier's
    depth (a model drafter's request is cut to the positions it reaches)."""
    acceptance = AcceptanceTracker(8)
    for _ in range(5):
        acceptance.observe("a", 1, 8, 0)
    ngram = AdaptivePolicy([Tier.chain(8)], _h100_costs(), acceptance, draft_per_step=False)
    assert ngram.decide(["a"]).steps == {"a": 8}
    model = AdaptivePolicy([Tier.chain(8)], _h100_costs(), acceptance)
    assert model.decide(["a"]).steps["a"] < 8


def test_probes_are_spaced_by_their_cost_against_decoding():
    """A probe dearer than a decode step waits until its extra cost is `probe_share` of the time off."""
    c = StepCosts()
    c.profile(VERIFY, [(64, q) for q in (1, 2, 3, 5, 9)], lambda b, q: (2.5 if q == 1 else 5.0) * MS)
    c.profile(DRAFT, [(64, 1)], lambda b, w: 0.5 * MS)
    policy = AdaptivePolicy(
        default_tiers(8), c, AcceptanceTracker(8), draft_per_step=False, probe_every=4, probe_share=0.02
    )
    tiers = _bimodal(policy, 0.0, 0.0, 64, 300, random.Random(7))
    off_since = tiers.index(OFF)  # the policy starts on its optimistic prior, then goes off
    probes = [i for i, t in enumerate(tiers) if t != OFF and i > off_since]
    gaps = [b - a for a, b in zip([off_since - 1, *probes], probes, strict=False)]
    assert gaps and min(gaps) >= int((5.5 - 2.5) / (0.02 * 2.5))  # 60 steps off per probe, not 4


def test_a_plain_step_priced_from_a_slow_profile_is_measured_not_believed():
    """Batch 1 where decoding beats speculation (few lookups match), but the start-up profile of the
    one-token pass came out 2.5x slow (seen on the H100: a process whose first passes ran slow), so
    an unmeasured plain step looks dear. The policy must run a plain step now and then until one at
    this batch is measured, then settle on off: a price it never tests would stand for good."""
    clock, rng = _H100Clock(1), random.Random(7)
    costs = StepCosts()
    clock.profile(costs)
    costs.profile(VERIFY, [(1, 1)], lambda b, q: 2.5 * clock.PLAIN[1] * MS)  # the slow profile
    policy = AdaptivePolicy(
        default_tiers(8), costs, AcceptanceTracker(8), draft_per_step=False, overlapped_off=True
    )
    assert policy.step_seconds(OFF, 1) > 2 * clock.PLAIN[1] * MS
    tokens, seconds = clock.run(policy, 0.2, 0.5, 600, rng)
    assert policy.current == OFF
    assert policy.step_seconds(OFF, 1) == pytest.approx(clock.PLAIN[1] * MS, rel=0.01)
    assert tokens / seconds >= 0.9 / (clock.PLAIN[1] * MS)


# ---- per-request draft depths: verify priced by its bucket or its tokens; the drain ------------------


GRAPHED = VerifyShapes((1, 2, 3, 5, 9), 64)


def _eager_costs(batch: int) -> StepCosts:
    """An eager pass that costs by its tokens (0.5 ms plus 20 µs a token), a lookup 20 µs a request."""
    c = StepCosts()
    c.profile(VERIFY, [(batch, q) for q in (1, 2, 3, 5, 9)], lambda b, q: (0.5 + 0.02 * b * q) * MS)
    c.profile(DRAFT, [(b, 1) for b in range(1, batch + 1)], lambda b, w: 0.02 * b * MS)
    return c


def _mixed_batch(acceptance: AcceptanceTracker, good: int, poor: int) -> list[str]:
    """`good` requests whose 8-deep drafts were all accepted, `poor` ones whose drafts all failed."""
    for _ in range(30):
        for i in range(good):
            acceptance.observe(f"good{i}", 1, drafted=8, accepted=8)
        for i in range(poor):
            acceptance.observe(f"poor{i}", 1, drafted=8, accepted=0)
    return [f"good{i}" for i in range(good)] + [f"poor{i}" for i in range(poor)]


def test_eager_verify_gives_a_mixed_batch_per_request_depths_that_beat_every_static_tier():
    """Eager (no CUDA graph), a pass costs by its tokens: the predictable requests draft the full
    depth, those whose drafts keep failing draft nothing (a decode row), and that step's predicted
    goodput beats every tier run the static way (every request at the tier's depth) and decoding."""
    acceptance = AcceptanceTracker(8)
    ids = _mixed_batch(acceptance, 4, 12)
    costs = _eager_costs(16)
    policy = _ngram_policy(costs, shapes=VerifyShapes())
    policy.acceptance = acceptance
    decision = policy.decide(ids)
    assert decision.tier == Tier.chain(8)
    assert decision.steps == {**dict.fromkeys(ids[:4], 8), **dict.fromkeys(ids[4:], 0)}
    # priced by its tokens: 4 x 9 + 12 x 1, and 4 lookups
    seconds = (0.5 + 0.02 * 48) * MS + 0.02 * 4 * MS
    tokens = sum(expected_tokens(acceptance.rates(r, 1), decision.steps[r]) for r in ids)
    assert decision.predicted_goodput == pytest.approx(tokens / seconds)

    def static(tier: Tier) -> float:
        made = sum(expected_tokens(acceptance.rates(r, 1), tier.num_steps) for r in ids)
        return made / policy.step_seconds(tier, 16)

    assert all(decision.predicted_goodput > 1.4 * static(t) for t in policy.tiers), {
        t.name: static(t) for t in policy.tiers
    }


def test_a_graphed_verify_prices_the_bucket_so_narrower_rows_draft_the_full_depth():
    """Through a CUDA graph every row is padded to the widest: a narrower row saves nothing, so every
    request drafts the tier's depth, and the pass costs its bucket whatever the tokens."""
    acceptance = AcceptanceTracker(8)
    ids = _mixed_batch(acceptance, 4, 12)
    policy = _ngram_policy(_eager_costs(16), shapes=GRAPHED)
    policy.acceptance = acceptance
    decision = policy.decide(ids)
    assert set(decision.steps.values()) == {decision.tier.num_steps}
    assert policy.verify_seconds(16, 16 + 4 * 8, 8) == policy.verify_seconds(16, 16 * 9, 8)
    assert policy.verify_seconds(16, 16 + 4 * 3, 3) == pytest.approx((0.5 + 0.02 * 16 * 5) * MS)  # bucket 5
    assert policy.verify_seconds(80, 80 + 4 * 8, 8) < policy.verify_seconds(80, 80 * 9, 8)  # past it: eager


def test_a_request_given_no_draft_drafts_again_now_and_then():
    """Unverified, a request's estimates never move: every `probe_every` speculative steps it drafts
    the tier's depth once, so a text that turned predictable is seen."""
    acceptance = AcceptanceTracker(8)
    ids = _mixed_batch(acceptance, 4, 2)
    policy = _ngram_policy(_eager_costs(6), shapes=VerifyShapes(), probe_every=4)
    policy.acceptance = acceptance
    for _ in range(MIN_SAMPLES):  # a plain step measured: no off probe
        policy.costs.observe(VERIFY, 6, 1, policy.step_seconds(OFF, 6))
    poor = [policy.decide(ids).steps["poor0"] for _ in range(8)]
    assert poor == [0, 0, 0, 8, 0, 0, 0, 8]


def test_nobody_waiting_judges_tiers_by_when_the_batch_finishes():
    """Issue 9, MT-Bench at batch 16: speculation raised a step's tokens per second (a few requests
    drafting long matches) but the batch finished later: its slowest requests made ~1 token a
    step at 1.6x a decode step's cost, and the tail of the batch ran thin. With requests waiting
    (one that finishes makes room) goodput decides: speculate. With none: the drain: decode."""
    c = StepCosts()
    c.profile(VERIFY, [(16, q) for q in (1, 2, 3, 5, 9)], lambda b, q: (1.3 if q == 1 else 2.0) * MS)
    c.profile(DRAFT, [(16, 1)], lambda b, w: 0.1 * MS)
    acceptance = AcceptanceTracker(8)
    ids = _mixed_batch(acceptance, 4, 12)
    policy = _ngram_policy(c, shapes=GRAPHED, patience=1)
    policy.acceptance = acceptance
    assert policy.decide(ids).tier == Tier.chain(8)
    left = [200] * 16
    for _ in range(2):
        decision = policy.decide(ids, left)
    assert policy.current == OFF and decision.tier == OFF
    assert policy.diagnostics()["objective"] == "drain"
    # the good requests far behind (the poor ones nearly done): the drain speculates again
    for _ in range(2):
        policy.decide(ids, [200] * 4 + [3] * 12)
    assert policy.current == Tier.chain(8)


def test_drain_depths_keep_each_request_within_the_slowest_ones_steps():
    """Eager and nobody waiting: the request that finishes last drafts the full depth, the others
    the least that keeps them within its steps (none where they finish anyway)."""
    acceptance = AcceptanceTracker(8)
    ids = _mixed_batch(acceptance, 2, 1)
    policy = _ngram_policy(_eager_costs(3), shapes=VerifyShapes())
    policy.acceptance = acceptance
    prefix = {r: [expected_tokens(acceptance.rates(r, 1), d) for d in range(9)] for r in ids}
    left = [100, 30, 100]  # good0 behind, good1 nearly done, poor0 far behind but hopeless
    steps = policy._score(tuple(ids), left).depths[Tier.chain(8)]
    horizon = max(r / prefix[i][8] for i, r in zip(ids, left, strict=True))  # poor0's
    assert steps[2] == 8 and steps[1] == 0  # 30 tokens at 1 a step fit within poor0's steps
    assert prefix["good0"][steps[0]] >= 100 / horizon > prefix["good0"][steps[0] - 1]


def _drain_probe(left: list[int], emitted: dict[str, int]) -> bool:
    """Whether a probe over requests a-d with `left` tokens to go, which emitted `emitted` in 1.1
    ms (a plain step: 1.0), won on the drain."""
    c = StepCosts()
    c.profile(VERIFY, [(4, q) for q in (1, 2, 3, 5, 9)], lambda b, q: 1.0 * MS)
    c.profile(DRAFT, [(4, 1)], lambda b, w: 0.1 * MS)
    policy = _ngram_policy(c, shapes=GRAPHED, probe_every=2, probe_share=1.0)
    ids = ["a", "b", "c", "d"]
    for _ in range(50):  # drafts fail: off
        for r in ids:
            policy.acceptance.observe(r, 1, 8, 0)
    tiers = []
    while len(tiers) < 2 or tiers[-1] == OFF:
        tiers.append(policy.decide(ids, left).tier)
    assert tiers[-1] != OFF  # a probe
    policy.observe_probe(sum(emitted.values()), 1.1 * MS, emitted)
    assert policy.probes == 1
    return policy.probes_won == 1


def test_a_probe_judged_by_the_drain_loses_when_the_slowest_request_made_one_token():
    """d, 30 tokens behind the rest, made one token: the batch's end did not move."""
    assert not _drain_probe([100, 100, 100, 130], {"a": 9, "b": 9, "c": 9, "d": 1})
    assert _drain_probe([100, 100, 100, 130], {"a": 1, "b": 1, "c": 1, "d": 3})


def test_a_probe_over_requests_tied_for_last_is_judged_by_their_mean():
    """At a batch's start every request is tied at its max_new_tokens: any could end last, and
    their mean tokens say what the probe did for the end (7 a request here, against the 1.1 a plain
    step would have made in its time); by the least of them (d's 1) a probe there almost never won.
    Requests a step could leave last count as tied (within the tier's query length of the most)."""
    assert _drain_probe([100] * 4, {"a": 9, "b": 9, "c": 9, "d": 1})
    assert not _drain_probe([100] * 4, {"a": 1, "b": 1, "c": 1, "d": 1})
    assert _drain_probe([100, 100, 100, 108], {"a": 9, "b": 9, "c": 9, "d": 1})


def test_depth_functions_on_hand_made_prefixes():
    """`goodput_depths` against brute force over every depth vector; `drain_depths` by hand."""
    import itertools

    sure = [1.0, 2.0, 3.0, 4.0]  # every draft accepted
    hopeless = [1.0, 1.05, 1.06, 1.06]
    middling = [1.0, 1.9, 2.5, 2.7]
    prefixes = [sure, hopeless, middling]

    def seconds(depths: list[int]) -> float:
        return 1.0 + 0.1 * sum(depths) + 0.05 * sum(1 for d in depths if d)

    depths, rate = goodput_depths(prefixes, 3, seconds, per_token=0.1, per_request=0.05)
    brute = max(
        itertools.product(range(4), repeat=3),
        key=lambda d: sum(p[i] for p, i in zip(prefixes, d, strict=True)) / seconds(list(d)),
    )
    assert tuple(depths) == brute == (3, 0, 2)
    assert rate == pytest.approx((4.0 + 1.0 + 2.5) / seconds(depths))
    # the steps at full depth: 27 / 2.7 = 10 (middling's); sure needs 25 / 10 tokens a step (depth
    # 2), hopeless finishes its 9 anyway
    assert drain_depths(prefixes, [25, 9, 27], 3) == [2, 0, 3]


@pytest.mark.parametrize("loop_priced", [True, False])
def test_a_probe_of_a_tier_its_steady_steps_priced_is_judged_at_that_price(loop_priced):
    """Batch 64, off: a probe of a device-loop tier runs synchronously at several times what its loop
    steps cost (the H200, mixed prompts: 5.5 against 2.1 ms for the 2-chain). Judged on its own time,
    every probe lost and the policy stayed off beside static chains making 1.2-1.4x plain; judged at
    the price its steady steps measured, one whose drafts were all accepted wins. A tier priced only
    by its profile is still judged on the probe's time (priced too cheap, probes won wrongly)."""
    costs = StepCosts()
    costs.profile(VERIFY, [(64, 1), (64, 2)], lambda b, q: 2.5 * MS)  # the same price either way
    costs.profile(DRAFT, [(64, 1)], lambda b, w: 1e-6)  # on the device, inside a loop step
    for _ in range(MIN_SAMPLES):
        costs.observe(DECODE, 64, 1, 2.3 * MS)
        if loop_priced:
            costs.observe(VERIFY, 64, 2, 2.5 * MS, rows=True)
    acceptance = AcceptanceTracker(1, prior=0.05, strength=50.0)  # off is the better bet
    policy = AdaptivePolicy(
        [OFF, Tier.chain(1)],
        costs,
        acceptance,
        overlapped_off=True,
        draft_per_step=False,
        probe_every=1,
        probe_share=1.0,
    )
    ids = [f"r{i}" for i in range(64)]
    decisions = [policy.decide(ids) for _ in range(3)]
    assert policy.current == OFF
    assert any(d.tier == Tier.chain(1) for d in decisions)  # a probe
    policy.observe_probe(128, 10 * MS)  # every draft accepted, in a synchronous step of 10 ms
    assert (policy.probes, policy.probes_won) == (1, 1 if loop_priced else 0)


def test_the_drain_forecasts_a_request_s_end_with_the_pool_weighed_as_drain_strength_says():
    """16 requests tied at 200 tokens to go, the pool's first position at ~0.35, one request's last 10
    drafts rejected. Its own evidence (10 verifies against the prior's 2) says ~1.08 tokens a
    1-chain step, which at 1.06 ms against a plain step's 0.92 ends the batch later than decoding:
    off. That evidence is its last ~10 verifies; its end lies ~200 ahead, over which its text turns
    as the pool's does: weighed as 20 observations there, the pool makes it ~1.26 and the 1-chain
    ends the batch first. A step's goodput is read as before."""
    c = StepCosts()
    c.profile(VERIFY, [(16, 1), (16, 2)], lambda b, q: {1: 0.92, 2: 1.06}[q] * MS)
    c.profile(DRAFT, [(16, 1)], lambda b, w: 1e-6)
    ids = [f"r{i}" for i in range(15)] + ["slow"]

    def scores(drain_strength: float | None) -> tuple[dict[Tier, float], dict[Tier, float]]:
        acceptance = AcceptanceTracker(1, pooled_alpha=0.001)
        for i in range(300):
            acceptance.observe(ids[i % 15], 1, drafted=1, accepted=int(i % 20 < 7), batch=16)
        for _ in range(10):
            acceptance.observe("slow", 1, drafted=1, accepted=0, batch=16)
        policy = AdaptivePolicy(
            [OFF, Tier.chain(1)],
            c,
            acceptance,
            shapes=VerifyShapes((1, 2), 16),
            drain_strength=drain_strength,
        )
        scored = policy._score(tuple(ids), [200] * 16)
        return scored.score, scored.goodput

    (score, goodput), (forecast, same) = scores(None), scores(20.0)
    assert score[OFF] > score[Tier.chain(1)]
    assert forecast[Tier.chain(1)] > forecast[OFF]
    assert same == goodput


def test_a_thinned_drain_prices_each_stretch_at_the_requests_still_running():
    """Requests ending after 2, 4, 8 and 8 steps, a step over n running costing n ms: 2 steps of 4,
    2 of 3, 4 of 2, where the whole batch's price for all 8 steps makes 32."""
    ms = thinned_drain_seconds([1.0, 1.0, 2.0, 4.0], [2, 4, 16, 32], lambda n: n * MS)
    assert ms == pytest.approx(2 * 4 * MS + 2 * 3 * MS + 4 * 2 * MS)
    assert thinned_drain_seconds([1.0] * 3, [5, 5, 5], lambda n: {1: 0, 2: 0, 3: 2 * MS}[n]) == pytest.approx(
        10 * MS
    )
    # priced by the graph sizes a step pads to (the engine's buckets, here up to 21): each asked once,
    # the sum as over every count
    shapes = VerifyShapes((1, 2), 21, (1, 2, 4, 8, 16, 21))
    assert [shapes.padded(n) for n in (1, 3, 9, 17, 21, 30)] == [1, 4, 16, 21, 21, 30]
    assert VerifyShapes().padded(5) == 5  # no graphs: the batch as it is
    rng = random.Random(3)
    tokens, left = [rng.uniform(1, 3) for _ in range(21)], [rng.randrange(10, 200) for _ in range(21)]
    asked: list[int] = []

    def price(n: int) -> float:
        asked.append(n)
        return (0.5 + 0.03 * shapes.padded(n)) * MS

    ends = sorted(r / t for t, r in zip(tokens, left, strict=True))
    each = sum((e - b) * price(21 - j) for j, (b, e) in enumerate(zip([0.0, *ends[:-1]], ends, strict=True)))
    asked.clear()
    assert thinned_drain_seconds(tokens, left, price, shapes.padded) == pytest.approx(each)
    assert asked == [1, 2, 3, 5, 9, 17]


def test_with_drain_thinning_a_slow_requests_tail_is_priced_at_a_small_batch():
    """15 requests accepting ~0.9 of their 1-chain drafts and one whose last 10 were rejected
    (~1.2 tokens a step), 200 tokens to go each. Priced at the whole batch's 1.15 ms a step until
    the slow one ends (~166 steps), the 1-chain ends the batch later than decoding at 0.92 ms: off.
    Its 15 fast requests end at ~101 steps, after which the slow one runs alone, at batch 1's 0.5
    ms: the 1-chain ends it first."""
    c = StepCosts()
    table = {(1, 1): 0.45, (1, 2): 0.5, (16, 1): 0.92, (16, 2): 1.15}
    c.profile(VERIFY, list(table), lambda b, q: table[b, q] * MS)
    c.profile(DRAFT, [(1, 1), (16, 1)], lambda b, w: 1e-6)
    ids = [f"r{i}" for i in range(15)] + ["slow"]
    acceptance = AcceptanceTracker(1, pooled_alpha=0.001)
    for i in range(300):
        acceptance.observe(ids[i % 15], 1, drafted=1, accepted=int(i % 10 < 9), batch=16)
    for _ in range(10):
        acceptance.observe("slow", 1, drafted=1, accepted=0, batch=16)

    def scores(thinning: bool) -> tuple[dict[Tier, float], dict[Tier, float]]:
        tiers = [OFF, Tier.chain(1)]
        policy = AdaptivePolicy(
            tiers, c, acceptance, shapes=VerifyShapes((1, 2), 16), drain_thinning=thinning
        )
        scored = policy._score(tuple(ids), [200] * 16)
        return scored.score, scored.goodput

    (whole, goodput), (thinned, same) = scores(False), scores(True)
    assert whole[OFF] > whole[Tier.chain(1)]
    assert thinned[Tier.chain(1)] > thinned[OFF] == pytest.approx(whole[OFF])  # all of off's end at once
    assert same == goodput  # a step's goodput as before


def test_a_batch_grown_fourfold_decides_afresh():
    """At a model drafter's margin (0.15) a 14% lead does not displace the standing tier. A batch
    four times the one the standing tier was chosen at is another regime: its best tier takes over at
    once (an engine whose tier was set at batch 2 held the 4-chain at 64, 0.87x the 3-chain, H200).
    A batch thinning in its tail and the next batch of the same size keep the margin: measured from
    the tail's least batch, every new batch of 64 decided afresh on its first step's estimates."""
    costs = StepCosts()
    costs.profile(VERIFY, [(b, q) for b in (1, 64) for q in (1, 4, 5)], lambda b, q: 1.0 * MS)
    tiers = [OFF, Tier.chain(3), Tier.chain(4)]
    lead = {OFF: 0.0, Tier.chain(3): 1.14, Tier.chain(4): 1.0}
    policy = AdaptivePolicy(tiers, costs, AcceptanceTracker(4), hysteresis=0.15)

    def at(batch: int, scores: dict[Tier, float]) -> Tier:
        policy.last_batch = batch
        policy._update(max(scores, key=scores.get), scores)
        return policy.current

    assert at(2, {**lead, Tier.chain(4): 2.0}) == Tier.chain(4)  # chosen at batch 2
    assert [at(b, lead) for b in (2, 3, 2, 1, 2)] == [Tier.chain(4)] * 5  # within the margin
    assert at(0, lead) == Tier.chain(4)  # a step of prefills alone: no batch to decide for
    assert at(8, lead) == Tier.chain(3)  # four times batch 2: afresh
    back = {**lead, Tier.chain(4): 1.1}
    assert [at(b, back) for b in (16, 12, 8, 2, 1, 16)] == [Tier.chain(3)] * 6  # under 32: the margin holds
    assert at(32, {**back, Tier.chain(4): 1.2}) == Tier.chain(4)  # four times batch 8: afresh
    # Chosen at 32: its tail thins to 1 and the next batch of 32 keeps the margin
    assert [at(b, lead) for b in (32, 8, 2, 1, 32, 32)] == [Tier.chain(4)] * 6
    assert policy.switches == 2
