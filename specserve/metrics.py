"""Prometheus metrics, defined once (names follow DESIGN.md §5).

Each `EngineMetrics` owns its own `CollectorRegistry`: no process-wide mutable state, so several
engines (or tests) in one process never collide, and `exposition()` is one engine's scrape text.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter(
            "specserve_prompt_tokens_total", "Prompt tokens of admitted requests.", registry=r
        )
        self.generation_tokens = Counter(
            "specserve_generation_tokens_total", "Tokens generated (streamed to callers).", registry=r
        )
        self.request_finished = Counter(
            "specserve_request_finished_total",
            "Requests that finished, by reason (stop, length, abort).",
            ["finish_reason"],
            registry=r,
        )
        self.spec_draft_tokens = Counter(
            "specserve_spec_draft_tokens_total",
            "Draft tokens sent to verify (finished requests).",
            registry=r,
        )
        self.spec_accepted_tokens = Counter(
            "specserve_spec_accepted_tokens_total", "Draft tokens accepted (finished requests).", registry=r
        )
        self.spec_verify_steps = Counter(
            "specserve_spec_verify_steps_total",
            "Verify steps of decoding requests (finished requests).",
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "specserve_time_to_first_token_seconds",
            "From the request reaching the engine client to its first output token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.num_requests_running = Gauge(
            "specserve_num_requests_running", "Requests in the running batch.", registry=r
        )
        self.num_requests_waiting = Gauge(
            "specserve_num_requests_waiting", "Requests queued for admission.", registry=r
        )
        self.kv_cache_usage_ratio = Gauge(
            "specserve_kv_cache_usage_ratio", "Share of KV pages held by running requests.", registry=r
        )
        self.step_errors = Counter(
            "specserve_engine_step_errors_total",
            "Engine steps that raised (their requests failed).",
            registry=r,
        )

    def exposition(self) -> str:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry).decode()
