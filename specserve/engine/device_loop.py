"""Steps queued back to back on the device: n-gram chains, and plain decoding.

A speculative step's host work (read the verify's tokens, look up the next draft, build and copy the
next input) sits between two forwards, so at batch 1 the GPU idles for most of a step: a verify of
0.9 ms took 1.5-1.8 ms of wall time. For greedy requests nothing of a step needs the host: the
accept test is an argmax comparison, the next draft an n-gram lookup over tokens that can stay on
the device, and the next input's ids, positions and KV slots follow from the accepted counts. So
`DeviceLoop.launch` queues `iterations` whole steps, each [draft lookup and input, the verify
bucket's CUDA-graph replay, accept and append], and the host reads every step's tokens with one copy
at the end. The glue around the forward is two launches (`kernels/loop_glue.py`: `loop_prepare`,
`loop_accept`, one program per request each), their torch references on the CPU.

Per iteration and request (the verify bucket's static inputs written on the device):
- the input: the last token and `num_steps` draft tokens at positions len - 1 ... len - 1 + k, their
  slots from the request's page table (pages for every position the loop can reach were reserved
  by the caller beforehand);
- the accept test: leading drafts equal to the argmax of their rows (drafts past the lookup's
  match count as misses), then the argmax of the first rejected row: exactly the tokens the
  synchronous greedy verify emits, as the same forward computes them. For sampling requests the
  host path's rejection test of deterministic drafts (`SamplingRows.verify`): a draft passes with
  the target's probability of it, the first that fails takes a draw from the rest, and the draws
  use the host's counter-hashed noise, so the tokens are the synchronous path's;
- the append: at most `limits[b] - len` tokens (the request's own length limit, capped so every
  position stays inside the graph's context), cut after a stop id (the host's finish check still
  runs on every token, stop strings included, and cuts the same place or earlier); a request that
  reached its limit or a stop id turns inactive: its rows still run (fixed shapes) but write their
  KV to the dummy slot and append nothing.
The engine queues the next run over the same requests before it reads a run's records
(`launch(resume=True)`: the state stays on the device), so the host's appending hides behind the
device; a finished request's row runs on idle in the runs after it while more than a quarter of
the rows run (`carries`). Tokens past a stop only cost the run's remaining steps; `plan_steps` sizes
a run by the tokens a step has lately given. With adaptive speculation each chain tier has a loop, run for the
tier the policy holds (`Engine.device_loop`). The loops share one `LoopState` (histories, lengths,
limits, stop ids, sampling settings; a head's seeds live in the draft graphs' chain buckets, shared
too), so a switch of
tier queues the new tier's run behind the one in flight (`DeviceLoop.follows`) rather than settling
it first and setting up a fresh run while the device idles.

Plain decoding is the same loop with no drafts (`make_plain_loop`; adaptive n-gram speculation's off
tier too): each step's input is a request's last token, the decode bucket's graph runs, and the
argmax, or for sampling requests the host path's own draw (`SamplingRows`), is appended."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from specserve.config import SpeculativeConfig
from specserve.engine.host_copy import to_device
from specserve.engine.loop_logprobs import (
    LogprobShape,
    LoopLogprobs,
    asking_rows,
    logprob_shape,
    loop_records,
    loop_takes_logprobs,
)
from specserve.engine.request import LogprobRecord, Request
from specserve.engine.sampler import (
    GREEDY,
    SamplingFlags,
    device_batch,
    sample,
    sampling_columns,
    sampling_flags,
)
from specserve.executor.cuda_graphs import CudaGraphs, capture
from specserve.spec.adaptive import configured_tiers
from specserve.spec.verify import one_hot_chain_rows
from specserve_kernels import use_triton
from specserve_kernels.argmax import row_argmax, row_argmax_ref
from specserve_kernels.loop_glue import loop_accept, loop_accept_ref, loop_prepare, loop_prepare_ref

# Steps a run queues where `speculative.device_steps` is null (SPECSERVE_DEVICE_STEPS: another
# default, e.g. 0 to bench without the loop). More steps a run: fewer host reads, but new requests
# wait longer to be admitted and streams get their tokens in larger bursts.
DEVICE_STEPS = int(os.environ.get("SPECSERVE_DEVICE_STEPS", "8"))
# Stop ids a request may have and still run in the loop (EOS ids and `stop_token_ids` together).
MAX_STOPS = 8
# A chain of runs goes on over the rows of requests that finished while more than 1/CARRY_SHARE of
# its rows still run (SPECSERVE_LOOP_CARRY: another share, 0 never): a fresh run costs the device
# the host's settle of the last run and the new run's setup, while a narrower bucket saves little a
# step (`carries`).
CARRY_SHARE = int(os.environ.get("SPECSERVE_LOOP_CARRY", "4"))


@dataclass(frozen=True)
class LoopOutput:
    """Per iteration and request (host arrays): the tokens its verify produced (argmax of each
    row), how many of them the request takes, the real drafts it verified (0 once inactive), and
    where the run records logprobs, each asking request's rows' (`loop_logprobs.py`: by slot)."""

    tokens: np.ndarray  # [N, B, k + 1]
    counts: np.ndarray  # [N, B]
    drafted: np.ndarray  # [N, B]
    logprobs: np.ndarray | None = None  # [N, slots, k + 1, shape.width]
    shape: LogprobShape | None = None
    slots: tuple[int, ...] = ()  # the request row each slot records

    @cached_property
    def _lists(self) -> tuple[list, list, list]:
        # One conversion a run, not two numpy calls per (step, request): 512 pairs a settle at
        # batch 64, about 7% of its host time on this CPU
        return self.tokens.tolist(), self.counts.tolist(), self.drafted.tolist()

    def emitted(self, step: int, index: int) -> list[int]:
        tokens, counts, _ = self._lists
        return tokens[step][index][: counts[step][index]]

    def drafted_at(self, step: int, index: int) -> int:
        return self._lists[2][step][index]

    def logprob_records(self, step: int, index: int, tokens: list[int], req: Request) -> list[LogprobRecord]:
        """The records of the tokens a request took at `step` (it asked for logprobs)."""
        slot = self.slots.index(index)
        return loop_records(self.logprobs[step, slot], tokens, req.params, self.shape)


@dataclass(frozen=True)
class LoopRecords:
    """A launch's records copying to the host: `host` is valid once `done` has passed (None: on
    the CPU, at once); `shape`: the logprobs its rows record past the tokens, if any (slot s in row
    s), `slots` the request row of each."""

    host: torch.Tensor
    done: torch.cuda.Event | None
    shape: LogprobShape | None = None
    slots: tuple[int, ...] = ()


class SamplingRows:
    """What the loop samples a request's rows with besides their logits: its temperature,
    top_p and min_p ([3, B] float32), top_k, seed and prompt length (its counter, the output index
    being drawn, is its length less that), as the host path's `SamplingBatch` holds them."""

    def __init__(self, batch: int, device: torch.device) -> None:
        self.fixed = torch.zeros(3, batch, dtype=torch.float32, device=device)
        self.ints = torch.zeros(3, batch, dtype=torch.int64, device=device)  # top_k, seed, prompt length

    def write(self, reqs: list[Request], batch: int) -> None:
        """Rows of `reqs`, pad rows greedy; one copy (the ints, then the floats, in one buffer)."""
        buffer = np.zeros(36 * batch, dtype=np.uint8)
        ints = buffer[: 24 * batch].view(np.int64).reshape(3, batch)
        fixed = buffer[24 * batch :].view(np.float32).reshape(3, batch)
        n = len(reqs)
        fixed[:, :n], ints[0, :n] = sampling_columns([r.sampling_fixed for r in reqs])
        ints[1, :n] = [r.seed for r in reqs]
        ints[2, :n] = [r.prompt_len for r in reqs]
        packed = to_device(torch.from_numpy(buffer), self.fixed.device)
        self.ints[:, :batch].copy_(packed[: 24 * batch].view(torch.int64).view(3, batch))
        self.fixed[:, :batch].copy_(packed[24 * batch :].view(torch.float32).view(3, batch))

    def verify(
        self,
        logits: torch.Tensor,
        lengths: torch.Tensor,
        limits: torch.Tensor,
        drafts: torch.Tensor,
        valid: torch.Tensor,
        flags: SamplingFlags,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The host path's sampled verify of each request's chain (drafts [B, k], verify rows
        [B * (k + 1), V] with these filters; k = 0: plain decoding's `sample`), row j of a request
        counting its output index as its length less its prompt, plus j. Returns per row the token
        the chain emits if it gets that far [B, k + 1], and the drafts as the accept should match
        them (-1 where the accept test failed). A draft counts only inside the request's room less
        one, as the host proposes them: the last token a request may take is always drawn."""
        batch, k = drafts.shape
        rows = k + 1
        top_k, seed, prompt = self.ints[:, :batch]
        steps = torch.arange(rows, device=logits.device)
        sampling = device_batch(
            self.fixed[:, :batch, None].expand(3, batch, rows).reshape(3, -1),
            top_k[:, None].expand(batch, rows).reshape(-1),
            seed[:, None].expand(batch, rows).reshape(-1),
            ((lengths - prompt)[:, None] + steps).reshape(-1),
            flags,
        )
        if k == 0:
            return sample(logits, sampling).view(batch, 1), drafts
        has = valid & (steps[None, :k] < (limits - lengths - 1)[:, None])
        tokens, ok = one_hot_chain_rows(
            logits,
            sampling,
            torch.cat([drafts, torch.zeros_like(drafts[:, :1])], dim=1).view(-1),
            torch.cat([has, torch.zeros_like(has[:, :1])], dim=1).view(-1),
        )
        return tokens.view(batch, rows), torch.where(ok.view(batch, rows)[:, :k], drafts, -1)


class LoopState:
    """What a request is on the device between runs, whatever the chain length: its token history,
    length, limit, stop ids, sampling settings and named logprob ids, one row per request, as wide
    as the largest batch bucket, and the sampling filters of the run's rows (`flags`) and the
    logprobs they record (`logprobs`; its rows' records too). The loops of one engine share it;
    `max_steps` is the longest chain among them (limits leave room for its verify), `owner` the
    loop whose run was queued last (a run of another loop queued behind it first writes its own
    bucket's constants, `DeviceLoop._switch_in`)."""

    def __init__(self, batch: int, max_context: int, max_steps: int, device: torch.device) -> None:
        self.max_steps = max_steps
        # Room for the last append past a request's limit: writes never go out of the row.
        self.hist = torch.zeros(batch, max_context + max_steps + 1, dtype=torch.int64, device=device)
        self.lengths = torch.ones(batch, dtype=torch.int64, device=device)
        self.limits = torch.zeros(batch, dtype=torch.int64, device=device)
        self.stops = torch.full((batch, MAX_STOPS), -1, dtype=torch.int64, device=device)
        self.sampling = SamplingRows(batch, device)
        self.flags = GREEDY
        self.logprob_rows = LoopLogprobs(batch, max_steps + 1, device)
        self.logprobs: LogprobShape | None = None
        self.owner: DeviceLoop | None = None


class DeviceLoop:
    """N-gram chains of `num_steps` drafts, verified in the (batch, num_steps + 1) buckets of
    `graphs`. Its state (histories, lengths, limits, stop ids) lives in static buffers as wide as
    the largest bucket (`state`: shared with the engine's other loops; else its own); on CUDA one
    iteration, glue and forward, is captured per batch bucket (at construction, over inactive rows,
    so the capture run changes nothing). Sampling requests run too, verified (and with no drafts,
    drawn) as the host path does it; requests asking for logprobs too, each row recording them:
    such an iteration is captured per (batch bucket, the run's `SamplingFlags`, its `LogprobShape`)
    when a run first needs it."""

    def __init__(
        self,
        graphs: CudaGraphs,
        num_steps: int,
        min_match: int,
        max_match: int,
        max_context: int,
        state: LoopState | None = None,
    ) -> None:
        self.graphs, self.num_steps = graphs, num_steps
        self.min_match, self.max_match = min_match, max_match
        self.max_context = max_context
        self.query_len = num_steps + 1
        self.batch_sizes = tuple(
            b for b in graphs.buckets.batch_sizes if (b, self.query_len) in graphs.graphs
        )
        device = graphs.page_table.device
        batch = max(self.batch_sizes, default=0)
        self.page_size = graphs.kv_cache.page_size
        if state is None:
            state = LoopState(batch, max_context, num_steps, device)
        if state.max_steps < num_steps or state.hist.shape[0] < batch:
            raise ValueError(f"a loop of {num_steps}-chains over {batch} rows outgrows its shared state")
        self.state = state
        self.hist, self.lengths, self.limits, self.stops = (
            state.hist,
            state.lengths,
            state.limits,
            state.stops,
        )
        self.records = torch.zeros(batch, self.query_len + 2, dtype=torch.int64, device=device)
        # The glue around each forward: one Triton launch each on CUDA, the torch references else.
        kernels = use_triton(device)
        self.lookup = dict(
            num_steps=num_steps, min_match=min_match, max_match=max_match, page_size=self.page_size
        )
        self.prepare = loop_prepare if kernels else loop_prepare_ref
        self.accept = loop_accept if kernels else loop_accept_ref
        self.argmax = row_argmax if kernels else row_argmax_ref
        self.loop_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.run_graphs: dict[tuple[int, SamplingFlags, LogprobShape | None], torch.cuda.CUDAGraph] = {}
        self._pinned: list[torch.Tensor | None] = [None] * 3
        self._next_pinned = 0
        if graphs.captured and self.batch_sizes:
            self._capture_all()

    @property
    def max_batch(self) -> int:
        return max(self.batch_sizes, default=0)

    def ready(self, req: Request) -> bool:
        """Whether this loop's drafter can start the request now (n-gram: always; it reads tokens)."""
        return True

    @property
    def flags(self) -> SamplingFlags:
        """The sampling filters of the run queued last (its rows'), whichever loop queued it."""
        return self.state.flags

    @property
    def plain_run(self) -> bool:
        """The run queued last is greedy and records no logprobs: the iteration captured at start."""
        return self.state.flags.all_greedy and self.state.logprobs is None

    def flags_of(self, reqs: list[Request]) -> SamplingFlags:
        """The filters the host path's `SamplingBatch` of these requests would use: a run keeps
        them (a run whose requests' flags changed is not resumed, `Engine._loop_launch`)."""
        if all(r.greedy for r in reqs):
            return GREEDY
        fixed, top_k = sampling_columns([r.sampling_fixed for r in reqs])
        return sampling_flags(fixed[0], top_k, fixed[1], fixed[2])

    def hand_back(self, reqs: list[Request]) -> None:
        """The loop stops running `reqs`: whatever drafting state lives on the device goes back to
        them (n-gram: none)."""

    def limit(self, req: Request, max_model_len: int) -> int:
        """Tokens the request may reach in the loop: its own limits, and a verify's last position
        inside the graphs' context for the longest chain sharing the state (a limit holds across
        switches of tier)."""
        own = len(req.token_ids) + min(
            req.params.max_new_tokens - req.num_output, max_model_len - len(req.token_ids)
        )
        return min(own, self.max_context - self.state.max_steps + 1)

    def reach(self, req: Request, limit: int, iterations: int, ahead: int = 0) -> int:
        """Token slots a run of `iterations` may write KV to (up to its last verify's last
        position), starting up to `ahead` tokens past the request's known ones (a run in flight:
        its steps times its own loop's query length)."""
        start = min(limit, len(req.token_ids) + ahead)
        return min(limit - 1, start + (iterations - 1) * self.query_len) + self.num_steps

    def bucket(self, batch: int) -> int:
        """The batch bucket a run over `batch` rows takes."""
        return next(b for b in self.batch_sizes if b >= batch)

    def follows(self, other: DeviceLoop, batch: int) -> bool:
        """Whether a run of this loop over `batch` rows can be queued behind a run of `other` over
        the same rows, the requests' state staying on the device: the same loop, or one sharing its
        state whose run takes the same batch bucket (the rows past the batch stay the pad rows) and
        that has its iteration of the run's sampling filters captured (a capture runs over inactive
        rows: a run a switch queues cannot capture it)."""
        if other is self:
            return True
        return (
            other.state is self.state
            and batch <= self.max_batch
            and self.bucket(batch) == other.bucket(batch)
            and (not self.graphs.captured or self._graph(self.bucket(batch)) is not None)
        )

    def launch(
        self,
        reqs: list[Request],
        limits: list[int],
        stop_ids: list[list[int]],
        iterations: int,
        resume: bool = False,
    ) -> LoopRecords:
        """Queue `iterations` speculative steps of `reqs` (pages reserved up to `reach`, every
        request `loop_ready`); `stop_ids`: per request, the ids that end it (at most MAX_STOPS).
        `resume`: the same requests go on from where the run before left them on the device, that
        run this loop's or one it `follows` (only their page tables are copied again: pages reserved
        since). The host waits for nothing: the records copy to the host behind the steps, for
        `collect`."""
        n = len(reqs)
        batch = self.bucket(n)
        if resume:
            self._copy_pages(reqs, batch)
            if self.state.owner is not self:
                self._switch_in(batch)
        else:
            self.state.flags, self.state.logprobs = self.flags_of(reqs), logprob_shape(reqs, batch)
            self._capture_variant(batch)  # before the rows are set up: it runs over inactive ones
            self._setup(reqs, limits, stop_ids, batch)
            if not self.flags.all_greedy:  # greedy runs never read them
                self.state.sampling.write(reqs, batch)
        self.state.owner = self
        shape, k = self.state.logprobs, self.query_len
        asking = asking_rows(reqs) if shape is not None else ()
        if shape is not None and not resume:
            self.state.logprob_rows.write(reqs, asking, shape.slots)
        width = k + 2 + (0 if shape is None else k * shape.width)
        out = torch.empty(iterations, batch, width, dtype=torch.int64, device=self.hist.device)
        graph = self._graph(batch)
        for step in range(iterations):
            if graph is not None:
                graph.replay()
            else:
                self._iteration(batch)
            out[step, :, : k + 2].copy_(self.records[:batch])
            if shape is not None:
                slots = shape.slots
                out[step, :slots, k + 2 :].copy_(self.state.logprob_rows.records[:slots, : k * shape.width])
        return self._to_host(out[:, :n], shape, asking)

    def collect(self, records: LoopRecords) -> LoopOutput:
        """A launch's records on the host (the one wait for the device, for that launch's steps
        only: a launch queued behind it keeps running)."""
        if records.done is not None:
            records.done.synchronize()
        host = records.host.numpy()
        k, shape = self.query_len, records.shape
        logprobs = None if shape is None else host[:, :, k + 2 :].reshape(*host.shape[:2], k, shape.width)
        return LoopOutput(host[:, :, :k], host[:, :, k], host[:, :, k + 1], logprobs, shape, records.slots)

    def _to_host(self, out: torch.Tensor, shape: LogprobShape | None, slots: tuple[int, ...]) -> LoopRecords:
        """An asynchronous copy into the next of a few page-locked buffers (a run in flight and one
        being collected hold two; pinning per copy would cost the host ~0.1 ms a launch)."""
        if out.device.type != "cuda":
            return LoopRecords(out.clone(), None, shape, slots)
        slot = self._next_pinned
        self._next_pinned = (slot + 1) % len(self._pinned)
        buffer = self._pinned[slot]
        if buffer is None or buffer.numel() < out.numel():
            buffer = self._pinned[slot] = torch.empty(out.numel(), dtype=out.dtype, pin_memory=True)
        host = buffer[: out.numel()].view(out.shape)
        host.copy_(out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return LoopRecords(host, done, shape, slots)

    def reset_rows(self, batch: int) -> None:
        """Every row of `batch` inactive (length 1, limit 0): a step over them appends nothing and
        writes KV only to the dummy slot (captures, profiles)."""
        self.lengths[:batch].fill_(1)
        self.limits[:batch].zero_()

    def step_once(self, batch: int) -> None:
        """One uncaptured step of the first `batch` rows (the CPU's loop; profiles)."""
        self._iteration(batch)

    def _graph(self, batch: int) -> torch.cuda.CUDAGraph | None:
        if self.plain_run:
            return self.loop_graphs.get(batch)
        return self.run_graphs.get((batch, self.flags, self.state.logprobs))

    def _capture_variant(self, batch: int) -> None:
        """The iteration of this run's sampling filters and logprobs at `batch`, captured the first
        time a run needs it (over inactive rows: no run of this state is in flight)."""
        key = (batch, self.flags, self.state.logprobs)
        if self.plain_run or not self.graphs.captured or key in self.run_graphs:
            return
        self.reset_rows(self.max_batch)
        self.run_graphs[key], _ = capture(lambda: self._iteration(batch), self.graphs.pool)

    def _capture_all(self) -> None:
        pool = self.graphs.pool
        for batch in sorted(self.batch_sizes, reverse=True):
            self.reset_rows(self.max_batch)  # the warm-up and capture runs append nothing
            graph, _ = capture(lambda batch=batch: self._iteration(batch), pool)
            self.loop_graphs[batch] = graph
            pool = graph.pool()
        torch.cuda.synchronize()

    def _iteration(self, batch: int) -> None:
        """One speculative step of the first `batch` rows, all on the device: draft, input, forward,
        accept; its record in `records`."""
        self._verify(batch)

    def _verify(self, batch: int, given: torch.Tensor | None = None):
        """The verify of the first `batch` rows: its input (n-gram drafts, or `given` ones), the
        bucket's forward, the greedy accept and append. Returns the bucket's graph, the rows' argmax
        [batch, k + 1] and the forward's features (what a head drafts from)."""
        hist, lengths, limits = self.hist[:batch], self.lengths[:batch], self.limits[:batch]
        graph = self.graphs.graphs[(batch, self.query_len)]
        table, a = self.graphs.page_table[:batch], graph.attention
        inputs = (graph.ids, graph.positions, a.slot_mapping, a.seq_lens)
        drafts, valid = self.prepare(hist, lengths, limits, table, *inputs, **self.lookup, given=given)
        hidden, aux, logits = self.graphs.forward(graph)
        if self.flags.all_greedy:
            target = self.argmax(logits).view(batch, self.query_len)
        else:  # the accept then matches each draft its test passed
            target, drafts = self.state.sampling.verify(logits, lengths, limits, drafts, valid, self.flags)
        self.accept(target, drafts, valid, hist, lengths, limits, self.stops[:batch], self.records[:batch])
        if self.state.logprobs is not None:
            self.state.logprob_rows.record(logits, target, self.state.logprobs)
        return graph, target, hidden if aux is None else aux

    def _switch_in(self, batch: int) -> None:
        """A run queued behind another loop's over the same rows: this bucket's constants, which
        `_setup` would have written (its query starts: every row num_steps + 1 tokens). Queued on
        the device, behind the run in flight."""
        k = self.query_len
        starts = self.graphs.graphs[(batch, k)].attention.query_start
        torch.mul(torch.arange(batch + 1, dtype=starts.dtype, device=starts.device), k, out=starts)

    def _copy_pages(self, reqs: list[Request], batch: int) -> None:
        pages = self.graphs.page_table.shape[1]
        table = np.zeros((batch, pages), dtype=np.int64)
        for b, req in enumerate(reqs):
            table[b, : len(req.pages)] = req.pages
        self.graphs.page_table[:batch].copy_(to_device(torch.from_numpy(table), self.hist.device))

    def _setup(self, reqs, limits, stop_ids, batch: int) -> None:
        """One host-to-device copy: the histories' known tokens, lengths, limits, page-table rows and
        stop ids; the bucket's query starts (every row num_steps + 1 tokens). Pad rows: length 1,
        limit 0 (inactive). Columns past a row's length keep older tokens: nothing reads them."""
        n, k = len(reqs), self.query_len
        width = max(len(r.token_ids) for r in reqs)
        pages = self.graphs.page_table.shape[1]
        hist = np.zeros((batch, width), dtype=np.int64)
        table = np.zeros((batch, pages), dtype=np.int64)
        stops = np.full((batch, MAX_STOPS), -1, dtype=np.int64)
        lengths, limits_np = np.ones(batch, dtype=np.int64), np.zeros(batch, dtype=np.int64)
        for b, req in enumerate(reqs):
            size = len(req.token_ids)
            hist[b, :size] = req.token_mirror.first(req.token_ids, size)
            table[b, : len(req.pages)] = req.pages
            stops[b, : len(stop_ids[b])] = stop_ids[b]
        lengths[:n] = [len(r.token_ids) for r in reqs]
        limits_np[:n] = limits
        query_start = np.arange(batch + 1, dtype=np.int64) * k
        flat = np.concatenate([hist.ravel(), table.ravel(), stops.ravel(), lengths, limits_np, query_start])
        packed = to_device(torch.from_numpy(flat), self.hist.device)
        parts = packed.split([batch * width, batch * pages, batch * MAX_STOPS, batch, batch, batch + 1])
        self.hist[:batch, :width].copy_(parts[0].view(batch, width))
        self.graphs.page_table[:batch].copy_(parts[1].view(batch, pages))
        self.stops[:batch].copy_(parts[2].view(batch, MAX_STOPS))
        self.lengths[:batch].copy_(parts[3])
        self.limits[:batch].copy_(parts[4])
        self.graphs.graphs[(batch, k)].attention.query_start.copy_(parts[5])


@dataclass(frozen=True)
class LoopFlight:
    """A launched run the host has not read yet."""

    loop: DeviceLoop
    reqs: list[Request]
    limits: list[int]
    steps: int
    records: LoopRecords
    resumed: bool  # queued behind the run before: from its settle to its own, the device ran it alone
    retired: frozenset[int] = frozenset()  # rows whose requests had left when it was launched
    flags: SamplingFlags = GREEDY  # the sampling filters its rows were drawn with

    def live(self) -> list[tuple[int, Request]]:
        """(row, request) of the rows that had a request when the run was launched."""
        return [(row, req) for row, req in enumerate(self.reqs) if row not in self.retired]


def carries(flight: LoopFlight, running: list[Request]) -> bool:
    """Whether the next run goes on over `flight`'s rows (its state stays on the device): the running
    requests are its rows, or some of them, the rest finished (their rows then run idle: inactive,
    or writing only to the dummy page, their pages freed), and more than 1/CARRY_SHARE of the rows run.
    A fresh run over the survivors would leave the device idle while the host settles the last run
    and sets the new one up, every time a request finishes: 4-6 times a batch at batch 16 on the
    H200, where carrying made a static chain 1-4% faster and adaptive speculation 3-6%
    (docs/benchmarks.md, twenty-third session)."""
    if running == flight.reqs:
        return True
    if not CARRY_SHARE or CARRY_SHARE * len(running) <= len(flight.reqs):
        return False
    rows = set(flight.reqs)
    if not all(req in rows for req in running):
        return False  # a newcomer
    kept = set(running)
    return all(req.finished for req in flight.reqs if req not in kept)


def plan_steps(lengths: list[int], limits: list[int], ahead: float, rate: float, most: int) -> int:
    """Steps a run takes: enough for the request furthest from its limit at `rate` tokens a step,
    counting `ahead` tokens the run in flight likely adds (its steps at its own loop's rate: a
    switch from a chain to plain decoding's loop must not plan the plain run at the chain's rate),
    at most `most` (0: the run in flight likely ends them all). A low guess costs one more run; a
    high one, steps over finished rows."""
    need = 0
    for length, limit in zip(lengths, limits, strict=True):
        expected = min(limit, length + ahead)
        need = max(need, math.ceil((limit - expected) / rate))
    return min(most, need)


def make_device_loops(
    spec: SpeculativeConfig | None,
    graphs: CudaGraphs | None,
    max_context: int,
    single_rank: bool,
    head_loop: Callable[[int, LoopState], DeviceLoop] | None = None,
) -> tuple[dict[int, DeviceLoop], int]:
    """The engine's loops by chain length (the configured chain, or with adaptive speculation each
    chain tier's) and their steps a run; none where the loop does not apply. `single_rank`: TP size
    1 and a plain decoder (followers replay only what rank 0 broadcasts; a hybrid's states commit
    per verify on the host). `head_loop`: the loop of a chain length for a head drafter that can
    draft on the device (`HeadDeviceLoop`), None where it cannot; n-gram drafts need none."""
    if spec is None:
        return {}, 0
    steps = _run_steps(spec.device_steps, DEVICE_STEPS, "speculative.device_steps", graphs, single_rank)
    if steps <= 0:
        return {}, 0
    if spec.method != "ngram" and head_loop is None:
        if spec.device_steps is not None:
            raise ValueError(
                "speculative.device_steps: a head drafts in the device loop only with its draft graphs "
                "(SPECSERVE_DRAFT_GRAPHS)"
            )
        return {}, 0
    if spec.adaptive is not None:
        lengths = sorted({t.num_steps for t in configured_tiers(spec) if not t.off and t.topk == 1})
    else:
        lengths = [spec.num_steps] if spec.topk == 1 else []
    state = LoopState(
        max(graphs.buckets.batch_sizes), max_context, max(lengths, default=1), graphs.page_table.device
    )
    if head_loop is not None:
        loops = {k: head_loop(k, state) for k in lengths}
    else:
        match = spec.ngram_min_match, spec.ngram_max_match
        loops = {
            k: DeviceLoop(graphs, k, *match, max_context, state)
            for k in [*_off_loop(spec, lengths), *lengths]
        }
    loops = {k: loop for k, loop in loops.items() if loop.batch_sizes}
    return loops, (steps if loops else 0)


def _off_loop(spec: SpeculativeConfig, lengths: list[int]) -> list[int]:
    """[0] where adaptive n-gram speculation has an off tier beside loop chains: its plain steps run
    in the loop too, over the same state, so a switch to or from off is queued on the device like one
    between chains (and sampling requests, which no chain loop takes, decode there while off). A
    head's off steps stay on the host, whose forwards keep the features the head extends over when
    speculation resumes."""
    has_off = spec.adaptive is not None and any(t.off for t in configured_tiers(spec))
    return [0] if has_off and spec.method == "ngram" and lengths else []


def make_plain_loop(
    decode_steps: int | None, graphs: CudaGraphs | None, max_context: int, single_rank: bool
) -> tuple[dict[int, DeviceLoop], int]:
    """Without speculation: plain greedy decoding in the loop (chains of no drafts, the decode
    buckets), `decode_steps` steps a run (None: DEVICE_STEPS where graphs are captured, on CUDA; the
    CPU's uncaptured buckets keep the synchronous path, the loop's reference in tests). At batch 64
    on the H200 a synchronous plain step took 2.05-2.10 ms of wall time, more than a loop iteration
    verifying three tokens a request (docs/benchmarks.md, twenty-fifth session): the host's work
    per step, not the forward, set the pace."""
    default = DEVICE_STEPS if graphs is not None and graphs.captured else 0
    steps = _run_steps(decode_steps, default, "decode_steps", graphs, single_rank)
    if steps <= 0:
        return {}, 0
    loop = DeviceLoop(graphs, 0, 1, 1, max_context)
    return ({0: loop}, steps) if loop.batch_sizes else ({}, 0)


def _run_steps(
    setting: int | None, default: int, name: str, graphs: CudaGraphs | None, single_rank: bool
) -> int:
    """Steps a loop run queues (0: no loop): `setting`, or `default` where it is None; an explicit
    setting the engine cannot loop with is an error."""
    steps = setting if setting is not None else default
    if steps > 0 and (graphs is None or not single_rank):
        if setting is not None:
            raise ValueError(
                f"{name}: the device loop needs CUDA graphs (cuda_graphs), TP size 1 "
                "and a decoder without recurrent layers"
            )
        return 0
    return steps


def loop_ready(req: Request, settled: bool = True) -> bool:
    """A request the loop can run now: decoding, nothing in flight (`settled`: else, once its step
    in flight settles), logprobs (if asked for) within what the loop records, past min_new_tokens
    (whose bans the loop does not apply)."""
    p = req.params
    return (
        req.decoding
        and not (settled and req.num_pending)
        and loop_takes_logprobs(p)
        and req.num_output >= p.min_new_tokens
        and len(p.stop_token_ids) + (0 if p.ignore_eos else len(req.eos_token_ids)) <= MAX_STOPS
    )
