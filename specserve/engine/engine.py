"""The engine: `step()` = draft → schedule → build inputs → forward → verify/sample → postprocess → emit.

Everything runs in the caller's thread; a server drives `step()` in a loop and feeds
`add_request`/`abort` between steps.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
import uuid
from collections.abc import Sequence

import torch

from specserve.attention.backend import AttentionBackend
from specserve.attention.flash_backend import flash_attention_backend
from specserve.attention.torch_backend import TorchAttentionBackend
from specserve.attention.triton_backend import TritonAttentionBackend
from specserve.config import CacheConfig, EngineConfig, SpeculativeConfig
from specserve.engine.adaptive_control import AdaptiveSpeculation, context_tokens
from specserve.engine.cost_profile import profile_step_costs
from specserve.engine.device_loop import (
    DeviceLoop,
    LoopFlight,
    LoopOutput,
    carries,
    loop_ready,
    make_device_loops,
    make_plain_loop,
    plan_steps,
)
from specserve.engine.head_loop import head_loop_factory
from specserve.engine.host_copy import to_device
from specserve.engine.kv_cache import KVCache
from specserve.engine.kv_manager import KVManager
from specserve.engine.logprobs import PendingLogprobs, StepLogprobs, step_logprobs
from specserve.engine.output import make_output
from specserve.engine.overlap import InFlight
from specserve.engine.recurrent_batch import accepted_snapshots, build_recurrent_batch
from specserve.engine.request import FUTURE_TOKEN, Request
from specserve.engine.sampler import SamplingBatch, SamplingRow, greedy_tokens, sample
from specserve.engine.scheduler import ScheduledItem, Scheduler
from specserve.engine.state_pool import StatePool
from specserve.engine.stats import SpecSettings, StatsSink, StepStats
from specserve.engine.step_input import StepInput, build_step_input
from specserve.engine.text import TextState
from specserve.executor.cuda_graphs import CudaGraphs, GraphBuckets
from specserve.executor.host_threads import settle_host_threads
from specserve.executor.runner import make_runner
from specserve.executor.tp_group import agree_num_pages
from specserve.model.arch import ModelArch
from specserve.model.draft_heads import HEAD_METHODS, DraftHead
from specserve.model.head_checkpoint import load_head
from specserve.model.llama import LlamaForCausalLM
from specserve.model.loader import LoadedModel, load_model
from specserve.model.parallel import NO_TP, TPInfo, head_shard
from specserve.spec.adaptive import configured_tiers
from specserve.spec.draft_depths import VerifyShapes
from specserve.spec.draft_graphs import draft_graphs_enabled
from specserve.spec.drafter import Drafter, TargetFeed
from specserve.spec.head_drafter import HeadDrafter
from specserve.spec.ngram import NgramDrafter
from specserve.spec.standalone import StandaloneDrafter
from specserve.spec.tree_graphs import TreeShape
from specserve.spec.tree_verify import verify_trees
from specserve.spec.verify import verify_chains, verify_greedy_chains
from specserve.types import RequestOutput, SamplingParams
from specserve_kernels import check_indices
from specserve_kernels.kv_move import check_moves

CPU_DEFAULT_TOKENS = 65536  # the CPU pool is allocated lazily, so a generous default costs little


class Engine:
    """`tp`: this process's place in the target's TP group (rank 0 only; the other ranks run
    `specserve.executor.follower.run_follower`). The group must be initialised first and its size
    equal `config.tp_size`; without it the engine is single-process."""

    def __init__(
        self, config: EngineConfig, loaded: LoadedModel | None = None, tp: TPInfo | None = None
    ) -> None:
        self.config = config
        self.tp = tp or NO_TP
        _check_tp(config, self.tp, loaded)
        self.device, self.dtype = config.torch_device(), config.torch_dtype()
        self.loaded = loaded or load_model(
            config.model, self.device, self.dtype, self.tp, full_vocab=_uses_head(config)
        )
        settle_host_threads(self.device)
        weight = self.loaded.model.lm_head.weight
        if weight.device.type != self.device.type or weight.dtype != self.dtype:
            raise ValueError(
                f"model: the shared model lives on {weight.device} in {weight.dtype}, not "
                f"{self.device} in {self.dtype}"
            )
        self.model, self.arch, self.tokenizer = self.loaded.model, self.loaded.arch, self.loaded.tokenizer
        config = self.config = config.for_model(hybrid=self.arch.is_hybrid)
        self.max_model_len = context_length(config, self.arch)
        page_size = config.cache.page_size
        draft_weights = self._drafter_weights()
        self.states = state_pool(config, self.arch, self.dtype, self.device)  # before GPU memory is measured
        num_pages = self._num_pages(_kv_arch(draft_weights))
        self.kv_cache = KVCache.allocate(
            self.arch, num_pages, page_size, self.dtype, self.device, local_kv_heads(self.arch, self.tp)
        )
        self.kv = KVManager(num_pages, page_size, config.cache.enable_prefix_cache, self.states)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.backend: AttentionBackend = attention_backend(config)
        self.drafter = self._make_drafter(draft_weights, num_pages)
        # The speculation shape steps run with; starts as configured, may change between steps
        # (with adaptive speculation, its policy sets it every step).
        self.spec_settings = _configured_settings(config)
        adaptive = self.drafter is not None and config.speculative.adaptive is not None
        self.adaptive = AdaptiveSpeculation(config.speculative) if adaptive else None
        capture = self.drafter.capture if self.drafter is not None else None
        graphs = make_graphs(
            config, self.model, self.backend, self.kv_cache, self.max_model_len, capture or ()
        )
        self.runner = make_runner(self.model, self.backend, self.kv_cache, self.tp, graphs, self.states)
        buckets = self.runner.graph_buckets
        self._graph_bucket = buckets.pick if buckets is not None else None
        self._prefill_bucket = buckets.pick_prefill if buckets is not None and buckets.prefill_lens else None
        if buckets is not None and isinstance(self.drafter, HeadDrafter) and draft_graphs_enabled():
            chain, depth = _draft_depths(config.speculative)
            prefill = tuple(buckets.prefill_shapes())
            trees = _tree_shapes(config.speculative)
            self.drafter.use_graphs(buckets.batch_sizes, chain, depth, self.max_model_len, prefill, trees)
        single_rank = self.tp.size == 1 and self.states is None
        if self.drafter is None:
            self.device_loops, self._loop_steps = make_plain_loop(
                config.decode_steps, self.runner.graphs, self.max_model_len, single_rank
            )
        else:
            self.device_loops, self._loop_steps = make_device_loops(
                config.speculative,
                self.runner.graphs,
                self.max_model_len,
                single_rank,
                head_loop_factory(self.drafter, self.runner.graphs, self.max_model_len, config.speculative),
            )
        self._loop_flight: LoopFlight | None = None
        self._loop_settled: LoopFlight | None = None  # the run this step read, for the policy
        self._loop_before: DeviceLoop | None = None  # the loop of the run read before it
        # chain length -> tokens a step of its loop gives an active request, lately (plain: 1)
        self._loop_rates: dict[int, float] = {}
        self._overlap = config.use_overlap() and self.drafter is None
        # Adaptive speculation's plain steps overlap too, where the drafter needs nothing of them
        # (a head reads each step's features; n-gram and standalone drafters catch up from tokens).
        self._overlap_off = (
            self.adaptive is not None
            and config.overlap_schedule is not False
            and self.drafter.capture is None
        )
        if self.adaptive is not None:
            # Off in a loop (n-gram) is priced by its loop steps, like a chain's, not as an overlapped step.
            self.adaptive.overlapped_off = self._overlap_off and 0 not in self.device_loops
            self.adaptive.looped_chains = frozenset(self.device_loops)
            self.adaptive.shapes = verify_shapes(buckets)
            self.adaptive.acceptance.per_token = self.drafter.acceptance_in_stretches
            if isinstance(self.drafter, NgramDrafter):
                # a host lookup: scored while off, for free; per plain step, so per run of off's loop
                off_steps = self._loop_steps if 0 in self.device_loops else 1
                self.adaptive.use_shadow(self.drafter.lookup, off_steps)
        self._inflight: InFlight | None = None
        self._failure: Exception | None = None  # a failed overlapped launch, raised by the next step
        self._requests: dict[str, Request] = {}
        self._texts: dict[str, TextState] = {}
        # Texts of requests nobody streams with ids not detokenised yet (`_while_device_works`).
        self._unread_texts: list[TextState] = []
        self._pending: list[RequestOutput] = []
        self._rng = random.Random(config.seed)
        self._stats = StepStats()
        self.stats_sink: StatsSink | None = None
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._decode_one)
        if self.adaptive is not None and config.speculative.adaptive.profile:
            profile_step_costs(self, self.adaptive)

    # ---- public API -------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        stream: bool = True,
    ) -> str:
        """Queue a request; raises ValueError naming the offending field. `stream`: an output every
        step it makes tokens; else only its last (deltas then hold everything), and its text is
        decoded once at the end unless a stop string needs it sooner."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        prompt_ids = self._prompt_ids(prompt)
        params = self._resolve_max_new_tokens(prompt_ids, params)
        self._validate(prompt_ids, params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        eos = frozenset(self.loaded.eos_token_ids)
        req = Request(request_id, prompt_ids, params, seed, eos, stream=stream)
        self._requests[request_id] = req
        self._texts[request_id] = TextState(
            self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens, offsets=params.return_logprob
        )
        self.scheduler.add(req)
        self._stats.prompt_tokens += len(prompt_ids)
        return request_id

    def abort(self, request_id: str, error: str | None = None) -> bool:
        """Stop a request and free its pages; its last output comes with the next step (finish
        reason `abort`, or `error` with that message when the engine failed it)."""
        req = self._requests.get(request_id)
        if req is None or req.finished:
            return False
        req.drop_pending()  # an in-flight step's row of it is discarded when that step settles
        self.scheduler.remove(req)
        req.finish({"type": "error", "message": error} if error else {"type": "abort", "message": "aborted"})
        self._pending.append(self._emit(req, []))
        return True

    def attach_stats_sink(self, sink: StatsSink) -> None:
        """Hand every step's `StepStats` to `sink`, on the thread that steps; it hears the current
        state (gauges, speculative settings) at once."""
        self.stats_sink = sink
        self._end_step([])

    def speculative_settings(self) -> SpecSettings:
        """The standing speculation shape (adaptive: the policy's tier, not a probe's)."""
        return self.adaptive.settings() if self.adaptive is not None else self.spec_settings

    def load(self) -> dict[str, float]:
        """Cheap load figures for health checks and autoscaling: request counts and KV usage."""
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": self.kv.usage(),
            "num_retracted": self.scheduler.num_retracted,
        }

    def output_ids(self, request_id: str) -> list[int] | None:
        """A running or waiting request's output token ids so far (None: unknown or finished)."""
        req = self._requests.get(request_id)
        return None if req is None or req.finished else req.output_ids

    def is_active(self, request_id: str) -> bool:
        """Whether a request is waiting or running (known and not finished)."""
        return request_id in self._requests

    def has_unfinished(self) -> bool:
        busy = self._inflight is not None or self._failure is not None or self._loop_flight is not None
        return self.scheduler.has_work() or bool(self._pending) or busy

    def step(self) -> list[RequestOutput]:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        stats = self._stats
        stats.start_clock()
        outputs, self._pending = self._pending, []
        if self.adaptive is not None:
            outputs.extend(self._choose_tier())
        looped = self._loop_step() if self.device_loops else None
        if looped is not None:
            outputs.extend(looped)
            stats.stop_clock()
            if self.adaptive is not None:
                self._observe_loop(stats)
            self._end_step(outputs)
            return outputs
        self._propose_drafts()
        stats.lap("draft" if self.drafter is not None else None)
        items = self.scheduler.schedule(stats)
        overlap = self._overlap or (self._overlap_off and self.spec_settings.num_steps == 0)
        if overlap and (items or self._inflight is not None):
            outputs.extend(self._step_overlapped(items, stats))
            stats.stop_clock()
        elif items:
            outputs.extend(self._run_batch(items, stats))
            stats.stop_clock()
        else:
            stats.phases.clear()  # nothing ran: no step to time
        if self.adaptive is not None and items:
            self.adaptive.observe_step(items, stats, any(item.request.finished for item in items))
        elif self.adaptive is not None:
            self.adaptive.idle()
        self._end_step(outputs)
        return outputs

    def _run_batch(self, items: list[ScheduledItem], stats: StepStats) -> list[RequestOutput]:
        """Forward, verify/sample and postprocess one scheduled batch; phases timed on the host (a
        phase ends where the host waits for the GPU anyway: verify copies its results to the host)."""
        inp = self.build_input(items)
        capture = self.drafter.capture if self.drafter is not None else None
        # Drafts still on the device (a head's graphed chain): the input resolves them there and
        # verify reads them with its results, so the host waits once a step (`_verify`).
        pending = self.drafter.take_pending_drafts() if self.drafter is not None else None
        hidden, aux, logits = self.runner.execute(inp, capture or (), future=pending)
        self._while_device_works()  # the forward is queued: the host waits for it in `_verify`
        emitted, drawn_at = self._verify(items, inp, logits, pending)
        self._compact_accepted_paths(items, drawn_at)
        if self.states is not None:  # each verified request's state: its last accepted token's
            self.states.commit(*accepted_snapshots(inp.recurrent, emitted, drawn_at))
        stats.lap("target")
        if capture is not None:
            feeds = _target_feeds(items, emitted, drawn_at)
            features = hidden if aux is None else aux
            if self.spec_settings.num_steps > 0:
                self.drafter.after_target(feeds, features)
            else:  # a plain decode step: the drafter catches up when speculation resumes
                self.drafter.skip_target(feeds, features)
            stats.lap("draft")
        records = step_logprobs(items, inp, logits, emitted, drawn_at)
        outputs = []
        for index, item in enumerate(items):
            out = self._postprocess(item, emitted.get(index), records.get(index))
            if out is not None:
                outputs.append(out)
        for req in self.scheduler.running:
            # Draft KV past what the target kept belongs to rejected (or unverified) drafts.
            req.draft, req.draft_probs, req.draft_tree = [], None, None
            req.draft_computed = min(req.draft_computed, req.num_computed)
        stats.lap("postprocess")
        return outputs

    def build_input(self, items: list[ScheduledItem], future: dict[str, int] | None = None) -> StepInput:
        """The model input of a scheduled batch (`build_step_input`; `future`: overlap scheduling's
        rows of in-flight tokens), with a hybrid model's recurrent layout."""
        inp = build_step_input(
            items, self.kv.page_size, self.device, self._graph_bucket, future, self._prefill_bucket
        )
        if self.states is None:
            return inp
        m = self.arch.mamba
        return dataclasses.replace(
            inp, recurrent=build_recurrent_batch(items, m.conv_kernel, m.chunk_size, self.device)
        )

    # ---- overlap scheduling (specserve/engine/overlap.py) ----------------------------------------

    def _step_overlapped(self, items: list[ScheduledItem], stats: StepStats) -> list[RequestOutput]:
        """Launch this step, then settle the one before it, whose tokens were copying meanwhile."""
        previous, launched = self._inflight, None
        try:
            launched = self._launch(items, previous) if items else None
        except Exception as exc:  # the step before is sound: hand out its tokens, then fail this one
            self._failure = exc
        self._while_device_works()
        stats.lap("target")
        outputs = self._settle_step(previous) if previous is not None else []
        self._inflight = launched
        stats.lap("postprocess")
        return outputs

    def _launch(self, items: list[ScheduledItem], previous: InFlight | None) -> InFlight:
        """Forward and sampling on the device, no host wait; each sampling request gets a FUTURE_TOKEN."""
        inp = self.build_input(items, previous.rows if previous is not None else None)
        waits = previous is not None and any(item.request.num_pending for item in items)
        future = previous.future() if waits else None  # else no id needs resolving on the device
        _, _, logits = self.runner.execute(inp, future=future)
        owners = [items[index].request for index in inp.sample_items]
        counters = [req.num_output for req in owners]
        if owners:
            # Every logit row samples (a decode step): in order, so the rows need no gather.
            every_row = inp.sample_logit_rows.shape[0] == logits.shape[0]
            rows_logits = logits if every_row else logits[inp.sample_logit_rows]
            banned = self._banned(counters, owners)
            if all(r.greedy for r in owners):
                tokens = greedy_tokens(rows_logits, banned)  # no sampling batch to build or copy
            else:
                fixed, seeds = [r.sampling_fixed for r in owners], [r.seed for r in owners]
                batch = SamplingBatch.from_columns(fixed, seeds, counters, self.device)
                tokens = sample(rows_logits, batch, banned)
        else:
            tokens = torch.empty(0, dtype=torch.long, device=self.device)
        wants_logprobs = bool(inp.input_logprobs) or any(r.params.return_logprob for r in owners)
        # scored now, before the next step reuses the logits; read when this step settles
        logprobs = PendingLogprobs.launch(items, inp, logits, tokens) if wants_logprobs else None
        flight = InFlight.start(items, inp, tokens, logprobs)
        for item in items:
            item.request.num_computed = item.end
            item.request.settling = item.completes and item.request.prefill_only
        for req in owners:
            req.token_ids.append(FUTURE_TOKEN)
            req.num_pending += 1
            req.settling = req.num_output >= req.params.max_new_tokens
        return flight

    def _settle_step(self, flight: InFlight) -> list[RequestOutput]:
        tokens = flight.sampled()
        records = flight.logprobs.records() if flight.logprobs is not None else {}
        outputs = []
        for index, item in enumerate(flight.items):
            out = self._settle(item, tokens.get(index), records.get(index))
            if out is not None:
                outputs.append(out)
        return outputs

    def _settle(
        self, item: ScheduledItem, token: int | None, records: StepLogprobs | None
    ) -> RequestOutput | None:
        """`_postprocess` for a step launched earlier (num_computed already advanced at launch)."""
        req = item.request
        if req.finished:
            return None  # aborted, or stopped by the step before (this row was wasted)
        done = self._record_inputs(item, records)
        if done is not None:
            return done
        if token is None:  # a prefill chunk: nothing sampled yet
            self.kv.commit(req, self._cacheable(req))
            return None
        later = req.drop_pending() - 1  # FUTURE_TOKENs of steps launched since
        reason, delta = self._append(req, [token], records)
        self.kv.commit(req, self._cacheable(req))  # the known tokens' pages only
        if reason is not None:
            self._finish(req, reason)
        out = self._emit(req, delta)
        if reason is None and later:
            req.token_ids.extend([FUTURE_TOKEN] * later)
            req.num_pending = later
        return out

    def _end_step(self, outputs: list[RequestOutput]) -> None:
        """Start the next step's stats; with a sink, complete this step's (from host data) and hand
        them over."""
        stats, self._stats = self._stats, StepStats()
        if self.stats_sink is None:
            return
        for out in outputs:
            if out.finished:
                reason = out.finish_reason or "unknown"
                stats.finished[reason] = stats.finished.get(reason, 0) + 1
        stats.spec = self.speculative_settings()
        if self.adaptive is not None:
            self.adaptive.fill(stats)
        stats.num_running, stats.num_waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        stats.kv_usage = self.kv.usage()
        self.stats_sink.record_step(stats)

    def shutdown(self) -> None:
        """Release the TP followers (their loops return); the engine cannot step afterwards."""
        self.runner.shutdown()

    def keepalive(self) -> None:
        """Tell idle TP followers that rank 0 is alive (their wait for a step is a collective with a
        timeout); nothing at TP size 1."""
        self.runner.keepalive()

    def flush_cache(self) -> bool:
        self.kv.flush()
        return True

    def check_kv_accounting(self) -> None:
        """Invariant 4: with nothing running, no page is referenced; after a flush all pages are free."""
        idle = not self.scheduler.running
        self.kv.check(idle=idle)
        if idle:
            self.kv.flush()
            assert self.kv.pool.num_free == self.kv.pool.capacity, "pages leaked past a cache flush"

    # ---- admission ---------------------------------------------------------------------------

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("input_ids: must be a list of integers")
        return list(prompt)

    def _resolve_max_new_tokens(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """max_new_tokens None: whatever the context (and the KV pool) leaves after the prompt."""
        if params.max_new_tokens is not None:
            return params
        room = min(self.max_model_len, self.kv.capacity_tokens) - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"prompt: {len(prompt_ids)} tokens leave no room to generate within the context length "
                f"{min(self.max_model_len, self.kv.capacity_tokens)}"
            )
        return dataclasses.replace(params, max_new_tokens=room)

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab = self.arch.vocab_size
        if not prompt_ids:
            raise ValueError("prompt: must not be empty")
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt_ids)} tokens exceed the context length {self.max_model_len}"
            )
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"input_ids: every token id must be in [0, {vocab})")
        for name in ("stop_token_ids", "token_ids_logprob"):
            if any(t >= vocab for t in getattr(params, name) or ()):
                raise ValueError(f"{name}: every token id must be in [0, {vocab})")
        if params.top_logprobs_num > vocab:
            raise ValueError(f"top_logprobs_num: must be <= the vocabulary size {vocab}")
        if params.logprob_start_len > len(prompt_ids):
            raise ValueError(f"logprob_start_len: must be <= the prompt length {len(prompt_ids)}")
        total = len(prompt_ids) + params.max_new_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"max_new_tokens: prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the context length {self.max_model_len}"
            )
        if total > self.kv.capacity_tokens:
            raise ValueError(
                f"max_new_tokens: prompt + max_new_tokens ({total}) exceeds the KV cache ({self.kv.capacity_tokens} tokens)"
            )

    def _drafter_weights(self) -> DraftHead | LoadedModel | None:
        """A model drafter's weights, loaded before the KV pool is sized (its KV shares the pages)."""
        spec = self.config.speculative
        if spec is None or spec.method == "ngram":
            return None
        if spec.method in HEAD_METHODS:
            vocab = self.loaded.full_vocab  # whole copies under TP; None binds the target's own
            return load_head(
                spec.draft_model, spec.method, self.model, self.device, self.dtype, vocab, spec.draft_vocab
            )
        # Under TP the loaded target is this rank's shard: the drafter needs a whole model.
        same = spec.draft_model == self.config.model and self.tp.size == 1
        if same:
            return self.loaded
        return load_model(spec.draft_model, self.device, self.dtype, field="speculative.draft_model")

    def _make_drafter(self, weights: DraftHead | LoadedModel | None, num_pages: int) -> Drafter | None:
        spec = self.config.speculative
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramDrafter(spec.ngram_min_match, spec.ngram_max_match)
        page_size, vocab = self.config.cache.page_size, self.arch.vocab_size
        if isinstance(weights, DraftHead):
            return HeadDrafter(weights, vocab, num_pages, page_size, drafter_backend(self.backend))
        if weights.arch.max_position < self.max_model_len:
            raise ValueError(
                f"speculative.draft_model: its context ({weights.arch.max_position}) is shorter than "
                f"max_model_len ({self.max_model_len}); set max_model_len <= {weights.arch.max_position}"
            )
        backend = drafter_backend(self.backend)
        return StandaloneDrafter(weights, vocab, num_pages, page_size, self.dtype, self.device, backend)

    def _num_pages(self, draft_arch: ModelArch | None) -> int:
        per_token = KVCache.bytes_per_token(self.arch, self.dtype, local_kv_heads(self.arch, self.tp))
        if draft_arch is not None:
            per_token += KVCache.bytes_per_token(draft_arch, self.dtype)
        return agree_num_pages(pool_pages(self.config.cache, self.device, per_token), self.tp, self.device)

    # ---- one step ----------------------------------------------------------------------------

    def _choose_tier(self) -> list[RequestOutput]:
        """Adaptive speculation: this step's tier. Drafting needs every token known, so a plain step
        still in flight (overlapped) is settled first; its outputs are returned."""
        decoding = [req for req in self.scheduler.running if req.decoding]
        self.spec_settings = self.adaptive.decide(decoding, len(self.scheduler.waiting))
        if self.spec_settings.num_steps == 0 or self._inflight is None:
            return []
        flight, self._inflight = self._inflight, None
        outputs = self._settle_step(flight)
        self._stats.lap("settle")  # a wait for the step before: not this step's draft or verify
        return outputs

    def _propose_drafts(self) -> None:
        """Each decoding request gets up to num_steps draft tokens (or a tree that deep), never more
        than it may still emit (with adaptive speculation, up to the steps the policy gave it)."""
        shape = self.spec_settings
        if self.drafter is None or shape.num_steps == 0:
            return
        tree = shape.topk > 1
        reqs, budgets = [], []
        for req in self.scheduler.running:
            steps = self.adaptive.steps_for(req) if self.adaptive is not None else shape.num_steps
            budget = min(steps, self._draft_room(req)) if req.decoding else 0
            slots = self.drafter.tree_slots(budget, shape.topk, shape.num_draft_tokens) if tree else budget
            # A model drafter writes KV for its drafts: their pages must be held before it runs.
            if (
                budget > 0
                and self.drafter.needs_pages
                and not self.kv.reserve(req, len(req.token_ids) + slots)
            ):
                budget = 0
            if budget > 0:
                reqs.append(req)
                budgets.append(budget)
                if self.adaptive is not None:
                    self.adaptive.drafting(req, budget)
        if reqs and tree:
            self.drafter.draft_tree(reqs, budgets, shape.topk, shape.num_draft_tokens)
        elif reqs:
            self.drafter.draft(reqs, budgets)

    # ---- the device loop (specserve/engine/device_loop.py) ---------------------------------

    def _loop_step(self) -> list[RequestOutput] | None:
        """Launch the next run (on top of the one in flight when the batch is the same), then read
        and append the one in flight while the device works on the next. None: no run in flight
        and none launched; the synchronous path takes this step."""
        flight = self._loop_flight
        settled = self._settle_for_loop() if flight is None else []
        start = time.perf_counter()
        self._loop_flight = self._loop_launch(flight)
        if flight is None:
            if self._loop_flight is None:
                return settled or None
            if self.adaptive is not None:  # the device idled for it: a switch's cost
                self.adaptive.observe_setup(len(self._loop_flight.reqs), time.perf_counter() - start)
            return settled
        self._while_device_works()
        # the launch and the host work meanwhile: the step's, not its wait for the device (`target`)
        self._stats.lap(None)
        return self._loop_settle(flight, chained=self._loop_flight is not None)

    def _settle_for_loop(self) -> list[RequestOutput]:
        """Overlap scheduling's step in flight, settled where a loop run could take the batch once
        its tokens are known (plain decoding: the step before a run is the last overlapped one); its
        outputs. The device idles for that one wait, at the switch only."""
        if self._inflight is None or not self._loop_takes(self.device_loop, settled=False):
            return []
        flight, self._inflight = self._inflight, None
        outputs = self._settle_step(flight)
        self._stats.lap("settle")
        return outputs

    def _loop_takes(self, loop: DeviceLoop | None, settled: bool = True) -> bool:
        """Whether `loop` can run every running request, none waiting (`settled`: now; else once
        the step in flight has settled)."""
        reqs = self.scheduler.running
        if loop is None or self.scheduler.waiting or not reqs or len(reqs) > loop.max_batch:
            return False
        return all(loop_ready(r, settled) for r in reqs)

    @property
    def device_loop(self) -> DeviceLoop | None:
        """The loop of this step's chain length, if there is one (plain decoding's, of no drafts;
        with adaptive speculation: of the tier the policy chose, off's where n-gram drafting has
        one; not for a probe, which is measured step by step)."""
        shape = self.spec_settings
        if (shape.num_steps and shape.topk != 1) or (self.adaptive is not None and self.adaptive.probing):
            return None
        return self.device_loops.get(shape.num_steps)

    def _loop_launch(self, flight: LoopFlight | None) -> LoopFlight | None:
        """A run over every running request when all are ready for the loop and none waits, with
        pages for every position it may reach; None otherwise. Queued behind `flight`, it goes on
        over that run's rows while they `carries`: a finished request's row runs on idle; a switch
        of chain length queues the new length's run there too (`DeviceLoop.follows`)."""
        loop, reqs = self.device_loop, self.scheduler.running
        if not self._loop_takes(loop):
            return None
        if flight is not None and not (loop.follows(flight.loop, len(flight.reqs)) and carries(flight, reqs)):
            return None
        if flight is not None and reqs != flight.reqs and loop.flags_of(reqs) != flight.flags:
            return None  # the host would draw the rest with other filters: a fresh run, with them
        if flight is None and not all(loop.ready(r) for r in reqs):  # resumed: the device has its state
            return None
        rows = list(reqs) if flight is None else flight.reqs
        if flight is None:
            limits = [max(loop.limit(r, self.max_model_len), len(r.token_ids)) for r in reqs]
        else:
            limits = flight.limits
        running = set(reqs)
        live = [(req, limit) for req, limit in zip(rows, limits, strict=True) if req in running]
        # tokens the run in flight is likely to add, at its own loop's rate
        ahead = 0.0 if flight is None else flight.steps * self._loop_rates.get(flight.loop.num_steps, 1.0)
        lengths = [len(r.token_ids) for r, _ in live]
        rate = self._loop_rates.get(loop.num_steps, 1.0)
        steps = plan_steps(lengths, [limit for _, limit in live], ahead, rate, self._loop_steps)
        if steps <= 0:
            return None
        ahead_tokens = 0 if flight is None else flight.steps * flight.loop.query_len  # its own chains'
        for req, limit in live:
            if not self.kv.reserve(req, loop.reach(req, limit, steps, ahead_tokens)):
                if flight is None:  # the scheduler's step (and its retraction) takes over
                    for held in reqs:
                        self.kv.trim(held, len(held.token_ids))
                return None
        stops = [sorted(_stop_ids(r)) for r in rows]
        # Resumed, the page tables are copied again: a retired row's (its pages freed) is all the dummy page.
        records = loop.launch(rows, limits, stops, steps, resume=flight is not None)
        retired = frozenset(row for row, req in enumerate(rows) if req not in running)
        return LoopFlight(
            loop, rows, limits, steps, records, resumed=flight is not None, retired=retired, flags=loop.flags
        )

    def _loop_settle(self, flight: LoopFlight, chained: bool) -> list[RequestOutput]:
        """Each request's tokens of a run, appended as its synchronous verifies would have, step by
        step, up to the first that ends it. `chained`: a run over the same requests is in flight,
        writing KV into pages reserved past these tokens: they stay."""
        result = flight.loop.collect(flight.records)
        self._stats.lap("target")
        self._loop_settled = flight
        k = flight.loop.num_steps
        self._loop_rates[k] = _loop_rate(self._loop_rates.get(k, 1.0), result)
        appended = [
            (req, *self._loop_append(req, result, index, flight))
            for index, req in flight.live()
            if not req.finished  # aborted meanwhile: its row ran on, for nothing
        ]
        if self.adaptive is not None and flight.loop.num_steps:  # before finished requests are forgotten
            runs = [(req, verifies) for req, _, _, verifies in appended]
            self.adaptive.observe_run_chains(runs, len(flight.reqs))
        outputs = []
        for req, reason, delta, _ in appended:
            if reason is not None:
                self.kv.commit(req, self._cacheable(req))
                self._finish(req, reason)  # a run still in flight writes these pages first
            else:
                self.kv.commit_later(req, self._cacheable(req))
                if not chained:
                    self.kv.trim(req, len(req.token_ids))
                if not req.stream:
                    self._unread_texts.append(self._texts[req.request_id])
            out = self._emit(req, delta) if delta else None
            if out is not None:
                outputs.append(out)
        if not chained:
            flight.loop.hand_back(flight.reqs)
        self._stats.lap("postprocess")
        return outputs

    def _observe_loop(self, stats: StepStats) -> None:
        """A step that settled a run queued behind the one before it lasted as long as the device
        took for that run (the host appended the one before meanwhile): its steps' price, steady,
        for the adaptive policy; with `switch_runs_priced` off, not where a switch of chain length
        came just before or after the run. There the steps' walls do not split by run: on the H200
        (mixed prompts, batch 64, `scripts/trace_steps.py` TRACE_STEP_MS) the step settling the
        2-chain's last run before a switch to plain decoding took 18.8-23.4 ms (16-20 of them from
        the decision to the run's records: the next run's launch and the wait for the device, told
        apart since) and the next one 6.4-7.7 (runs of ~11.5 ms either side). Opt-in until the GPU
        settles it (docs/benchmarks.md, thirty-fifth session). The next step follows no step of its
        own shape."""
        flight, self._loop_settled = self._loop_settled, None
        seconds = stats.phases.get("step")
        before = self._loop_before
        if flight is not None:
            self._loop_before = flight.loop
        if flight is not None and flight.resumed and seconds:
            batch, depth = len(flight.reqs), flight.loop.num_steps
            context = context_tokens(flight.reqs)
            settle = stats.phases.get("postprocess", 0.0)
            after = self._loop_flight
            steady = self.adaptive.steady_run(
                before is not flight.loop, after is not None and after.loop is not flight.loop
            )
            self.adaptive.observe_loop(batch, depth, seconds / flight.steps, context, settle, steady)
            ended = any(req.finished for _, req in flight.live())
            self.adaptive.observe_run(batch, depth, stats.generation_tokens, seconds, ended, steady)
        self.adaptive.idle()

    def _loop_append(
        self, req: Request, result: LoopOutput, index: int, flight: LoopFlight
    ) -> tuple[dict | None, list[int], list[tuple[int, int]]]:
        """A request's tokens of a run appended step by step: its finish reason (None: it runs on),
        the tokens appended, and (depth, accepted) of each verify, for the adaptive policy."""
        delta: list[int] = []
        verifies: list[tuple[int, int]] = []  # (depth, accepted) of each verify, for the adaptive policy
        reason = None
        for step in range(flight.steps):
            tokens = result.emitted(step, index)
            if not tokens:
                break
            req.num_computed = len(req.token_ids) + len(tokens) - 1
            if flight.loop.num_steps:  # plain decoding's loop verifies nothing
                # a lookup that came out short is a miss past its end: the depth is the tier's
                depth = min(flight.loop.num_steps, flight.limits[index] - len(req.token_ids) - 1)
                verifies.append((depth, len(tokens) - 1))
                self._count_verify(req, result.drafted_at(step, index), len(tokens) - 1, adaptive=False)
            records = None
            if req.params.return_logprob:
                records = StepLogprobs(outputs=result.logprob_records(step, index, tokens, req))
            reason, added = self._append(req, tokens, records)
            delta += added
            if reason is not None:
                break
        return reason, delta, verifies

    def _draft_room(self, req: Request) -> int:
        """Drafts a request may take: a step emits up to drafts + 1 tokens, within its limits."""
        return min(req.params.max_new_tokens - req.num_output, self.max_model_len - len(req.token_ids)) - 1

    def _verify(
        self,
        items: list[ScheduledItem],
        inp: StepInput,
        logits: torch.Tensor,
        pending: torch.Tensor | None = None,
    ) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """Tokens each sampling item emits: accepted drafts plus one sampled (or corrected) token;
        and for items that verified a tree, the rows of its draft those tokens were drawn at.
        `pending`: the device drafts placeholders in the items' drafts name; read here, and the
        items (in `items`, in place) and their requests get the real drafts."""
        if not inp.sample_items:
            return {}, {}
        if self.spec_settings.topk > 1:
            return self._verify_trees(items, inp, logits)
        reqs = [items[i].request for i in inp.sample_items]
        drafts = [items[i].draft for i in inp.sample_items]
        # A verify step samples at every logit row, in order: no gather needed.
        every_row = inp.sample_logit_rows.shape[0] == logits.shape[0]
        rows_logits = logits if every_row else logits[inp.sample_logit_rows]
        if all(req.greedy for req in reqs):
            # Greedy requests need no sampling rows (the common case, and the one step time
            # matters most to at batch 1): the argmax decides, and bans only while min_new_tokens
            # holds (every row's output index is at least its request's num_output).
            banned = None
            if any(req.num_output < req.params.min_new_tokens for req in reqs):
                banned = self._banned(*self._chain_counters(items, inp))
            chains, drafts = verify_greedy_chains(rows_logits, drafts, banned, pending)
            if pending is not None:
                _resolve_items(items, inp.sample_items, drafts)
            return dict(zip(inp.sample_items, chains, strict=True)), {}
        counters, owners = self._chain_counters(items, inp)
        rows = [req.sampling_row(counter) for req, counter in zip(owners, counters, strict=True)]
        chains, drafts = verify_chains(
            rows_logits,
            rows,
            drafts,
            self._banned(counters, owners),
            self._draft_probs(items, inp, logits),
            pending,  # a head's graphed chains: resolved with the results, one host sync
        )
        if pending is not None:
            _resolve_items(items, inp.sample_items, drafts)
        return dict(zip(inp.sample_items, chains, strict=True)), {}

    @staticmethod
    def _chain_counters(items: list[ScheduledItem], inp: StepInput) -> tuple[list[int], list[Request]]:
        """Per verify row of a chain step, the output index it scores and its request."""
        counters: list[int] = []
        owners: list[Request] = []
        for index in inp.sample_items:
            item = items[index]
            req, rows = item.request, len(item.draft) + 1
            counters.extend(range(req.num_output, req.num_output + rows))
            owners.extend([req] * rows)
        return counters, owners

    def _verify_trees(
        self, items: list[ScheduledItem], inp: StepInput, logits: torch.Tensor
    ) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """`_verify` for tree drafts (`specserve/spec/tree_verify.py`): each row is scored at the
        output index of its depth."""
        rows: list[SamplingRow] = []
        owners: list[Request] = []
        trees = []
        for index in inp.sample_items:
            item = items[index]
            req, tree = item.request, item.request.draft_tree
            tree = tree.truncated(len(item.draft)) if item.draft and tree is not None else None
            trees.append(tree)
            depths = tree.depths.tolist() if tree is not None else [0]
            rows += [req.sampling_row(req.num_output + d) for d in depths]
            owners += [req] * len(depths)
        outcomes = verify_trees(
            logits[inp.sample_logit_rows],
            rows,
            trees,
            self._banned([row.counter for row in rows], owners),
            check_bounds=check_indices(),
        )
        emitted = {index: o.tokens for index, o in zip(inp.sample_items, outcomes, strict=True)}
        drawn_at = {index: o.rows for index, o in zip(inp.sample_items, outcomes, strict=True)}
        return emitted, drawn_at

    def _compact_accepted_paths(self, items: list[ScheduledItem], drawn_at: dict[int, list[int]]) -> None:
        """Invariant 6: move the KV of each accepted tree path (written at its nodes' rows) to the
        slots right after its root, in order, so the next step reads nothing of rejected branches.
        A model drafter's own KV needs no move: its extend rewrites the accepted positions."""
        src: list[int] = []
        dst: list[int] = []
        segments = [0]
        page_size = self.kv.page_size
        for index, rows in drawn_at.items():
            item = items[index]
            pages, start = item.request.pages, item.start + item.num_known - 1  # the root's position
            for k, row in enumerate(rows[1:], start=1):
                if row != k:
                    for context, out in ((start + row, src), (start + k, dst)):
                        out.append(pages[context // page_size] * page_size + context % page_size)
            if len(src) > segments[-1]:
                segments.append(len(src))
        if not src:
            return
        check_moves(src, dst, segments, self.kv_cache.k.shape[1])
        self.runner.move_kv(src, dst, segments)

    @staticmethod
    def _draft_probs(items: list[ScheduledItem], inp: StepInput, logits: torch.Tensor) -> torch.Tensor | None:
        """[rows, V] distributions sampled drafts were drawn from; zero rows for deterministic drafts
        (n-gram, a head's, greedy requests') and bonus rows. None when every draft is deterministic."""
        if not any(items[i].request.draft_probs is not None for i in inp.sample_items):
            return None
        blocks = []
        for index in inp.sample_items:
            item = items[index]
            block = torch.zeros(len(item.draft) + 1, logits.shape[1], device=logits.device)
            if item.draft and item.request.draft_probs is not None:
                block[: len(item.draft)] = item.request.draft_probs[: len(item.draft)]
            blocks.append(block)
        return torch.cat(blocks)

    def _banned(self, counters: list[int], owners: list[Request]) -> torch.Tensor | None:
        """min_new_tokens: stop ids and EOS cannot be drawn at an output index (counter) below it."""
        bans = [
            (i, _stop_ids(r))
            for i, (r, counter) in enumerate(zip(owners, counters, strict=True))
            if counter < r.params.min_new_tokens
        ]
        bans = [(i, ids) for i, ids in bans if ids]
        if not bans:
            return None
        banned = torch.zeros(len(counters), self.arch.vocab_size, dtype=torch.bool)
        for i, ids in bans:
            banned[i, list(ids)] = True
        return to_device(banned, self.device)

    def _postprocess(
        self, item: ScheduledItem, tokens: list[int] | None, records: StepLogprobs | None
    ) -> RequestOutput | None:
        req = item.request
        # Known tokens now have KV, and so do the accepted drafts (all emitted tokens but the last).
        req.num_computed = item.start + item.num_known + (len(tokens) - 1 if tokens else 0)
        done = self._record_inputs(item, records)
        if done is not None:
            return done
        speculating = self.drafter is not None and self.spec_settings.num_steps > 0
        if tokens and speculating and item.num_known == 1 and req.num_output > 0:
            self._count_verify(req, len(item.draft), len(tokens) - 1)  # a decode's verify (path length)
        reason, delta = self._append(req, tokens or [], records)
        # After the append: pages of accepted drafts are keyed by those tokens.
        if reason is not None:
            self.kv.commit(req, self._cacheable(req))
            self._finish(req, reason)
        else:  # put off while the request runs on: the next step's forward hides it
            self.kv.commit_later(req, self._cacheable(req))
            if tokens:
                self.kv.trim(req, len(req.token_ids))
                if not req.stream:  # its ids wait for the text to be read: detokenised meanwhile
                    self._unread_texts.append(self._texts[req.request_id])
        return self._emit(req, delta) if tokens else None

    def _while_device_works(self) -> None:
        """Host work earlier steps left that needs nothing of the step just launched, done while
        the device runs it (a speculative step's host otherwise idles until verify's results
        arrive): prefix-cache commits and detokenising the ids a speculative step gave requests
        nobody streams (else all decoded at their end, together when a batch ends together: 16 x
        256 tokens took 10-15 ms on a CPU). Either gives the same results whenever it runs.
        Overlapped plain steps leave their ids to the end: their host work is hidden anyway, and
        spread over the steps the decoding cost 3-4x more CPU time (on the CPU, where the forward
        between them leaves the tokenizer's tables out of the caches)."""
        self.kv.flush_commits()
        if self._unread_texts:
            texts, self._unread_texts = self._unread_texts, []
            for text in texts:
                text.catch_up()

    def _record_inputs(self, item: ScheduledItem, records: StepLogprobs | None) -> RequestOutput | None:
        """Keep the step's prompt logprobs; a prefill-only request whose prompt is now done ends here
        (its final output, else None). Shared by the synchronous and the overlapped postprocess."""
        req = item.request
        if records is not None:
            req.input_logprobs.extend(records.inputs)
        if not (item.completes and req.prefill_only):
            return None
        self.kv.commit(req, self._cacheable(req))
        self._finish(req, {"type": "length", "length": 0})
        return self._emit(req, [])

    def _append(
        self, req: Request, tokens: list[int], records: StepLogprobs | None
    ) -> tuple[dict | None, list[int]]:
        """Add emitted tokens up to the first that ends the request; (finish reason, tokens added)."""
        if not tokens:
            return None, []
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        delta: list[int] = []
        reason = None
        for i, token in enumerate(tokens):
            req.token_ids.append(token)
            delta.append(token)
            if records is not None and i < len(records.outputs):
                req.output_logprobs.append(records.outputs[i])
            reason = self._finish_reason(req, token)
            if reason is not None:
                break
        self._stats.generation_tokens += len(delta)
        return reason, delta

    def _cacheable(self, req: Request) -> int:
        """Leading tokens whose KV pages may enter the prefix cache: a model drafter's KV lives on
        the same pages, so a page is shared only once the drafter's entries in it are valid too."""
        if self.drafter is None or not self.drafter.needs_pages:
            return req.num_computed
        return min(req.num_computed, req.draft_computed)

    def _count_verify(self, req: Request, drafted: int, accepted: int, adaptive: bool = True) -> None:
        self._stats.count_verify(drafted, accepted)
        if adaptive and self.adaptive is not None:
            self.adaptive.observe_verify(req, accepted)
        req.spec_verify_ct += 1
        req.spec_draft_tokens += drafted
        req.spec_accepted_tokens += accepted
        hist = req.spec_accept_histogram
        hist.extend([0] * (accepted + 1 - len(hist)))
        hist[accepted] += 1

    def _finish_reason(self, req: Request, token: int) -> dict | None:
        params = req.params
        can_stop = req.num_output >= params.min_new_tokens
        stop_string = self._texts[req.request_id].push(token, check_stops=can_stop)
        if can_stop:
            if token in params.stop_token_ids or (not params.ignore_eos and token in req.eos_token_ids):
                return {"type": "stop", "matched": token}
            if stop_string is not None:
                return {"type": "stop", "matched": stop_string}
        if req.num_output >= params.max_new_tokens:
            return {"type": "length", "length": params.max_new_tokens}
        return None

    def _finish(self, req: Request, reason: dict) -> None:
        self.scheduler.remove(req)
        req.finish(reason)

    def _emit(self, req: Request, delta_ids: list[int]) -> RequestOutput | None:
        """Its output after this step, None for an unfinished request nobody streams (its one output,
        the last, has every token as new)."""
        if not req.stream:
            if not req.finished:
                return None
            delta_ids = req.output_ids
        text = self._texts[req.request_id]
        if req.finished:
            text.finish()
        out = make_output(req, text, self.token_text, delta_ids)
        if req.finished:
            del self._requests[req.request_id], self._texts[req.request_id]
            if self.adaptive is not None:
                self.adaptive.forget(req.request_id)
        return out

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def pool_pages(cache: CacheConfig, device: torch.device, bytes_per_token: int) -> int:
    """Pages of the KV pool (+ the dummy page): `max_total_tokens`, else what the free GPU memory
    holds at `bytes_per_token` (target and drafter KV), else a CPU default."""
    tokens = cache.max_total_tokens
    if tokens is None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        tokens = int(free * cache.gpu_memory_fraction) // bytes_per_token
    elif tokens is None:
        tokens = CPU_DEFAULT_TOKENS
    return -(-tokens // cache.page_size) + 1


def state_pool(
    config: EngineConfig, arch: ModelArch, dtype: torch.dtype, device: torch.device
) -> StatePool | None:
    """A hybrid model's recurrent-state pool: a slot per request that may run at once."""
    if not arch.is_hybrid:
        return None
    return StatePool(arch, config.scheduler.max_running_requests, dtype, device)


def attention_backend(config: EngineConfig) -> AttentionBackend:
    """The backend `config.attention_backend` names; "auto" is triton on CUDA (or with CUDA graphs
    asked for), torch on the CPU, never flash (TP followers build theirs here too)."""
    name = config.attention_backend
    if name == "auto":
        triton = config.torch_device().type == "cuda" or config.use_cuda_graphs()
        name = "triton" if triton else "torch"
    if name == "flash":  # checked here, where it runs: the library must import on this machine
        return flash_attention_backend(config.torch_device(), config.torch_dtype())
    return {"torch": TorchAttentionBackend, "triton": TritonAttentionBackend}[name]()


def drafter_backend(target: AttentionBackend) -> AttentionBackend:
    """A model drafter's attention over its own KV: the torch reference beside a torch target, else our
    Triton kernels (flash cannot express a draft tree's mask). Drafters used the torch backend on
    CUDA too, whose SDPA picked cuDNN and re-planned for every new context length: 320 ms an EAGLE-3
    tree draft step on the H100."""
    return TorchAttentionBackend() if isinstance(target, TorchAttentionBackend) else TritonAttentionBackend()


def context_length(config: EngineConfig, arch: ModelArch) -> int:
    """The longest sequence (prompt + output) a request may have: `max_model_len`, within the model's
    (past it: a ValueError; it was cut to the model's without a word, the config still saying more)."""
    if config.max_model_len is not None and config.max_model_len > arch.max_position:
        raise ValueError(
            f"max_model_len: {config.max_model_len} exceeds the model's context {arch.max_position}"
        )
    return config.max_model_len or arch.max_position


def make_graphs(
    config: EngineConfig,
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    kv_cache: KVCache,
    max_model_len: int,
    capture: tuple[int, ...] = (),
) -> CudaGraphs | None:
    """The decode/verify CUDA graphs of this config (None when off). Every TP rank calls this with
    the same config, in the same order (a capture under TP runs collectives)."""
    if not config.use_cuda_graphs():
        return None
    return CudaGraphs(model, backend, kv_cache, graph_buckets(config), max_model_len, capture)


def graph_buckets(config: EngineConfig) -> GraphBuckets:
    """The (batch, query len) buckets of this config's CUDA graphs: decode, and the verify shapes."""
    spec = config.speculative
    max_draft = spec.num_steps if spec is not None and spec.topk == 1 else 0
    tree_len = spec.draft_tokens + 1 if spec is not None and spec.topk > 1 else 0
    # Adaptive speculation's shorter chains get buckets of their own (else padded to the longest).
    tiers = configured_tiers(spec) if spec is not None and spec.adaptive is not None else ()
    chains = tuple(t.query_len for t in tiers if t.topk == 1 and not t.off)
    max_batch = min(config.cuda_graph_max_batch, config.scheduler.max_running_requests)
    return GraphBuckets.for_engine(max_batch, max_draft, tree_len, chains, config.prefill_graph_tokens())


def verify_shapes(buckets: GraphBuckets | None) -> VerifyShapes:
    """Where the engine's verify passes are padded to a CUDA-graph bucket (adaptive speculation prices
    a narrower row there as free; elsewhere by its tokens). Tree buckets are left out: only chains
    are given per-request depths."""
    if buckets is None:
        return VerifyShapes()
    lens = tuple(q for q in buckets.query_lens if q not in buckets.masked_lens)
    return VerifyShapes(lens, max(buckets.batch_sizes), tuple(buckets.batch_sizes))


def local_kv_heads(arch: ModelArch, tp: TPInfo) -> int:
    """KV heads this rank's cache holds (all of them at TP size 1)."""
    return len(head_shard(arch.num_heads, arch.num_kv_heads, tp).kv)


def _check_tp(config: EngineConfig, tp: TPInfo, loaded: LoadedModel | None) -> None:
    if not tp.is_driver:
        raise ValueError(f"tp_size: rank {tp.rank} follows (run_follower); only rank 0 runs an Engine")
    if config.tp_size != tp.size:
        raise ValueError(
            f"tp_size: the config asks for {config.tp_size} ranks but the engine's TP group has "
            f"{tp.size}; start the group first (specserve.executor) and pass its TPInfo"
        )
    if loaded is not None and loaded.model.tp.size != tp.size:
        raise ValueError(f"tp_size: the given model is split {loaded.model.tp.size} ways, not {tp.size}")


def _uses_head(config: EngineConfig) -> bool:
    return config.speculative is not None and config.speculative.method in HEAD_METHODS


def _kv_arch(weights: DraftHead | LoadedModel | None) -> ModelArch | None:
    """The shape of a model drafter's KV cache (None: the drafter keeps none)."""
    if isinstance(weights, DraftHead):
        return weights.spec.arch
    return weights.arch if weights is not None else None


def _target_feeds(
    items: list[ScheduledItem], emitted: dict[int, list[int]], drawn_at: dict[int, list[int]]
) -> list[TargetFeed]:
    """Per item, the positions whose target features this step produced and whose next token is now
    known (verified or prompt tokens), with those next tokens: what a hidden-state drafter extends.
    After a tree verify those positions' features are at the accepted path's rows."""
    feeds, offset = [], 0
    for index, item in enumerate(items):
        req, new = item.request, emitted.get(index, [])
        tokens = req.token_ids[item.start + 1 : item.start + item.num_known + 1] + new
        rows: range | list[int] = range(offset, offset + len(tokens))
        if index in drawn_at:  # known tokens first, then the rows the emitted tokens were drawn at
            last = offset + item.num_known - 1
            rows = [*range(offset, last), *(last + r for r in drawn_at[index])]
        feeds.append(TargetFeed(req, item.start, tokens, rows, bool(new)))
        offset += item.num_tokens
    return feeds


def _resolve_items(items: list[ScheduledItem], indices: Sequence[int], drafts: list[list[int]]) -> None:
    """Items `indices` (and their requests) with these drafts, placeholders resolved; in place."""
    for index, draft in zip(indices, drafts, strict=True):
        item = items[index]
        if any(t < 0 for t in item.draft):
            items[index] = item._replace(draft=tuple(draft))
            item.request.draft = list(draft)


def _loop_rate(rate: float, result: LoopOutput) -> float:
    """The tokens a loop step gives an active request: a moving mean over runs, at least 1."""
    active = int((result.counts > 0).sum())
    if not active:
        return rate
    return max(1.0, 0.5 * rate + 0.5 * float(result.counts.sum()) / active)


def _stop_ids(req: Request) -> frozenset[int]:
    ids = set(req.params.stop_token_ids)
    if not req.params.ignore_eos:
        ids |= req.eos_token_ids
    return frozenset(ids)


def _draft_depths(spec: SpeculativeConfig) -> tuple[int, int]:
    """The longest chain (0: none) and the deepest draft, chain or tree, of any shape `spec` may run."""
    tiers = configured_tiers(spec) if spec.adaptive is not None else ()
    shapes = [(spec.num_steps, spec.topk), *((t.num_steps, t.topk) for t in tiers if not t.off)]
    return max((n for n, k in shapes if k == 1), default=0), max(n for n, _ in shapes)


def _tree_shapes(spec: SpeculativeConfig) -> tuple[TreeShape, ...]:
    """The tree shapes (depth, topk, nodes) `spec` may run, for the drafter's tree graphs."""
    tiers = configured_tiers(spec) if spec.adaptive is not None else ()
    shapes = [(spec.num_steps, spec.topk, spec.draft_tokens)]
    shapes += [(t.num_steps, t.topk, t.num_draft_tokens) for t in tiers if not t.off]
    return tuple(sorted({TreeShape(*shape) for shape in shapes if shape[1] > 1}))


def _configured_settings(config: EngineConfig) -> SpecSettings:
    spec = config.speculative
    if spec is None:
        return SpecSettings()
    return SpecSettings(spec.num_steps, spec.topk, spec.draft_tokens)
