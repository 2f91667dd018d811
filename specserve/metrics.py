"""Prometheus metrics, defined once: the contract the dashboards read (`docs/serving.md`, "Metrics").

Every metric is a `MetricDef` below; nothing else in specserve spells a metric name. Engine metrics
live on a per-engine `CollectorRegistry` (`EngineMetrics`, with `model` and `replica` bound at
construction: no process-wide mutable state, so several engines in one process never collide), the
HTTP counter on its app's own (`HttpMetrics`), and the two fleet gauges (`specserve_replica_up`,
`specserve_autoscaling_target_replicas`) are rendered per scrape from what the metrics hub knows
(`fleet_exposition`). `merge_expositions` joins scrape texts into one valid exposition.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from specserve.engine.stats import SpecSettings, StepStats

LOCAL = "local"  # the `replica` label of an in-process engine or app
EMA_ALPHA = 0.1  # weight of each step's mean accept length in `specserve_spec_ema_accept_length`

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ACCEPT_LENGTH_BUCKETS = tuple(float(n) for n in range(1, 18))  # 1 token (nothing accepted) .. 17


@dataclass(frozen=True)
class MetricDef:
    name: str  # exactly as exposed: counters end in `_total`, histograms get `_bucket/_sum/_count`
    kind: Literal["counter", "gauge", "histogram"]
    doc: str
    labels: tuple[str, ...] = ()  # beyond the bound ones
    buckets: tuple[float, ...] | None = None
    bound: tuple[str, ...] = ("model", "replica")

    def create(self, registry: CollectorRegistry) -> Any:
        kind = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}[self.kind]
        extra = {"buckets": self.buckets} if self.buckets else {}
        return kind(self.name, self.doc, self.bound + self.labels, registry=registry, **extra)


def _counter(name: str, doc: str, *labels: str) -> MetricDef:
    return MetricDef(name, "counter", doc, labels)


def _gauge(name: str, doc: str, bound: tuple[str, ...] = ("model", "replica")) -> MetricDef:
    return MetricDef(name, "gauge", doc, bound=bound)


def _histogram(name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> MetricDef:
    return MetricDef(name, "histogram", doc, labels, buckets)


PROMPT_TOKENS = _counter("specserve_prompt_tokens_total", "Prompt tokens of admitted requests.")
GENERATION_TOKENS = _counter("specserve_generation_tokens_total", "Output tokens produced.")
REQUEST_FINISHED = _counter(
    "specserve_request_finished_total",
    "Finished requests by reason: stop, length, abort, error.",
    "finish_reason",
)
RETRACTED = _counter("specserve_retracted_requests_total", "Running requests retracted because KV ran short.")
PREFIX_QUERIES = _counter(
    "specserve_prefix_cache_queries_total", "Tokens looked up in the prefix cache at admission."
)
PREFIX_HITS = _counter("specserve_prefix_cache_hits_total", "Looked-up tokens whose KV came from the cache.")
SPEC_DRAFT_TOKENS = _counter("specserve_spec_draft_tokens_total", "Draft tokens sent to verify.")
SPEC_ACCEPTED_TOKENS = _counter("specserve_spec_accepted_tokens_total", "Draft tokens accepted.")
SPEC_ACCEPTED_PER_POSITION = _counter(
    "specserve_spec_accepted_tokens_per_position_total",
    "Accepted drafts by chain position (position p accepted implies 0..p accepted).",
    "position",
)
SPEC_VERIFY_STEPS = _counter(
    "specserve_spec_verify_steps_total",
    "Verify steps of decoding requests (one per request per decode step).",
)
SPEC_ADAPT_SWITCHES = _counter(
    "specserve_spec_adapt_switches_total", "Changes of (num_steps, topk, num_draft_tokens) while serving."
)
STEP_ERRORS = _counter(
    "specserve_engine_step_errors_total", "Engine steps that raised (their requests failed)."
)
SPEC_ACCEPT_LENGTH = _histogram(
    "specserve_spec_accept_length",
    "Tokens emitted per verify step (accepted drafts + 1).",
    ACCEPT_LENGTH_BUCKETS,
)
TTFT = _histogram(
    "specserve_time_to_first_token_seconds",
    "From the request reaching the engine client to its first output token.",
    LATENCY_BUCKETS,
)
INTER_TOKEN = _histogram(
    "specserve_inter_token_latency_seconds",
    "Time between consecutive outputs of a request over the tokens they carried (once per token).",
    TOKEN_BUCKETS,
)
E2E = _histogram(
    "specserve_e2e_request_latency_seconds",
    "From the request reaching the engine client to its last output.",
    E2E_BUCKETS,
)
QUEUE_TIME = _histogram(
    "specserve_request_queue_time_seconds", "From arrival at the engine to first scheduling.", LATENCY_BUCKETS
)
STEP_DURATION = _histogram(
    "specserve_step_duration_seconds",
    "Host wall time of each engine-step phase: draft, target, postprocess, and the whole step.",
    STEP_BUCKETS,
    "phase",
)
RUNNING = _gauge("specserve_num_requests_running", "Requests in the running batch.")
WAITING = _gauge("specserve_num_requests_waiting", "Requests queued for admission.")
KV_USAGE = _gauge("specserve_kv_cache_usage_ratio", "Share of KV pages held by running requests.")
SPEC_NUM_STEPS = _gauge("specserve_spec_num_steps", "Draft steps per verify (0: speculation off).")
SPEC_TOPK = _gauge("specserve_spec_topk", "Draft branches per step (0: speculation off).")
SPEC_NUM_DRAFT_TOKENS = _gauge(
    "specserve_spec_num_draft_tokens", "Draft tokens per verify (0: speculation off)."
)
SPEC_EMA_ACCEPT_LENGTH = _gauge(
    "specserve_spec_ema_accept_length",
    f"Moving average of the accept length: alpha {EMA_ALPHA} per step, over the step's mean.",
)
SPEC_PREDICTED_GOODPUT = _gauge(
    "specserve_spec_predicted_goodput_tokens_per_second",
    "Adaptive speculation: output tokens per second the policy predicted for the tier it chose "
    "(at the last step with decoding requests).",
)
SPEC_MEASURED_GOODPUT = _gauge(
    "specserve_spec_measured_goodput_tokens_per_second",
    "Adaptive speculation: output tokens per second of engine steps, a moving average over steps.",
)
HTTP_REQUESTS = _counter(
    "specserve_http_requests_total", "HTTP requests by route template and status code.", "route", "status"
)
REPLICA_UP = _gauge("specserve_replica_up", "1 per engine replica that reported within the last 30 s.")
AUTOSCALING_TARGET = _gauge(
    "specserve_autoscaling_target_replicas",
    "Engine replicas the autoscaling policy last asked for.",
    bound=("model",),
)

ENGINE_METRICS = (
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    REQUEST_FINISHED,
    RETRACTED,
    PREFIX_QUERIES,
    PREFIX_HITS,
    SPEC_DRAFT_TOKENS,
    SPEC_ACCEPTED_TOKENS,
    SPEC_ACCEPTED_PER_POSITION,
    SPEC_VERIFY_STEPS,
    SPEC_ADAPT_SWITCHES,
    STEP_ERRORS,
    SPEC_ACCEPT_LENGTH,
    TTFT,
    INTER_TOKEN,
    E2E,
    QUEUE_TIME,
    STEP_DURATION,
    RUNNING,
    WAITING,
    KV_USAGE,
    SPEC_NUM_STEPS,
    SPEC_TOPK,
    SPEC_NUM_DRAFT_TOKENS,
    SPEC_EMA_ACCEPT_LENGTH,
    SPEC_PREDICTED_GOODPUT,
    SPEC_MEASURED_GOODPUT,
)
FLEET_METRICS = (REPLICA_UP, AUTOSCALING_TARGET)
ALL_METRICS = (*ENGINE_METRICS, HTTP_REQUESTS, *FLEET_METRICS)
METRIC_NAMES = frozenset(m.name for m in ALL_METRICS)


class _Registry:
    """A registry of some `MetricDef`s with the bound labels' values fixed."""

    def __init__(self, defs: Iterable[MetricDef], bound: tuple[str, ...]) -> None:
        self.registry = CollectorRegistry()
        self._bound = bound
        self._parents = {d.name: d.create(self.registry) for d in defs}
        self._children: dict[tuple[str, ...], Any] = {}

    def child(self, metric: MetricDef, *values: str) -> Any:
        """`metric`'s series for these extra label values (cached: label lookups take a lock)."""
        key = (metric.name, *values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = self._parents[metric.name].labels(*self._bound, *values)
        return found

    def sample(self, name: str, **labels: str) -> float:
        """A sample's value (0 when absent), the bound labels filled in: for tests and checks."""
        bound = dict(zip(("model", "replica"), self._bound, strict=False))
        return self.registry.get_sample_value(name, {**bound, **labels}) or 0.0

    def exposition(self) -> str:
        return render(self.registry.collect())


class EngineMetrics(_Registry):
    """One engine's metrics, a `StatsSink`: `record_step` on the engine thread after each step, the
    request latencies observed by the `AsyncEngine` that delivers outputs."""

    def __init__(self, model: str, replica: str = LOCAL) -> None:
        super().__init__(ENGINE_METRICS, (model, replica))
        self.replica = replica
        self.time_to_first_token = self.child(TTFT)
        self.inter_token_latency = self.child(INTER_TOKEN)
        self.e2e_request_latency = self.child(E2E)
        self.step_errors = self.child(STEP_ERRORS)
        self._spec: SpecSettings | None = None
        self._ema: float | None = None
        for metric in ENGINE_METRICS:  # unlabelled series exist from the start (0), not from first use
            if not metric.labels:
                self.child(metric)

    def record_step(self, stats: StepStats) -> None:
        self._count(stats)
        self._count_spec(stats)
        for seconds in stats.queue_times:
            self.child(QUEUE_TIME).observe(seconds)
        for phase, seconds in stats.phases.items():
            self.child(STEP_DURATION, phase).observe(seconds)
        self.child(RUNNING).set(stats.num_running)
        self.child(WAITING).set(stats.num_waiting)
        self.child(KV_USAGE).set(stats.kv_usage)
        self._set_spec(stats.spec)
        if stats.predicted_goodput is not None:
            self.child(SPEC_PREDICTED_GOODPUT).set(stats.predicted_goodput)
        if stats.measured_goodput is not None:
            self.child(SPEC_MEASURED_GOODPUT).set(stats.measured_goodput)

    def _count(self, stats: StepStats) -> None:
        for metric, value in (
            (PROMPT_TOKENS, stats.prompt_tokens),
            (GENERATION_TOKENS, stats.generation_tokens),
            (RETRACTED, stats.retracted),
            (PREFIX_QUERIES, stats.prefix_queries),
            (PREFIX_HITS, stats.prefix_hits),
        ):
            if value:
                self.child(metric).inc(value)
        for reason, count in stats.finished.items():
            self.child(REQUEST_FINISHED, reason).inc(count)

    def _count_spec(self, stats: StepStats) -> None:
        lengths = stats.accept_lengths
        if not lengths:
            return
        self.child(SPEC_VERIFY_STEPS).inc(len(lengths))
        self.child(SPEC_DRAFT_TOKENS).inc(stats.draft_tokens)
        self.child(SPEC_ACCEPTED_TOKENS).inc(stats.accepted_tokens)
        for position, count in enumerate(stats.accepted_per_position):
            self.child(SPEC_ACCEPTED_PER_POSITION, str(position)).inc(count)
        histogram = self.child(SPEC_ACCEPT_LENGTH)
        for length in lengths:
            histogram.observe(length)
        mean = sum(lengths) / len(lengths)
        self._ema = mean if self._ema is None else self._ema + EMA_ALPHA * (mean - self._ema)
        self.child(SPEC_EMA_ACCEPT_LENGTH).set(self._ema)

    def _set_spec(self, spec: SpecSettings) -> None:
        if spec == self._spec:
            return
        if self._spec is not None:
            self.child(SPEC_ADAPT_SWITCHES).inc()
        self._spec = spec
        self.child(SPEC_NUM_STEPS).set(spec.num_steps)
        self.child(SPEC_TOPK).set(spec.topk)
        self.child(SPEC_NUM_DRAFT_TOKENS).set(spec.num_draft_tokens)
        for position in range(spec.num_steps):  # every position has a series (0) before its first accept
            self.child(SPEC_ACCEPTED_PER_POSITION, str(position))


class HttpMetrics(_Registry):
    """The HTTP layer's counter, labelled with the app's model and replica (the ingress replica id)."""

    def __init__(self, model: str, replica: str = LOCAL) -> None:
        super().__init__((HTTP_REQUESTS,), (model, replica))

    def count(self, route: str, status: int) -> None:
        self.child(HTTP_REQUESTS, route, str(status)).inc()


def fleet_exposition(replicas: Iterable[tuple[str, str]], targets: Mapping[str, int]) -> str:
    """`specserve_replica_up` for each live (model, replica) and the autoscaling target per model."""
    registry = CollectorRegistry()
    up, target = REPLICA_UP.create(registry), AUTOSCALING_TARGET.create(registry)
    for model, replica in replicas:
        up.labels(model, replica).set(1)
    for model, replicas_wanted in targets.items():
        target.labels(model).set(replicas_wanted)
    return render(registry.collect())


def merge_expositions(texts: Iterable[str]) -> str:
    """One exposition of several scrape texts: each family once (HELP and TYPE of its first
    appearance), its samples from every text; a sample seen twice (same name and labels) is kept once."""
    families: dict[str, Metric] = {}
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            if merged.type != family.type:
                continue  # two definitions of one name: the first wins rather than an invalid scrape
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key not in seen:
                    seen.add(key)
                    merged.samples.append(sample)
    return render(families.values())


class _Families:
    """What `generate_latest` renders: fixed families, each counter's and histogram's `_created`
    sample left out (a second family per metric in the text format that no dashboard reads)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            kept = Metric(family.name, family.documentation, family.type, family.unit)
            kept.samples = [s for s in family.samples if s.name != family.name + "_created"]
            yield kept


def render(families: Iterable[Metric]) -> str:
    """The Prometheus text format (0.0.4) of these families."""
    return generate_latest(_Families(families)).decode()
