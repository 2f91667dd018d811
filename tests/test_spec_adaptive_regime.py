"""Issue 9, thirteenth H100 run: a loop tier priced by its own steps, and a new batch re-decided.

The EAGLE-3 head's loop at batch 64: its 1-chain's gap over the profile, taken per query row, priced
the 3-chain at 2.39 ms where the 3-chain's own steps had measured 1.71 (the head loop's gap is mostly
per step), and the policy left it. And a tier carried from batch 16 into batch 64 waited out
`patience` there on a streak of wins earned at batch 16. No wall clock is read.
"""

from __future__ import annotations

import pytest

from specserve.spec.acceptance import AcceptanceTracker
from specserve.spec.adaptive import REDECIDE_RATIO, AdaptivePolicy, Tier
from specserve.spec.step_costs import VERIFY, StepCosts

MS = 1e-3
PROFILE = {2: 0.87, 3: 0.92, 4: 0.97, 5: 1.02}  # head loop steps at batch 64, no context


def _head_costs() -> StepCosts:
    costs = StepCosts()
    costs.profile(VERIFY, [(64, q) for q in PROFILE], lambda b, q: PROFILE[q] * MS)
    return costs


def test_a_loop_width_that_ran_lately_is_priced_by_its_own_steps():
    costs = _head_costs()
    for _ in range(6):  # the 1-chain: a gap of 0.6 ms, mostly per step
        costs.observe(VERIFY, 64, 2, 1.47 * MS, rows=True)
    assert costs.estimate(VERIFY, 64, 4) == pytest.approx((0.97 + 2 * 0.6) * MS)  # per row: unmeasured
    for _ in range(2):  # the 3-chain's own steps
        costs.observe(VERIFY, 64, 4, 1.71 * MS, rows=True)
    assert costs.estimate(VERIFY, 64, 4) == pytest.approx(1.71 * MS)
    assert not costs.measured_live(VERIFY, 64, 4)  # its own price before the table's three samples


def test_a_width_not_run_lately_falls_back_to_the_rows():
    costs = _head_costs()
    for _ in range(2):
        costs.observe(VERIFY, 64, 4, 1.71 * MS, rows=True)
    for _ in range(costs.window):  # the 1-chain runs on; the 3-chain's gaps were over shorter contexts
        costs.observe(VERIFY, 64, 2, 1.47 * MS, rows=True)
    assert costs.estimate(VERIFY, 64, 4) == pytest.approx((0.97 + 2 * 0.6) * MS, rel=0.05)


def _policy() -> AdaptivePolicy:
    tiers = (Tier(0), Tier.chain(1), Tier.chain(8))
    return AdaptivePolicy(tiers, StepCosts(), AcceptanceTracker(8), hysteresis=0.05, patience=3)


def test_a_grown_batch_switches_without_waiting_for_patience():
    policy, one, eight = _policy(), Tier.chain(1), Tier.chain(8)
    policy._update(eight, {eight: 2.0, one: 1.0}, 1, 16)
    assert policy.current == eight
    scores = {eight: 1.0, one: 2.0}
    assert not policy._update(one, scores, 1, 16)  # the same batch: one win is not enough
    policy._update(eight, {eight: 2.0, one: 1.0}, 1, 16)  # the streak broken
    assert policy._update(one, scores, 1, int(16 * REDECIDE_RATIO))
    assert policy.current == one


def test_a_grown_batch_keeps_the_margin_and_a_thinning_one_keeps_patience():
    policy, one, eight = _policy(), Tier.chain(1), Tier.chain(8)
    policy._update(eight, {eight: 2.0, one: 1.0}, 1, 16)
    assert not policy._update(one, {eight: 1.0, one: 1.04}, 1, 64)  # within hysteresis: stands
    assert policy.current == eight
    # re-chosen at 64: draining to 8 requests is no new regime, patience holds
    assert not policy._update(one, {eight: 1.0, one: 2.0}, 1, 8)
    assert policy.current == eight
