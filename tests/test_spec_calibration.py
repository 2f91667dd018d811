"""Each speculative tier's predicted goodput corrected by what its steps emitted (`GoodputCalibration`),
and the policy reading the corrections: a tier whose predictions run high against what it makes
loses to one predicted lower that keeps its word."""

from __future__ import annotations

import pytest

from specserve.spec.acceptance import AcceptanceTracker, expected_prefix
from specserve.spec.adaptive import OFF, AdaptivePolicy, Tier
from specserve.spec.calibration import ChainOutcomes, GoodputCalibration, batch_class, chain_outcomes
from specserve.spec.step_costs import DECODE, DRAFT, VERIFY, StepCosts

MS = 1e-3
ONE, TWO, FOUR, EIGHT = Tier.chain(1), Tier.chain(2), Tier.chain(4), Tier.chain(8)


def test_batch_classes_are_powers_of_two():
    assert [batch_class(b) for b in (1, 2, 3, 4, 7, 8, 16, 63, 64)] == [1, 2, 2, 3, 3, 4, 5, 6, 7]


def _flat(pairs) -> list[float]:
    return [x for pair in pairs for x in pair]


def test_a_chain_verify_says_what_every_chain_would_have_made_of_its_draft():
    prefix = expected_prefix([0.5, 0.8, 0.5, 0.5])  # 1, 1.5, 1.9, 2.1, 2.2
    depths = [1, 2, 4]
    # a 2-chain draft, its first token kept: a 1-chain keeps it too, a 4-chain stops where it did
    assert _flat(chain_outcomes(prefix, [(2, 1)], depths)) == pytest.approx([2, 1.5, 2, 1.9, 2, 2.2])
    # both kept: past them the 4-chain is promised what its estimates promise given those two
    (_, _), (_, _), (made, promised) = chain_outcomes(prefix, [(2, 2)], depths)
    assert (made, promised) == pytest.approx((3 + (2.2 - 1.9) / 0.4, 2.2))
    # a draft kept whole that its estimates gave no hope says nothing of deeper chains
    hopeless = expected_prefix([0.005, 0.5])
    assert _flat(chain_outcomes(hopeless, [(1, 1), (1, 0)], [1, 2])) == pytest.approx([3, 2.01, 1, 1.0075])
    outcomes = ChainOutcomes(depths)
    outcomes.add(prefix, [(2, 1)])
    outcomes.add(prefix, [(4, 0), (0, 0)])  # no draft: nothing to judge
    taken = outcomes.take()
    assert _flat(taken[d] for d in depths) == pytest.approx([3, 3.0, 3, 3.8, 3, 4.4])
    assert outcomes.take() == {}


def _observe(cal: GoodputCalibration, tier: Tier, share: float, times: int = 1, batch: int = 16) -> None:
    """`times` steady steps of `tier` that each made `share` of the tokens promised."""
    for _ in range(times):
        cal.observe(tier, batch, tokens=100 * share, seconds=0.01, predicted_goodput=10_000)


def _neutral(cal: GoodputCalibration, factors: dict, batch: int = 16) -> float:
    """The corrections' mean weighed by each tier's evidence: 1 when they move speculation as a
    whole neither up nor down against speculation off."""
    weights = {t: w for t in factors if (w := cal.weight(t, batch))}
    return sum(factors[t] * w for t, w in weights.items()) / sum(weights.values())


def test_corrections_are_relative_to_the_tiers_measured_beside():
    cal = GoodputCalibration(fade=0.5, idle_fade=1.0)
    assert cal.factors([TWO, EIGHT], 16) == {TWO: 1.0, EIGHT: 1.0}  # nothing measured
    _observe(cal, TWO, 0.9, times=20)
    assert cal.factors([TWO, EIGHT], 16) == pytest.approx({TWO: 1.0, EIGHT: 1.0})  # alone: not corrected
    _observe(cal, EIGHT, 0.6, times=20)
    factors = cal.factors([TWO, EIGHT], 16)
    assert factors[EIGHT] < 1.0 < factors[TWO]
    assert factors[EIGHT] / factors[TWO] == pytest.approx(0.75, abs=0.06)  # 0.6 / 0.9, less trust
    assert _neutral(cal, factors) == pytest.approx(1.0)
    assert cal.factors([TWO, EIGHT, FOUR], 20)[FOUR] == 1.0  # unmeasured: its own
    assert cal.factors([TWO, EIGHT], 64) == {TWO: 1.0, EIGHT: 1.0}  # another batch class
    # the evidence fades per step of the tier: the 8-chain keeping its word lately lifts it back
    _observe(cal, EIGHT, 0.9, times=20)
    assert cal.factors([TWO, EIGHT], 16)[EIGHT] == pytest.approx(1.0, abs=0.01)
    assert cal.snapshot()["8@16"] == pytest.approx(0.9, abs=0.01)


def test_one_lucky_step_does_not_score_the_measured_tiers_down():
    """The H200's mixed batch 64: one step of the 8-chain, priced by its profile, made 1.53x its
    promise; as the reference (the best ratio) it scored the 1-chain, which kept its word over many
    steps, down to 0.65 and the policy went off. Weighed by its evidence it moves it a little."""
    cal = GoodputCalibration(idle_fade=1.0)
    _observe(cal, ONE, 1.0, times=40, batch=64)
    _observe(cal, EIGHT, 1.53, batch=64)
    factors = cal.factors([ONE, TWO, EIGHT], 64)
    assert factors[ONE] > 0.9
    assert factors[EIGHT] < 1.53 * factors[ONE] * 0.9
    assert factors[TWO] == 1.0
    assert _neutral(cal, factors, 64) == pytest.approx(1.0)


def test_a_correction_not_renewed_wears_off():
    cal = GoodputCalibration(fade=0.5, idle_fade=0.9)
    _observe(cal, EIGHT, 0.5, times=10)
    _observe(cal, TWO, 1.0, times=10)
    fresh = cal.factors([TWO, EIGHT], 16)[EIGHT]
    _observe(cal, TWO, 1.0)
    assert fresh < cal.factors([TWO, EIGHT], 16)[EIGHT] < 1.0
    _observe(cal, TWO, 1.0, times=60)
    assert cal.factors([TWO, EIGHT], 16)[EIGHT] == pytest.approx(1.0, abs=0.01)
    assert cal.factors([TWO, EIGHT], 64)[EIGHT] == 1.0


def test_a_correction_is_bounded_and_a_fade_must_forget():
    cal = GoodputCalibration(idle_fade=1.0)
    for _ in range(30):
        cal.observe(TWO, 1, tokens=1000, seconds=0.01, predicted_goodput=1.0)
        cal.observe(EIGHT, 1, tokens=0, seconds=0.01, predicted_goodput=1000.0)
    assert cal.snapshot() == {"2@1": 2.0, "8@1": 0.25}  # each ratio held within [0.25, 2]
    factors = cal.factors([TWO, EIGHT], 1)
    assert factors[TWO] / factors[EIGHT] > 4  # the ratios' 8x, less the trust they lack
    assert all(0.25 <= f <= 2.0 for f in factors.values())
    version = cal.version
    cal.observe(EIGHT, 1, tokens=5, seconds=0.0, predicted_goodput=1000.0)  # no time: no evidence
    assert cal.version == version
    with pytest.raises(ValueError, match="fade"):
        GoodputCalibration(fade=1.0)
    with pytest.raises(ValueError, match="idle_fade"):
        GoodputCalibration(idle_fade=0.0)


def _policy(calibration: GoodputCalibration | None) -> AdaptivePolicy:
    """Batch 16, every request's drafts right at 0.8 a position, launch-bound passes: the 8-chain is
    predicted best (4.57 tokens in 1.225 ms; the 4-chain 3.36 in 1.125)."""
    costs = StepCosts(alpha=0.0)
    costs.profile(VERIFY, [(16, q) for q in (1, 2, 3, 5, 9)], lambda b, q: (1.0 + 0.025 * q) * MS)
    costs.profile(DECODE, [(16, 1)], lambda b, q: 1.0 * MS)
    costs.profile(DRAFT, [(16, 1)], lambda b, w: 1e-6)
    acceptance = AcceptanceTracker(8, prior=0.8, strength=1e6)  # the estimates stay at 0.8
    tiers = [OFF, Tier.chain(1), TWO, FOUR, EIGHT]
    return AdaptivePolicy(tiers, costs, acceptance, draft_per_step=False, calibration=calibration)


def test_the_policy_leaves_a_tier_that_makes_less_than_it_promised():
    ids = [f"r{i}" for i in range(16)]
    assert _policy(None).decide(ids).tier == EIGHT
    policy = _policy(GoodputCalibration())
    policy.acceptance.observe(ids[0], 1, drafted=8, accepted=8)  # a batch that verified (no change: 1e6)

    def run(tier: Tier, share: float, times: int = 1) -> None:
        """`times` steps of `tier` that each made `share` of the tokens predicted for it."""
        goodput = policy.goodput(tier, ids)
        for _ in range(times):
            policy.observe_outcome(tier, 16, share * goodput * 0.01, 0.01, goodput)

    # Alone, a tier is not corrected: speculation off is never, and an error every tier shares
    # must not move them against it.
    run(EIGHT, 0.7, times=10)
    assert policy.decide(ids).tier == EIGHT
    # The 4-chain ran too (the policy went back and forth) and made what it promised, the 8-chain
    # 70% of it (say its deep positions were overrated): the 4-chain from then on.
    run(FOUR, 1.0, times=10)
    tiers = [policy.decide(ids).tier for _ in range(8)]
    assert tiers[-4:] == [FOUR] * 4, tiers
    assert policy.diagnostics(16)["calibration"] == {"4@16": 1.0, "8@16": 0.7}
    assert _policy(None).decide(ids).tier == EIGHT  # uncorrected it would have stayed
