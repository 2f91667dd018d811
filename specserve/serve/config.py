"""`ServeConfig`: what an operator sets to serve a model on Ray (the `args:` of a Serve config file).

Pydantic at this edge (validation errors name the field; every field is described for
`serve deploy` users); inside, it becomes the frozen `EngineConfig` the engine reads.
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from specserve.api import API_KEY_ENV
from specserve.api.auth import check_api_key
from specserve.api.limits import MAX_BODY_BYTES
from specserve.config import AdaptiveConfig, CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from specserve.executor.tp_group import DEFAULT_TIMEOUT_S

DEFAULT_MODEL = "smollm2-135m-instruct"


class AutoscalingSettings(BaseModel):
    """Replica autoscaling of the engine deployment: Ray Serve's `autoscaling_config` plus the targets
    of specserve's load policy (`specserve.serve.autoscaling:EngineLoadPolicy`)."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0, description="Fewest engine replicas (each one TP group).")
    max_replicas: int = Field(2, ge=1, description="Most engine replicas.")
    initial_replicas: int | None = Field(None, ge=0, description="Replicas at deploy time (default: min).")
    target_ongoing_requests: float = Field(
        16.0, gt=0, description="Requests (running + queued) per replica the policy aims for."
    )
    target_queue_depth: float = Field(
        4.0, gt=0, description="Waiting (admitted, not yet running) requests per replica the policy aims for."
    )
    target_kv_usage: float = Field(
        0.8, gt=0, le=1, description="KV-cache usage ratio per replica above which the policy adds replicas."
    )
    target_ttft_s: float | None = Field(
        None, gt=0, description="Time to first token (recent mean, seconds) above which it adds replicas."
    )
    upscale_delay_s: float = Field(10.0, ge=0, description="How long load must stay high before scaling up.")
    downscale_delay_s: float = Field(
        60.0, ge=0, description="How long load must stay low before scaling down."
    )
    look_back_period_s: float = Field(10.0, gt=0, description="Window the controller averages reports over.")
    metrics_interval_s: float = Field(
        2.0, gt=0, description="How often replicas push load reports (Ray deprecates it for an env variable)."
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSettings:
        if self.max_replicas < self.min_replicas:
            raise ValueError("autoscaling.max_replicas: must be >= min_replicas")
        if self.look_back_period_s <= self.metrics_interval_s:  # Ray warns today, and will refuse it
            raise ValueError("autoscaling.look_back_period_s: must be > metrics_interval_s")
        return self

    def serve_config(self, model_name: str | None = None) -> dict[str, Any]:
        """Ray Serve's `autoscaling_config` for the engine deployment, with our policy plugged in
        (`model_name`: the label of the decision it publishes as a metric)."""
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "initial_replicas": self.initial_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "look_back_period_s": self.look_back_period_s,
            "metrics_interval_s": self.metrics_interval_s,
            "policy": {
                "policy_function": "specserve.serve.autoscaling:EngineLoadPolicy",
                "policy_kwargs": {
                    "target_ongoing_requests": self.target_ongoing_requests,
                    "target_queue_depth": self.target_queue_depth,
                    "target_kv_usage": self.target_kv_usage,
                    "target_ttft_s": self.target_ttft_s,
                    "model_name": model_name,
                },
            },
        }


def _adaptive_default(name: str) -> Any:
    return AdaptiveConfig.__dataclass_fields__[name].default


class AdaptiveSettings(BaseModel):
    """Adaptive speculation, `speculative: {method: ..., adaptive: {...}}` (or `adaptive: true` for
    these defaults): every step runs the tier (draft shape, or none) with the most predicted accepted
    tokens per second, from live per-request acceptance and measured step costs (docs/speculative.md)."""

    model_config = ConfigDict(extra="forbid")

    tiers: list[str | int | list[int]] | None = Field(
        _adaptive_default("tiers"),
        description="Draft shapes to pick from: 'off' (or 0), NUM_STEPS (a chain), or "
        "'NUM_STEPSxTOPKxNUM_DRAFT_TOKENS' / [num_steps, topk, num_draft_tokens] (a tree), each within "
        "the configured num_steps / topk / num_draft_tokens. Default: off, chains of 1, 2, 4, ... up to "
        "num_steps, and the configured tree when topk > 1.",
    )
    hysteresis: float | None = Field(
        _adaptive_default("hysteresis"),
        ge=0,
        le=10,
        description="How much better (a fraction of its predicted goodput) another tier must be to replace "
        "the current one (null: 0.15 with a draft head or model, whose estimates drift with noise; "
        "0.05 with n-gram, whose copying stretches come and go).",
    )
    patience: int = Field(
        _adaptive_default("patience"),
        ge=1,
        description="Decisions in a row a better tier must win before the switch.",
    )
    probe_every: int = Field(
        _adaptive_default("probe_every"),
        ge=1,
        description="While speculation is off, every this many steps one step drafts with the best "
        "speculative tier, so acceptance estimates notice text becoming predictable (and a request "
        "given no draft for this many speculative steps drafts the tier's depth once).",
    )
    min_reach: float = Field(
        _adaptive_default("min_reach"),
        ge=0,
        lt=1,
        description="A model drafter's request drafts only the positions it reaches (all drafts before "
        "accepted) with at least this probability by its own estimates: fewer drafts for text its drafter "
        "cannot predict (an n-gram request's depth is chosen by the step's cost instead).",
    )
    request_alpha: float = Field(
        _adaptive_default("request_alpha"),
        gt=0,
        lt=1,
        description="Fade of a request's own acceptance evidence per verify, below 1 (larger: follows its text faster).",
    )
    pooled_alpha: float = Field(
        _adaptive_default("pooled_alpha"),
        gt=0,
        lt=1,
        description="Fade per step of the acceptance evidence pooled over all requests, below 1 (the prior of a new request).",
    )
    prior: float = Field(
        _adaptive_default("prior"),
        gt=0,
        lt=1,
        description="Acceptance rate assumed before anything was observed (optimistic, so every tier gets tried).",
    )
    prior_strength: float = Field(
        _adaptive_default("prior_strength"),
        gt=0,
        description="How many observations the prior is worth against a position's evidence.",
    )
    cost_alpha: float = Field(
        _adaptive_default("cost_alpha"),
        ge=0,
        le=1,
        description="How fast measured steps replace each other in a shape's cost, as an average's weight: "
        "a shape costs the mean of its last 2 / cost_alpha - 1 steady steps, outliers left out "
        "(0: keep the start-up profile).",
    )
    profile: bool = Field(
        _adaptive_default("profile"),
        description="Time every tier's target pass and draft step at start-up (CUDA-graph replays on the "
        "GPU, a few dummy steps on the CPU); off: costs are learnt from the first steps.",
    )
    shadow_lookups: int = Field(
        _adaptive_default("shadow_lookups"),
        ge=0,
        description="With the n-gram drafter, requests a plain step starts a shadow draft for (a device-loop "
        "run off counts each of its plain steps): the lookup runs anyway and what it would have had "
        "accepted feeds the acceptance estimates, so the policy sees text turn predictable without "
        "waiting for a probe (0: probes only).",
    )
    calibration_fade: float | None = Field(
        _adaptive_default("calibration_fade"),
        ge=0,
        lt=1,
        description="Each speculative tier's predicted goodput is corrected by what its steady steps "
        "measured against it (tokens emitted over tokens predicted, per tier and batch size class); "
        "this is how much of that evidence a further step of the tier keeps (null: no correction).",
    )
    drain_strength: float | None = Field(
        _adaptive_default("drain_strength"),
        gt=0,
        description="With no request waiting, tiers are judged by when the batch's last request ends; "
        "this is how many observations the pooled rates are worth against a request's own in that "
        "forecast, which looks a whole answer ahead (null: prior_strength, as for a step's goodput).",
    )
    drain_thinning: bool = Field(
        _adaptive_default("drain_thinning"),
        description="In that forecast, price the steps after a request ends at the requests still "
        "running (a device loop's later runs are narrower), not at the whole batch's step.",
    )
    switch_runs_priced: bool = Field(
        _adaptive_default("switch_runs_priced"),
        description="Let the device-loop runs just before and just after a switch of chain length set "
        "their tier's price (false: they price nothing; on a GPU the two steps' walls do not split by "
        "run there, one over and one under what a run costs).",
    )


def _check_speculative_adaptive(value: dict[str, Any] | str | None) -> None:
    """The pydantic check of `speculative.adaptive` (a 'speculative.adaptive.FIELD: ...' ValueError)."""
    adaptive = value.get("adaptive") if isinstance(value, dict) else None
    if not isinstance(adaptive, dict):
        return
    try:
        AdaptiveSettings.model_validate(adaptive)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"speculative.adaptive.{where}: {first['msg']}") from None


class ServeConfig(BaseModel):
    """One served model: the engine each replica runs, how replicas are placed and scaled, where HTTP listens."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(DEFAULT_MODEL, description="Asset name, .gguf file or HF folder of the target model.")
    served_model_name: str | None = Field(
        None, description="The name clients send as `model` and `/v1/models` lists (default: `model`)."
    )
    speculative: dict[str, Any] | str | None = Field(
        "default",
        description="Speculative decoding: a method name, a mapping of SpeculativeConfig fields "
        "(method, num_steps, topk, num_draft_tokens, draft_model, ...; topk > 1 drafts trees; "
        "`draft_vocab`: N, an EAGLE-3 head sharing the target's lm_head drafts over the N ids its "
        "token ranking puts first; "
        "`adaptive`: true or the settings of `AdaptiveSettings`, to pick the draft shape up to the "
        "configured one, or none, every step), null for plain decoding, or `default` (also as a "
        "mapping's method): the draft head trained for the model when one ships with specserve, else "
        "n-gram prompt lookup.",
    )
    tp_size: int = Field(
        1, ge=1, le=64, description="Tensor-parallel ranks per engine replica (GPUs, or CPU processes)."
    )
    device: str = Field("auto", description="auto (GPU when Ray gives the replica one), cpu, or cuda.")
    dtype: str = Field("auto", description="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16 or float16.")
    page_size: int = Field(16, ge=1, description="Tokens per KV-cache page (the prefix-cache granularity).")
    max_total_tokens: int | None = Field(
        None,
        ge=1,
        description="KV-cache slots per replica (default: sized from free GPU memory, or 65536 on CPU).",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + output (default: the model's)."
    )
    max_running_requests: int = Field(64, ge=1, description="Requests decoded together per replica.")
    max_batched_tokens: int = Field(
        2048, ge=1, description="Token budget of one engine step (decode + prefill chunks)."
    )
    decode_steps: int | None = Field(
        None,
        ge=0,
        le=64,
        description="Without speculative decoding: greedy decode steps a device-loop run queues before "
        "the host reads their tokens (null: 8 where CUDA graphs are captured; 0: every step from the "
        "host). More steps a run: less host work a token, larger bursts of streamed tokens.",
    )
    max_queued_requests: int = Field(
        256, ge=0, description="Admitted requests waiting for a running slot per replica; beyond it, 429."
    )
    enable_prefix_cache: bool | None = Field(
        None,
        description="Reuse KV pages of shared prompt prefixes (null: on, except for hybrid Mamba-2 models, "
        "where it is off and true is refused).",
    )
    stream_messages_per_s: float | None = Field(
        500.0,
        gt=0,
        description="Streamed outputs per second an engine replica sends, all its requests together, at "
        "most: each open stream waits for its share between two outputs, which then carry every token "
        "made meanwhile (first and last outputs never wait). Each output is a Ray message into the "
        "ingress, far dearer than a decode step; null: one output per request and step.",
    )
    seed: int = Field(0, ge=0, description="Seed of the per-request seeds drawn for requests that give none.")
    num_replicas: int = Field(1, ge=1, description="Engine replicas when `autoscaling` is not set.")
    autoscaling: AutoscalingSettings | None = Field(
        None, description="Autoscale engine replicas on engine load."
    )
    cpus_per_rank: float = Field(1.0, gt=0, description="Ray CPUs reserved for each TP rank.")
    ingress_replicas: int = Field(
        1, ge=1, description="HTTP ingress replicas (they parse, validate and stream)."
    )
    metrics_push_interval_s: float = Field(
        2.0, gt=0, description="How often each replica sends its metrics to the app's metrics hub (/metrics)."
    )
    tp_timeout_s: float = Field(
        DEFAULT_TIMEOUT_S,
        gt=0,
        description="Longest one TP collective waits for a rank: a hung rank fails its replica after this "
        "(a dead one fails it at once). Idle followers are pinged every quarter of it; joining the group "
        "may take longer (10 minutes).",
    )
    health_check_period_s: float = Field(
        5.0,
        gt=0,
        description="How often Serve probes each engine replica; one whose engine failed (a dead TP "
        "follower, a failed step) is replaced after 3 failed probes.",
    )
    api_key: SecretStr | None = Field(
        None,
        description="When set, every endpoint but /health needs `Authorization: Bearer <key>` (401 "
        f"otherwise). Unset: the ingress replicas' {API_KEY_ENV} variable, if any; else no auth.",
    )
    max_body_bytes: int = Field(
        MAX_BODY_BYTES, ge=1024, description="Largest request body, in bytes; a bigger one is a 413, unread."
    )
    host: str = Field("127.0.0.1", description="Address the HTTP proxy listens on (`specserve serve`).")
    port: int = Field(8000, ge=1, le=65535, description="Port the HTTP proxy listens on (`specserve serve`).")

    @field_validator("speculative")
    @classmethod
    def _speculative(
        cls, value: dict[str, Any] | str | None, info: ValidationInfo
    ) -> dict[str, Any] | str | None:
        _check_speculative_adaptive(value)
        SpeculativeConfig.from_value(value, info.data.get("model"))  # raises ValueError naming the setting
        return value

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            check_api_key(value.get_secret_value())
        return value

    @model_validator(mode="after")
    def _engine(self) -> ServeConfig:
        self.engine_config()  # every engine-level rule checked here, before Ray starts anything
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def max_engine_replicas(self) -> int:
        return self.autoscaling.max_replicas if self.autoscaling is not None else self.num_replicas

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            device=self.device,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            seed=self.seed,
            tp_size=self.tp_size,
            cache=CacheConfig(
                page_size=self.page_size,
                max_total_tokens=self.max_total_tokens,
                enable_prefix_cache=self.enable_prefix_cache,
            ),
            scheduler=SchedulerConfig(
                max_running_requests=self.max_running_requests,
                max_batched_tokens=self.max_batched_tokens,
            ),
            speculative=SpeculativeConfig.from_value(self.speculative, self.model),
            decode_steps=self.decode_steps,
        )
