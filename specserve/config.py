"""Engine settings as frozen dataclasses, validated in one place (`EngineConfig.__post_init__`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# "auto": triton on CUDA, torch on the CPU; "flash": vllm-flash-attn, only when asked for and it
# imports against the installed torch (specserve/attention/flash_backend.py); never picked by "auto".
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash")
# vllm-flash-attn's paged KV: "Paged KV cache block size must be divisible by 16" (its 2.6 kernels).
FLASH_PAGE_MULTIPLE = 16
PREFILL_GRAPH_TOKENS = 512  # the default largest prefill graph on CUDA (EngineConfig)


# Head methods whose chains may run in the device loop (with their draft graphs: checked at load).
HEAD_LOOP_METHODS = ("eagle", "eagle3", "mtp")


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


def _is_count(value: object, least: int = 1) -> bool:
    """An integer (not a bool, not a float) of at least `least`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _require_known(fields: Mapping, cls: type, name: str) -> None:
    unknown = set(fields) - set(cls.__dataclass_fields__)
    _require(not unknown, name, f"unknown settings {sorted(unknown)}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    page_size: int = 1
    # Token slots in the pool; None sizes it from free GPU memory (or a CPU default).
    max_total_tokens: int | None = None
    # None: on, except for hybrid models, which keep no state snapshots to resume a prefix from.
    enable_prefix_cache: bool | None = None
    gpu_memory_fraction: float = 0.85

    def validate(self) -> None:
        _require(_is_count(self.page_size), "page_size", "must be an integer >= 1")
        _require(
            self.max_total_tokens is None or _is_count(self.max_total_tokens),
            "max_total_tokens",
            "must be null or an integer >= 1",
        )
        _require(
            _is_number(self.gpu_memory_fraction) and 0 < self.gpu_memory_fraction <= 1,
            "gpu_memory_fraction",
            "must be in (0, 1]",
        )
        _require(
            self.enable_prefix_cache in (None, True, False),
            "enable_prefix_cache",
            "must be null, true or false",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_running_requests: int = 64
    # Token budget of one step: decode tokens plus prefill chunks.
    max_batched_tokens: int = 2048
    chunked_prefill: bool = True

    def validate(self) -> None:
        _require(_is_count(self.max_running_requests), "max_running_requests", "must be an integer >= 1")
        _require(_is_count(self.max_batched_tokens), "max_batched_tokens", "must be an integer >= 1")
        _require(isinstance(self.chunked_prefill, bool), "chunked_prefill", "must be true or false")


SPEC_METHODS = ("ngram", "standalone", "eagle", "eagle3", "mtp")
MAX_TOPK = 16
MAX_DRAFT_TOKENS = 256


# How much better a tier must score to replace the standing one, by drafter. A head's acceptance
# drifts smoothly, and the noise of its estimates (one request's last ~10 verifies at batch 1) made
# challengers: 52-81 switches over 16 prompts at batch 1 on the H200 (0.968-0.978x the static
# 3-chain) at 0.05, 26 at 0.15 (0.985-0.991x); over three A/Bs 0.15 was ahead at every batch on
# average (docs/benchmarks.md, twentieth session). An n-gram draft is copied text or nothing, and
# copying stretches come and go: 0.15 answered them late (`scripts/adaptive_sim.py`, MT-Bench
# batch 4 / 16: 3-7% worse), so n-gram keeps 0.05.
MODEL_HYSTERESIS = 0.15
NGRAM_HYSTERESIS = 0.05


@dataclass(frozen=True)
class AdaptiveConfig:
    """Adaptive speculation (`specserve/spec/adaptive.py`): each step runs the tier of most predicted
    accepted tokens per second. `tiers`: draft shapes (num_steps, topk, num_draft_tokens), (0, 1, 0)
    being speculation off; None: off, chains of 1, 2, 4, ... up to the configured num_steps, and the
    configured tree (`default_tiers`). Every tier must fit the configured shape (its KV slots and
    CUDA graphs are sized by it). The rest tune the policy, the acceptance estimates and the cost
    tables (`AdaptiveSettings` in `specserve/serve/config.py` describes each); `shadow_lookups`: n-gram
    lookups a plain step scored while off, a loop run's steps each (`specserve/spec/shadow.py`; 0:
    none, probes alone);
    `calibration_fade`: how fast each tier's correction by its measured steps forgets, per step of
    the tier (`specserve/spec/calibration.py`; None: predictions uncorrected); `drain_strength`: the
    pool's weight in a request's rates where the drain forecasts its end (None: `prior_strength`);
    `drain_thinning`: the drain prices the steps after a request ends at the requests still running;
    `switch_runs_priced`: the device-loop runs either side of a switch of chain length set prices too
    (`Engine._observe_loop`);
    `hysteresis` None: `MODEL_HYSTERESIS` with a model drafter, `NGRAM_HYSTERESIS` with n-gram."""

    tiers: tuple[tuple[int, int, int], ...] | None = None
    hysteresis: float | None = None
    patience: int = 3
    probe_every: int = 32
    min_reach: float = 0.05
    request_alpha: float = 0.1
    pooled_alpha: float = 0.02
    prior: float = 0.7
    prior_strength: float = 2.0
    cost_alpha: float = 0.2
    profile: bool = True
    shadow_lookups: int = 2
    calibration_fade: float | None = 0.8
    drain_strength: float | None = None
    drain_thinning: bool = False
    switch_runs_priced: bool = True

    def validate(self, spec: SpeculativeConfig) -> None:
        name = "speculative.adaptive"
        for field_name in ("min_reach", "request_alpha", "pooled_alpha", "prior"):
            value = getattr(self, field_name)
            _require(_is_number(value), f"{name}.{field_name}", "must be a number")
        for field_name in ("prior_strength", "cost_alpha"):
            _require(_is_number(getattr(self, field_name)), f"{name}.{field_name}", "must be a number")
        _require(
            self.hysteresis is None or (_is_number(self.hysteresis) and 0 <= self.hysteresis <= 10),
            f"{name}.hysteresis",
            "must be a number in [0, 10] or null",
        )
        for field_name in ("patience", "probe_every"):
            value = getattr(self, field_name)
            _require(
                _is_count(value),
                f"{name}.{field_name}",
                "must be an integer >= 1",
            )
        _require(0 <= self.min_reach < 1, f"{name}.min_reach", "must be in [0, 1)")
        for field_name in ("request_alpha", "pooled_alpha"):  # 1 would fade the counts to nothing
            _require(0 < getattr(self, field_name) < 1, f"{name}.{field_name}", "must be in (0, 1)")
        _require(0 < self.prior < 1, f"{name}.prior", "must be in (0, 1)")
        _require(self.prior_strength > 0, f"{name}.prior_strength", "must be > 0")
        _require(
            self.drain_strength is None or (_is_number(self.drain_strength) and self.drain_strength > 0),
            f"{name}.drain_strength",
            "must be a number > 0 or null",
        )
        _require(0 <= self.cost_alpha <= 1, f"{name}.cost_alpha", "must be in [0, 1] (0: keep the profile)")
        _require(isinstance(self.profile, bool), f"{name}.profile", "must be true or false")
        for field_name in ("drain_thinning", "switch_runs_priced"):
            _require(
                isinstance(getattr(self, field_name), bool), f"{name}.{field_name}", "must be true or false"
            )
        _require(
            _is_count(self.shadow_lookups, 0),
            f"{name}.shadow_lookups",
            "must be an integer >= 0",
        )
        _require(
            self.calibration_fade is None
            or (_is_number(self.calibration_fade) and 0 <= self.calibration_fade < 1),
            f"{name}.calibration_fade",
            "must be a number in [0, 1) or null",
        )
        if self.tiers is None:
            return
        _require(len(self.tiers) > 0, f"{name}.tiers", "must name at least one tier (or be null)")
        for steps, topk, nodes in self.tiers:
            shape = f"{steps}x{topk}x{nodes}"
            _require(
                (steps, topk, nodes) == (0, 1, 0) or (steps >= 1 and nodes >= 1),
                f"{name}.tiers",
                f"{shape}: a tier is (0, 1, 0) (off) or has num_steps and num_draft_tokens >= 1",
            )
            _require(
                steps <= spec.num_steps and topk <= spec.topk and nodes <= spec.draft_tokens,
                f"{name}.tiers",
                f"{shape} exceeds the configured shape {spec.num_steps}x{spec.topk}x{spec.draft_tokens} "
                "(raise speculative.num_steps / topk / num_draft_tokens)",
            )
            _require(
                topk != 1 or nodes == steps,
                f"{name}.tiers",
                f"{shape}: a chain (topk 1) verifies num_steps tokens",
            )

    @classmethod
    def from_value(cls, value: AdaptiveConfig | Mapping | bool | None) -> AdaptiveConfig | None:
        """Accept a config, a mapping of its fields (tiers as [num_steps, topk, num_draft_tokens]
        triples or "NUM_STEPS[xTOPKxNUM_DRAFT_TOKENS]" / "off" strings), true (the defaults), or
        false / null (off)."""
        if value is None or value is False:
            return None
        if isinstance(value, AdaptiveConfig):
            return value
        if value is True:
            return cls()
        _require(isinstance(value, Mapping), "speculative.adaptive", "must be true, false, null or a mapping")
        fields = dict(value)
        _require_known(fields, cls, "speculative.adaptive")
        if fields.get("tiers") is not None:
            tiers = fields["tiers"]
            _require(
                isinstance(tiers, (list, tuple)), "speculative.adaptive.tiers", "must be a list of tiers"
            )
            fields["tiers"] = tuple(_tier_shape(t) for t in tiers)
        return cls(**fields)


def _is_device(value: object) -> bool:
    if not isinstance(value, str):
        return False
    kind, _, index = value.partition(":")
    return value in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit())


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _tier_shape(value: object) -> tuple[int, int, int]:
    """A tier as (num_steps, topk, num_draft_tokens): from "off", "4", "4x4x16", 4 or [4, 4, 16]."""
    name = "speculative.adaptive.tiers"
    if value == "off" or value == 0:
        return (0, 1, 0)
    if isinstance(value, str):
        try:
            value = [int(part) for part in value.split("x")]
        except ValueError:
            raise ValueError(
                f"{name}: {value!r} is not 'off', NUM_STEPS or NUM_STEPSxTOPKxNUM_DRAFT_TOKENS"
            ) from None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    ok = isinstance(value, (list, tuple)) and len(value) in (1, 3)
    ok = ok and all(_is_count(v, 0) for v in value)
    _require(ok, name, f"{value!r}: a tier is 'off', NUM_STEPS, or [num_steps, topk, num_draft_tokens]")
    if len(value) == 1:
        return (0, 1, 0) if value[0] == 0 else (value[0], 1, value[0])
    return (value[0], value[1], value[2])


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a drafter proposes `num_steps` tokens (a chain, topk 1) or a tree of
    `num_draft_tokens` nodes up to `num_steps` deep with `topk` candidates a node; one target pass
    verifies them."""

    method: str = "ngram"
    num_steps: int = 4
    topk: int = 1
    # Tree nodes (None: num_steps for a chain, min(topk * num_steps, 64) for a tree).
    num_draft_tokens: int | None = None
    ngram_min_match: int = 1
    ngram_max_match: int = 4
    # standalone: a smaller model with the target's tokenizer (asset name, .gguf or HF folder);
    # eagle / eagle3 / mtp: the HF folder of the head (layouts in specserve/model/head_checkpoint.py)
    draft_model: str | None = None
    # Adaptive speculation: None runs the shape above every step.
    adaptive: AdaptiveConfig | None = None
    # Speculative steps queued back to back on the device between two reads of their tokens by the
    # host (greedy chains: n-gram, adaptive speculation's n-gram chain tiers too, and heads of one
    # step module: specserve/engine/device_loop.py, head_loop.py); None: DEVICE_STEPS where the loop
    # applies (CUDA graphs, TP size 1), 0: never.
    device_steps: int | None = None
    # The head's draft vocabulary: the N ids its folder's token ranking puts first, the target's
    # lm_head rows of them its own (EAGLE-3 heads sharing the target's lm_head; a smaller matmul per
    # draft step); None: as the head was trained.
    draft_vocab: int | None = None

    def validate(self) -> None:
        _require(self.method in SPEC_METHODS, "speculative.method", f"must be one of {list(SPEC_METHODS)}")
        _require(
            (self.method != "ngram") == (self.draft_model is not None),
            "speculative.draft_model",
            f"is required by method {self.method!r}"
            if self.method != "ngram"
            else "is not used by method 'ngram'",
        )
        _require(
            _is_count(self.num_steps) and self.num_steps <= 64,
            "speculative.num_steps",
            "must be an integer in [1, 64]",
        )
        _require(
            _is_count(self.topk) and self.topk <= MAX_TOPK,
            "speculative.topk",
            f"must be an integer in [1, {MAX_TOPK}]",
        )
        if self.topk == 1:
            _require(
                self.num_draft_tokens in (None, self.num_steps),
                "speculative.num_draft_tokens",
                "must equal num_steps for chain drafting (topk 1)",
            )
        _require(
            self.num_draft_tokens is None
            or (_is_count(self.num_draft_tokens) and self.num_draft_tokens <= MAX_DRAFT_TOKENS),
            "speculative.num_draft_tokens",
            f"must be null or an integer in [1, {MAX_DRAFT_TOKENS}]",
        )
        _require(_is_count(self.ngram_max_match), "speculative.ngram_max_match", "must be an integer >= 1")
        _require(
            _is_count(self.ngram_min_match) and self.ngram_min_match <= self.ngram_max_match,
            "speculative.ngram_min_match",
            "must be an integer >= 1 and <= ngram_max_match",
        )
        if self.adaptive is not None:
            self.adaptive.validate(self)
        _require(
            self.device_steps is None or (_is_count(self.device_steps, 0) and self.device_steps <= 64),
            "speculative.device_steps",
            "must be null or an integer in [0, 64]",
        )
        _require(
            not self.device_steps
            or (self.method == "ngram" and (self.topk == 1 or self.adaptive is not None))
            or (
                self.method in HEAD_LOOP_METHODS
                and ((self.topk == 1 and self.num_steps > 1) or self.adaptive is not None)
            ),
            "speculative.device_steps",
            "the device loop runs chains: n-gram (topk 1, or adaptive speculation's chain tiers) or a "
            "head's (eagle, eagle3, mtp of one module; topk 1 and num_steps > 1, or adaptive chain tiers)",
        )
        if self.draft_vocab is not None:
            self._validate_draft_vocab()

    def _validate_draft_vocab(self) -> None:
        _require(
            _is_count(self.draft_vocab),
            "speculative.draft_vocab",
            "must be null or an integer >= 1",
        )
        from specserve.model.head_checkpoint import draft_vocab_ids

        draft_vocab_ids(self.draft_model, self.method, self.draft_vocab)  # the head's folder must allow it

    @property
    def draft_tokens(self) -> int:
        """Draft tokens a step verifies at most: `num_draft_tokens`, or its default."""
        if self.num_draft_tokens is not None:
            return self.num_draft_tokens
        return self.num_steps if self.topk == 1 else min(self.topk * self.num_steps, 64)

    @classmethod
    def from_value(
        cls, value: SpeculativeConfig | dict | str | None, model: str | None = None
    ) -> SpeculativeConfig | None:
        """Accept a config, a dict of its fields, a method name, or "default": the drafter shipped
        for target `model` (specserve/default_drafter.py; as a dict's method, the dict's other
        settings apply to it, e.g. `{"method": "default", "adaptive": true}`)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if value == "default" or (isinstance(value, dict) and value.get("method") == "default"):
            from specserve.default_drafter import default_speculative

            # {"method": "default", ...}: the shipped drafter, with the other settings given
            rest = {k: v for k, v in value.items() if k != "method"} if isinstance(value, dict) else {}
            value = {**default_speculative(model), **rest}
        if isinstance(value, str):
            return cls(method=value)
        if not isinstance(value, dict):
            raise ValueError("speculative: must be null, a method name or a mapping of settings")
        _require_known(value, cls, "speculative")
        return cls(**{**value, "adaptive": AdaptiveConfig.from_value(value.get("adaptive"))})


@dataclass(frozen=True)
class EngineConfig:
    """Everything `Engine` needs besides the loaded model."""

    model: str = "smollm2-135m-instruct"
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    attention_backend: str = "auto"
    # CUDA graphs of decode and verify steps (None: on with the Triton backend on CUDA at TP size 1,
    # never with "flash", whose capture is unverified;
    # True on the CPU runs the same padded static-buffer path without capture, which tests use).
    cuda_graphs: bool | None = None
    cuda_graph_max_batch: int = 64  # the largest batch bucket captured
    # Token rows of the largest prefill graph: steps that sample at most one row a request (prompts,
    # mixed prompt and decode steps) of up to this many tokens replay a graph of 32, 64, ... tokens a
    # request (None: 512 on CUDA, 0 elsewhere; 0: such steps run eagerly). At batch 1 an eager
    # prefill of ~100 tokens is ~11 ms of kernel launches against ~1 ms replayed.
    cuda_graph_prefill_tokens: int | None = None
    # Overlap scheduling: the host schedules and launches step n+1 before collecting step n's tokens
    # (None: on without speculative decoding at TP size 1, and for adaptive speculation's plain steps
    # when its drafter reads no target features (n-gram, standalone); not available otherwise yet).
    overlap_schedule: bool | None = None
    # Greedy decode steps a device-loop run queues without speculative decoding (multi-step
    # decoding: each step's input, forward, argmax and append on the device, the host reading a
    # run's tokens once; specserve/engine/device_loop.py). None: SPECSERVE_DEVICE_STEPS (8) where
    # graphs are captured (CUDA, TP size 1, no recurrent layers); 0: every step from the host.
    decode_steps: int | None = None
    seed: int = 0
    # Ranks of the target's tensor-parallel group (rank 0 runs this engine; see specserve/executor/).
    tp_size: int = 1
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.model, str) and bool(self.model), "model", "must be a non-empty string")
        _require(_is_device(self.device), "device", "must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        _require(
            self.dtype == "auto" or self.dtype in DTYPES, "dtype", f"must be 'auto' or one of {list(DTYPES)}"
        )
        _require(
            self.max_model_len is None or _is_count(self.max_model_len),
            "max_model_len",
            "must be null or an integer >= 1",
        )
        _require(_is_count(self.seed, 0) and self.seed < 2**63, "seed", "must be an integer in [0, 2**63)")
        _require(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"must be one of {list(ATTENTION_BACKENDS)}",
        )
        _require(self.cuda_graphs in (None, True, False), "cuda_graphs", "must be null, true or false")
        _require(
            self.cuda_graphs is not True or self.attention_backend in ("auto", "triton"),
            "cuda_graphs",
            "needs the triton attention backend (attention_backend 'auto' or 'triton')",
        )
        _require(
            self.overlap_schedule in (None, True, False), "overlap_schedule", "must be null, true or false"
        )
        _require(
            self.overlap_schedule is not True or self.speculative is None,
            "overlap_schedule",
            "works without speculative decoding only (so far)",
        )
        _require(
            self.decode_steps is None or (_is_count(self.decode_steps, 0) and self.decode_steps <= 64),
            "decode_steps",
            "must be null or an integer in [0, 64]",
        )
        _require(
            not self.decode_steps or self.speculative is None,
            "decode_steps",
            "applies without speculative decoding (speculative.device_steps sets a speculative engine's)",
        )
        _require(
            _is_count(self.cuda_graph_max_batch),
            "cuda_graph_max_batch",
            "must be an integer >= 1",
        )
        _require(
            self.cuda_graph_prefill_tokens is None or _is_count(self.cuda_graph_prefill_tokens, 0),
            "cuda_graph_prefill_tokens",
            "must be null or an integer >= 0",
        )
        _require(
            _is_count(self.tp_size),
            "tp_size",
            "must be an integer >= 1",
        )
        self.cache.validate()
        _require(
            self.attention_backend != "flash" or self.cache.page_size % FLASH_PAGE_MULTIPLE == 0,
            "page_size",
            f"must be a multiple of {FLASH_PAGE_MULTIPLE} with attention_backend 'flash' "
            f"(vllm-flash-attn's paged KV block size), got {self.cache.page_size}",
        )
        self.scheduler.validate()
        if self.speculative is not None:
            self.speculative.validate()

    @classmethod
    def from_value(cls, value: EngineConfig | Mapping) -> EngineConfig:
        """Accept a config or a mapping of its fields (nested ones as mappings too, as
        `dataclasses.asdict` writes them): what a Ray actor receives."""
        if isinstance(value, EngineConfig):
            return value
        _require(isinstance(value, Mapping), "config", "must be an EngineConfig or a mapping of its fields")
        fields = dict(value)
        _require_known(fields, cls, "config")
        for name, sub in (("cache", CacheConfig), ("scheduler", SchedulerConfig)):
            if isinstance(fields.get(name), Mapping):
                _require_known(fields[name], sub, name)
                fields[name] = sub(**fields[name])
        model = fields.get("model", cls.model)
        fields["speculative"] = SpeculativeConfig.from_value(fields.get("speculative"), model)
        return cls(**fields)

    def for_model(self, *, hybrid: bool) -> EngineConfig:
        """This config with its automatic settings resolved for the loaded model. A hybrid model
        (recurrent layers, docs/hybrid-models.md) refuses what it cannot do, naming the setting:
        prefix caching, CUDA graphs and tensor parallelism default to off there."""
        cache = self.cache
        if not hybrid:
            on = cache.enable_prefix_cache is not False
            return replace(self, cache=replace(cache, enable_prefix_cache=on))
        reason = "is not available for hybrid (Mamba-2) models (docs/hybrid-models.md)"
        _require(cache.enable_prefix_cache is not True, "enable_prefix_cache", f"{reason}; leave it null")
        _require(self.cuda_graphs is not True, "cuda_graphs", f"{reason}; leave it null")
        _require(self.tp_size == 1, "tp_size", f"above 1 {reason}")
        return replace(self, cuda_graphs=False, cache=replace(cache, enable_prefix_cache=False))

    def torch_device(self) -> torch.device:
        """Where the engine runs; ValueError naming `device` for a GPU this process cannot see."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            _require(
                count > 0, "device", f"{self.device!r}, but this torch sees no CUDA GPU; use 'cpu' or 'auto'"
            )
            _require(
                device.index is None or device.index < count,
                "device",
                f"{self.device!r}, but this process sees {count} CUDA GPU(s)",
            )
        return device

    def use_cuda_graphs(self) -> bool:
        """Whether steps run through the bucketed static-buffer path (captured on CUDA)."""
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        triton = self.attention_backend in ("auto", "triton")
        return triton and self.torch_device().type == "cuda" and self.tp_size == 1

    def prefill_graph_tokens(self) -> int:
        """Token rows of the largest prefill graph bucket (0: none)."""
        if self.cuda_graph_prefill_tokens is not None:
            return self.cuda_graph_prefill_tokens
        return PREFILL_GRAPH_TOKENS if self.torch_device().type == "cuda" else 0

    def use_overlap(self) -> bool:
        if self.overlap_schedule is not None:
            return self.overlap_schedule
        return self.speculative is None

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return DTYPES[self.dtype]
