"""Metric values after controlled runs (CPU, tiny model): speculative counts from a self-drafting
standalone drafter (every draft accepted), token and finish counters, prefix-cache hits, retractions,
phase timings, request latencies and HTTP counts; and the exposition names exactly the contract."""

from __future__ import annotations

import collections

import pytest

from specserve import LLM, SamplingParams
from specserve.metrics import (
    METRIC_NAMES,
    EngineMetrics,
    HttpMetrics,
    fleet_exposition,
    merge_expositions,
)

from api_utils import exposed_families, serve

# docs/serving.md, "The metric contract": the names dashboards/ may use.
CONTRACT = {
    "specserve_prompt_tokens_total",
    "specserve_generation_tokens_total",
    "specserve_request_finished_total",
    "specserve_retracted_requests_total",
    "specserve_prefix_cache_queries_total",
    "specserve_prefix_cache_hits_total",
    "specserve_spec_draft_tokens_total",
    "specserve_spec_accepted_tokens_total",
    "specserve_spec_accepted_tokens_per_position_total",
    "specserve_spec_verify_steps_total",
    "specserve_spec_adapt_switches_total",
    "specserve_engine_step_errors_total",
    "specserve_http_requests_total",
    "specserve_spec_accept_length",
    "specserve_time_to_first_token_seconds",
    "specserve_inter_token_latency_seconds",
    "specserve_e2e_request_latency_seconds",
    "specserve_request_queue_time_seconds",
    "specserve_step_duration_seconds",
    "specserve_num_requests_running",
    "specserve_num_requests_waiting",
    "specserve_kv_cache_usage_ratio",
    "specserve_spec_num_steps",
    "specserve_spec_topk",
    "specserve_spec_num_draft_tokens",
    "specserve_spec_ema_accept_length",
    "specserve_replica_up",
    "specserve_autoscaling_target_replicas",
}
K = 3  # draft steps


def test_exposition_names_exactly_the_contract():
    assert METRIC_NAMES >= CONTRACT
    texts = [
        EngineMetrics("m", "r1").exposition(),
        EngineMetrics("m", "r2").exposition(),
        HttpMetrics("m").exposition(),
        fleet_exposition([("m", "r1"), ("m", "r2")], {"m": 2}),
    ]
    merged = merge_expositions(texts)
    assert set(exposed_families(merged)) == METRIC_NAMES
    assert merged.count("# TYPE specserve_prompt_tokens_total counter") == 1
    assert 'specserve_prompt_tokens_total{model="m",replica="r2"} 0.0' in merged
    assert "_created" not in merged


@pytest.fixture(scope="module")
def self_draft(tiny_llama):
    """An app over an engine drafting with its own target: greedy accepts every draft."""
    spec = {"method": "standalone", "draft_model": str(tiny_llama.location.path), "num_steps": K}
    with serve(tiny_llama, speculative=spec, page_size=4) as served:
        yield served


def _accept_length_counts(m: EngineMetrics) -> list[float]:
    """Observations of each accept length 1..K+1, from the histogram's cumulative buckets."""
    cumulative = [0.0] + [
        m.sample("specserve_spec_accept_length_bucket", le=str(float(n))) for n in range(1, K + 2)
    ]
    return [cumulative[n] - cumulative[n - 1] for n in range(1, K + 2)]


def _generate(served, prompts: list[list[int]]) -> list[dict]:
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": 14, "temperature": 0, "ignore_eos": True},
    }
    response = served.http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return [o["meta_info"] for o in response.json()]


def test_speculative_and_request_metrics_after_a_self_draft_run(self_draft):
    prompts = [list(range(5, 5 + n)) for n in (9, 13, 17)]
    # The same prompt again, after the first batch: its full pages come from the prefix cache.
    metas = _generate(self_draft, prompts) + _generate(self_draft, prompts[2:])
    assert self_draft.client.wait_idle(60)
    m, n = self_draft.client.metrics, len(metas)

    verify_steps = sum(meta["spec_verify_ct"] for meta in metas)
    assert m.sample("specserve_spec_verify_steps_total") == verify_steps
    assert m.sample("specserve_spec_accept_length_count") == verify_steps
    lengths = _accept_length_counts(m)
    # Every verify emits K + 1 tokens, but a request's last may be cut short by max_new_tokens.
    assert sum(lengths[:K]) <= n and lengths[K] >= verify_steps - n
    per_request = [
        sum(meta["spec_accept_histogram"][a] for meta in metas if a < len(meta["spec_accept_histogram"]))
        for a in range(K + 1)
    ]
    assert lengths == per_request, (lengths, per_request)
    per_position = [
        m.sample("specserve_spec_accepted_tokens_per_position_total", position=str(p)) for p in range(K)
    ]
    assert per_position == sorted(per_position, reverse=True) and per_position[-1] > 0
    accepted = m.sample("specserve_spec_accepted_tokens_total")
    assert accepted == sum(per_position) == sum(meta["spec_accepted_tokens"] for meta in metas)
    assert m.sample("specserve_spec_draft_tokens_total") >= accepted
    assert m.sample("specserve_spec_num_steps") == K == m.sample("specserve_spec_num_draft_tokens")
    assert m.sample("specserve_spec_topk") == 1
    assert 1 < m.sample("specserve_spec_ema_accept_length") <= K + 1

    assert m.sample("specserve_prompt_tokens_total") == m.sample("specserve_prefix_cache_queries_total")
    assert m.sample("specserve_prompt_tokens_total") == sum(meta["prompt_tokens"] for meta in metas)
    assert m.sample("specserve_generation_tokens_total") == sum(meta["completion_tokens"] for meta in metas)
    assert m.sample("specserve_request_finished_total", finish_reason="length") == n
    hits = m.sample("specserve_prefix_cache_hits_total")
    assert hits == sum(meta["cached_tokens"] for meta in metas) >= 16  # 4 full pages of the repeat
    assert m.sample("specserve_request_queue_time_seconds_count") == n
    for phase in ("draft", "target", "postprocess", "step"):
        assert m.sample("specserve_step_duration_seconds_count", phase=phase) > 0, phase
    assert m.sample("specserve_num_requests_running") == m.sample("specserve_num_requests_waiting") == 0

    assert m.sample("specserve_time_to_first_token_seconds_count") == n
    assert m.sample("specserve_e2e_request_latency_seconds_count") == n
    # Once per token after each request's first output (the prefill's single token).
    itl = sum(meta["completion_tokens"] - 1 for meta in metas)
    assert m.sample("specserve_inter_token_latency_seconds_count") == itl


def test_metrics_route_serves_engine_and_http_metrics(self_draft):
    http = self_draft.http
    bad = {"text": "hi", "sampling_params": {"temperature": -1}}
    assert http.post("/generate", json=bad).status_code == 400
    assert http.get("/no/such/route").status_code == 404
    families = exposed_families(http.get("/metrics").text)
    assert set(families) == METRIC_NAMES  # the autoscaling target without samples: no policy here
    assert [(s.labels["replica"], s.value) for s in families["specserve_replica_up"]] == [("local", 1)]
    counts = {(s.labels["route"], s.labels["status"]): s for s in families["specserve_http_requests_total"]}
    assert counts["/generate", "400"].value >= 1
    unmatched = counts["unmatched", "404"]
    assert unmatched.value == 1 and (unmatched.labels["model"], unmatched.labels["replica"]) == (
        "tiny",
        "local",
    )


def test_finish_reasons_and_retractions_on_a_bare_engine(tiny_llama):
    """The offline engine with a sink attached: aborts, stops, lengths, and retractions under a tiny
    KV pool, counted exactly where the engine decides them."""
    llm = LLM(
        tiny_llama, device="cpu", dtype="float32", page_size=4, max_total_tokens=96, enable_prefix_cache=False
    )
    metrics = EngineMetrics("tiny")
    llm.engine.attach_stats_sink(metrics)
    prompts = [list(range(7, 7 + n)) for n in (10, 12, 14, 16)]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))
    stop = outs[0].token_ids[2]
    outs += llm.generate(
        prompts[:1], SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[stop])
    )
    engine = llm.engine
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4))
    engine.abort(next(iter(engine._requests)))
    while engine.has_unfinished():
        engine.step()
    reasons = collections.Counter(o.finish_reason for o in outs)
    assert reasons["stop"] == 1
    for reason in ("stop", "length"):
        assert metrics.sample("specserve_request_finished_total", finish_reason=reason) == reasons[reason]
    assert metrics.sample("specserve_request_finished_total", finish_reason="abort") == 1
    assert metrics.sample("specserve_retracted_requests_total") == engine.scheduler.num_retracted > 0
    assert metrics.sample("specserve_spec_verify_steps_total") == 0
    assert metrics.sample("specserve_spec_num_steps") == 0
    assert metrics.sample("specserve_step_duration_seconds_count", phase="draft") == 0
