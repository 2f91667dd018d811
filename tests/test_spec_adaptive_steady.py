"""Adaptive speculation's cost tables learn from steady steps only (issue 9, the sixth H100 run).

Each case scripts the step times the engine hands `AdaptiveSpeculation.observe_step` (its phases, as
`Engine.step` times them) in the shape the H100 run showed, and checks the price the policy ends up
with: a prefill settled inside a run's first plain step, probes that pay for leaving the overlapped
pipeline, a one-off cost in the few steps of a warm-up. No wall clock is read.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specserve.config import SpeculativeConfig
from specserve.engine.adaptive_control import AdaptiveSpeculation
from specserve.engine.stats import StepStats
from specserve.spec.acceptance import AcceptanceTracker
from specserve.spec.adaptive import OFF, OFF_PROBE_STEPS, AdaptivePolicy, Tier, default_tiers
from specserve.spec.step_costs import DECODE, DRAFT, MIN_SAMPLES, VERIFY, StepCosts

MS = 1e-3
CHAIN8 = Tier.chain(8)


def _control(tiers: list[tuple[int, int, int]]) -> AdaptiveSpeculation:
    spec = SpeculativeConfig.from_value(
        {"method": "ngram", "num_steps": 8, "adaptive": {"profile": False, "tiers": tiers}}
    )
    control = AdaptiveSpeculation(spec)
    control.overlapped_off = True  # plain steps overlapped, as on the GPU
    return control


def _requests(batch: int) -> list[SimpleNamespace]:
    params = SimpleNamespace(max_new_tokens=10_000)
    return [
        SimpleNamespace(request_id=f"r{i}", params=params, num_output=0, prompt_len=16) for i in range(batch)
    ]


def _step(
    control: AdaptiveSpeculation,
    reqs: list[SimpleNamespace],
    wall_ms: float,
    settle_ms: float = 0.0,
    draft_ms: float = 0.0,
    prefill: bool = False,
) -> Tier:
    """One engine step over `reqs` (a prefill of all of them, or their decode/verify) whose phases
    took these ms; returns the tier it ran."""
    if prefill:
        control.decide([])  # nothing decodes yet: the standing tier stays
        items = [SimpleNamespace(num_known=100, completes=True, num_tokens=100) for _ in reqs]
    else:
        control.decide(reqs)
        items = []
        for req in reqs:
            depth = 0 if control.tier.off else control.steps_for(req)
            if depth:
                control.drafting(req, depth)
                control.observe_verify(req, depth)  # every draft accepted: acceptance is not at issue
            items.append(SimpleNamespace(num_known=1, completes=True, num_tokens=depth + 1))
    stats = StepStats()
    stats.phases = {"step": wall_ms * MS, "draft": draft_ms * MS}
    if settle_ms:
        stats.phases["settle"] = settle_ms * MS
    stats.generation_tokens = len(reqs)
    control.observe_step(items, stats)
    return control.tier


def test_a_prefill_settled_inside_a_run_s_first_plain_step_does_not_price_plain_steps():
    """MT-Bench at batch 16 on the H100: each run starts with the prompts' prefill, launched
    overlapped; the first plain step then waits for it, and its wall (the prefill's device time) was
    filed as a batch-16 plain step: priced 4.11 ms against 1.19 steady. Neither that step nor the
    first one at a new batch (the wait for a step of the old batch) may set the price."""
    control = _control([(0, 1, 0)])  # speculation off only: every step a plain one
    reqs = _requests(16)
    _step(control, reqs, 0.15, prefill=True)  # launched: the host waits for nothing yet
    assert _step(control, reqs, 10.0) == OFF  # the prefill's 10 ms, settled inside this step
    _step(control, reqs, 1.19)
    assert not control.costs.measured_live(DECODE, 16, 1)  # one steady step is not a price yet
    for _ in range(MIN_SAMPLES):
        _step(control, reqs, 1.19)
    assert control.costs.estimate(DECODE, 16, 1) == pytest.approx(1.19 * MS)
    _step(control, reqs[:15], 1.19)  # a request left: this step waited for a batch-16 one
    assert not control.costs.measured_live(DECODE, 15, 1)
    for _ in range(MIN_SAMPLES):
        _step(control, reqs[:15], 1.15)
    assert control.costs.estimate(DECODE, 15, 1) == pytest.approx(1.15 * MS)
    # a new run: its prefill, then the step that settles it; the price stands
    _step(control, reqs, 0.15, prefill=True)
    _step(control, reqs, 10.0)
    assert control.costs.estimate(DECODE, 16, 1) == pytest.approx(1.19 * MS)
    d = control.diagnostics(16)
    assert d["steady_step_ms"]["off"] == pytest.approx(1.19)
    assert d["transition_steps"]["off"] == 2 and d["transition_step_ms"]["off"] == pytest.approx(10.0)


def test_probes_that_pay_for_leaving_the_pipeline_do_not_price_the_tier():
    """MT-Bench at batch 1 on the H100: the static 8-chain steps took 1.34 ms, but the policy priced
    the 8-chain at 2.01 ms from its probes (steps right after overlapped plain steps: their settle,
    and more), judged speculation no better than decoding and stayed off. Transitions must leave
    the price to the profile until steady steps measure it, and then to those."""
    control = _control([(8, 1, 8)])
    control.costs.profile(VERIFY, [(1, 9)], lambda b, q: 1.0 * MS)
    control.costs.profile(DRAFT, [(1, 1)], lambda b, w: 0.03 * MS)
    reqs = _requests(1)
    _step(control, reqs, 0.8, prefill=True)
    for _ in range(4):  # only transitions: each settles a plain step (0.7 ms) and pays 0.6 ms more
        assert _step(control, reqs, 0.7 + 1.94, settle_ms=0.7, draft_ms=0.03) == CHAIN8
    assert control.policy.step_seconds(CHAIN8, 1) == pytest.approx(1.03 * MS)  # the profile, not 1.94
    for _ in range(3):  # a stretch on the 8-chain: its first step a transition, then steady ones
        _step(control, reqs, 0.7 + 1.94, settle_ms=0.7, draft_ms=0.03)
        for _ in range(MIN_SAMPLES):
            _step(control, reqs, 1.34, draft_ms=0.03)
    assert control.policy.step_seconds(CHAIN8, 1) == pytest.approx(1.34 * MS)
    d = control.diagnostics(1)
    assert d["steady_step_ms"]["8"] == pytest.approx(1.34) and d["transition_step_ms"]["8"] == pytest.approx(
        1.94
    )


def test_a_one_off_cost_in_a_short_warm_up_does_not_price_the_next_batch():
    """The bench warms each engine up with two prompts and a few tokens; a one-off cost in one of
    those verifies, taken whole as batch 2's residual (the first gap counted whole), priced every
    tier at batch 1 (the nearest batch) at several times its cost, and none ran there to correct
    it (`scripts/adaptive_sim.py`, MT-Bench batch 1: 0.66x the best static, as on the H100). A
    residual now waits for a few steady gaps and leaves out those over twice their median."""
    costs = StepCosts()
    costs.profile(VERIFY, [(b, q) for b in (1, 2) for q in (1, 9)], lambda b, q: 1.0 * MS)
    costs.observe(VERIFY, 2, 9, 6.0 * MS)  # the warm-up's one-off
    assert costs.estimate(VERIFY, 1, 9) == pytest.approx(1.0 * MS)  # a lone gap is no residual
    costs.observe(VERIFY, 2, 9, 1.3 * MS)
    costs.observe(VERIFY, 2, 9, 1.3 * MS)
    assert costs.residual(VERIFY, 2) == pytest.approx(0.3 * MS)
    assert costs.estimate(VERIFY, 1, 9) == pytest.approx(1.3 * MS)
    assert costs.estimate(VERIFY, 1, 1) == pytest.approx(1.3 * MS)


def test_transitions_fill_in_only_a_shape_nothing_else_prices():
    """Without a profile (`profile: false`, a hybrid model) a transition's measurement is better than
    the default; a steady one replaces it, and then transitions no longer count."""
    costs = StepCosts()
    costs.observe(VERIFY, 4, 5, 3.0 * MS, steady=False)
    assert costs.estimate(VERIFY, 4, 5) == pytest.approx(3.0 * MS)
    assert not costs.measured_live(VERIFY, 4, 5)
    for _ in range(MIN_SAMPLES):
        costs.observe(VERIFY, 4, 5, 1.5 * MS)
    costs.observe(VERIFY, 4, 5, 9.0 * MS, steady=False)
    assert costs.estimate(VERIFY, 4, 5) == pytest.approx(1.5 * MS)
    costs.profile(VERIFY, [(8, 9)], lambda b, q: 2.0 * MS)
    costs.observe(VERIFY, 8, 9, 7.0 * MS, steady=False)  # profiled: the transition says nothing
    assert costs.estimate(VERIFY, 8, 9) == pytest.approx(2.0 * MS)


def _eight_chain_policy(costs: StepCosts) -> AdaptivePolicy:
    """An n-gram policy over overlapped plain steps, its 8-chain standing on long matches."""
    policy = AdaptivePolicy(
        default_tiers(8),
        costs,
        AcceptanceTracker(8),
        draft_per_step=False,
        overlapped_off=True,
        probe_every=8,
    )
    for _ in range(20):
        policy.acceptance.observe("a", 1, 8, 8)
    return policy


def test_plain_steps_run_in_a_row_while_speculating_until_one_is_priced():
    """An overlapped plain step's wall is the wait for the step before, so a lone plain step among
    speculative ones (a transition) never measures one: `_probe_off` runs `OFF_PROBE_STEPS` in a
    row, every `probe_every` steps, until a plain step at the batch has a price."""
    costs = StepCosts()
    costs.profile(VERIFY, [(1, q) for q in (1, 2, 3, 5, 9)], lambda b, q: 1.1 * MS)
    costs.profile(DRAFT, [(1, 1)], lambda b, w: 0.02 * MS)
    policy = _eight_chain_policy(costs)
    tiers = [policy.decide(["a"]).tier for _ in range(24)]
    assert tiers[0] == CHAIN8
    runs = "".join("o" if t.off else "s" for t in tiers).split("s")
    assert [len(r) for r in runs if r] == [OFF_PROBE_STEPS] * 2
    for _ in range(MIN_SAMPLES):
        costs.observe(DECODE, 1, 1, 0.7 * MS)
    assert all(not policy.decide(["a"]).tier.off for _ in range(24))


def test_no_rows_of_plain_steps_where_off_runs_in_a_device_loop():
    """N-gram drafting's off tier has a device loop of its own (plain decoding's): a row of plain
    steps would run synchronously, and a loop tier's synchronous steps price nothing, so it measured
    nothing and came back every `probe_every` steps (on the H200 at batch 64, breaking the chain's
    run each time). None runs; the 8-chain stands as above, without the rows."""
    costs = StepCosts()
    costs.profile(VERIFY, [(1, q) for q in (1, 2, 3, 5, 9)], lambda b, q: 1.1 * MS)
    costs.profile(DRAFT, [(1, 1)], lambda b, w: 0.02 * MS)
    policy = _eight_chain_policy(costs)
    policy.overlapped_off = False  # off is its loop's, priced as a one-token verify
    policy.switch_on_device = frozenset({0, 1, 2, 4, 8})  # what the engine's loops make it
    tiers = [policy.decide(["a"]).tier for _ in range(48)]
    assert tiers[0] == CHAIN8 and not any(t.off for t in tiers)
    policy.switch_on_device = frozenset({1, 2, 4, 8})  # a head's engine: off has no loop
    assert any(policy.decide(["a"]).tier.off for _ in range(24))


def test_the_engines_loops_reach_the_policy_off_included():
    """`looped_chains` (the engine's loops by chain length, 0 for plain decoding's) is what the
    policy's switches and its rows of plain steps go by."""
    control = _control([(0, 1, 0), (1, 1, 1), (8, 1, 8)])
    control.looped_chains = frozenset({0, 1, 8})
    assert control.policy.switch_on_device == frozenset({0, 1, 8})


def test_plain_steps_priced_at_a_batch_of_the_class_stop_the_rows_of_plain_steps():
    """A batch thins in its tail, a few steps at each size: a plain step's price at 60 serves 50 (one
    class, 32-63, whose other sizes the cost tables price from it), while 20 still gets its rows."""
    costs = StepCosts()
    costs.profile(VERIFY, [(b, q) for b in (16, 64) for q in (1, 2, 3, 5, 9)], lambda b, q: 1.1 * MS)
    costs.profile(DRAFT, [(b, 1) for b in (16, 64)], lambda b, w: 0.02 * MS)
    policy = _eight_chain_policy(costs)
    for _ in range(MIN_SAMPLES):
        costs.observe(DECODE, 60, 1, 0.9 * MS)

    def tiers(batch: int) -> list[Tier]:
        return [policy.decide([f"r{i}" for i in range(batch)]).tier for _ in range(24)]

    assert not any(t.off for t in tiers(50))
    assert any(t.off for t in tiers(20))
    assert costs.estimate(DECODE, 50, 1) == pytest.approx(0.9 * MS)  # the nearest measured: flat profile


def test_a_looped_tier_run_synchronously_does_not_price_its_loop():
    """A head's chain tier that runs in the device loop, stepped synchronously (a probe, a catch-up
    after plain steps): at batch 1 on the H100 such a step drafted for ~1 ms on the host, and the
    policy, filing that as the tier's draft cost, held the 1-chain where the 2-4 chains made 1.2x
    more. The loop's own steps price a looped tier (`observe_loop`), steady or not."""
    control = _control([(8, 1, 8)])
    control.looped_chains = frozenset({8})
    control.costs.profile(VERIFY, [(1, 9)], lambda b, q: 1.0 * MS)
    control.costs.profile(DRAFT, [(1, 1)], lambda b, w: 1e-3 * MS)
    reqs = _requests(1)
    _step(control, reqs, 0.8, prefill=True)
    for _ in range(MIN_SAMPLES + 2):
        assert _step(control, reqs, 3.0, draft_ms=1.0) == CHAIN8
    assert control.costs.estimate(VERIFY, 1, 9) == pytest.approx(1.0 * MS)
    assert control.costs.estimate(DRAFT, 1, 1) == pytest.approx(1e-3 * MS)
    for _ in range(MIN_SAMPLES):
        control.observe_loop(1, 8, 1.2 * MS)
    assert control.costs.estimate(VERIFY, 1, 9) > 1.0 * MS
    control.looped_chains = frozenset()  # without a loop the same steps are the tier's price
    for _ in range(MIN_SAMPLES + 2):
        _step(control, reqs, 3.0, draft_ms=1.0)
    assert control.costs.estimate(DRAFT, 1, 1) > 0.5 * MS
