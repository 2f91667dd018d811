"""CUDA graphs of the target's forward for decode and verify steps, one per (batch, query len) bucket.

At small batch a decode step is launch-bound: a few hundred kernels of microseconds each, issued by
Python. Each bucket's forward (every layer, the final norm and the logits of every token row) is
captured once over static input buffers; a step that fits a bucket arrives padded to it
(`build_step_input`), its packed inputs are copied into the bucket's buffers (two copies: the leading
token and request arrays, and the page table into the top-left corner of a table as wide as the
context), and the graph is replayed. Decode steps use query len 1, verify steps num_steps + 1; a
request with fewer drafts simply has fewer tokens (the kernels read every length on the device).
Draft-tree verify steps use query len num_draft_tokens + 1 in buckets with a static tree mask too
(`masked_lens`, only up to `max_masked_batch`: every token row's logits are kept); a step without a
tree that lands there gets the causal mask.

Prefill buckets (`prefill_lens`, up to `prefill_rows` token rows a bucket) take steps that sample at
most one row a request: a prompt, or prompts beside decodes. Their graphs compute the logits of the
rows a static index names (the step's logit rows, copied in before the replay), not of every row: a
prompt of 500 tokens needs one. An eager prefill of ~100 tokens at batch 1 costs ~11 ms of Python
kernel launches on an H100; its replay, about a decode step.

Buckets are captured largest first into one memory pool. The attention's key-split count is fixed
at capture for the longest context, so one graph serves every context length. Without CUDA (tests on
the CPU) the same buffers and padding run eagerly instead of being captured.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch

from specserve.attention.backend import AttentionBackend, AttentionBatch
from specserve.engine.kv_cache import KVCache
from specserve.engine.step_input import PREFILL_GRAPH, StepInput, graph_head_size, resolve_future_ids
from specserve.model.llama import LlamaForCausalLM

# (final hidden [T, H], captured residual streams or None, fp32 logits [T, V]) of every token row
Outputs = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]
T = TypeVar("T")
MAX_MASKED_ROWS = 1040  # token rows of the largest tree bucket (16 requests x 64 draft tokens + root)
# The smallest batch bucket (SPECSERVE_MIN_GRAPH_BATCH=8: a batch of 1 replays the batch-8 graph,
# padded): on an H100 the batch-8 replay measured 0.97 ms against 1.20 ms at batch 1.
MIN_GRAPH_BATCH = int(os.environ.get("SPECSERVE_MIN_GRAPH_BATCH", "1"))


@dataclass(frozen=True)
class GraphBuckets:
    """The shapes graphs exist for: a step of B requests with at most Q tokens each runs in the
    smallest bucket (b >= B, q >= Q)."""

    batch_sizes: tuple[int, ...]  # ascending
    query_lens: tuple[int, ...]  # ascending
    masked_lens: tuple[int, ...] = ()  # query lens whose buckets carry a tree mask
    max_masked_batch: int = 0
    prefill_lens: tuple[int, ...] = ()  # ascending query lens of prefill buckets
    prefill_rows: int = 0  # token rows of the largest prefill bucket

    @classmethod
    def for_engine(
        cls,
        max_batch: int,
        max_draft: int,
        tree_len: int = 0,
        extra_lens: tuple[int, ...] = (),
        prefill_rows: int = 0,
    ) -> GraphBuckets:
        """Batch sizes 1, 2, 4, 8, then every 8 up to `max_batch`; query len 1 (decode) and, with
        speculation, `max_draft` + 1 (chain verify) or `tree_len` (tree verify, masked, at most
        MAX_MASKED_ROWS token rows a bucket); `extra_lens`: more query lens (adaptive speculation's
        shorter chains, so a short draft is not padded to the longest); prefill buckets of 16, 32,
        ... tokens a request up to `prefill_rows` rows a bucket."""
        sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 8)) + [max_batch]
        sizes = tuple(sorted({b for b in sizes if b >= min(MIN_GRAPH_BATCH, max_batch)}))
        lens = tuple(sorted({1, *extra_lens, *((max_draft + 1,) if max_draft > 0 else ())}))
        prefill = prefill_lens(sizes[0], prefill_rows)
        if tree_len > 1:
            most = max(1, min(max_batch, MAX_MASKED_ROWS // tree_len))
            return cls(sizes, tuple(sorted({*lens, tree_len})), (tree_len,), most, prefill, prefill_rows)
        return cls(sizes, lens, prefill_lens=prefill, prefill_rows=prefill_rows)

    def pick(self, batch: int, max_query_len: int, tree: bool = False) -> tuple[int, int] | None:
        """The bucket of a step (`tree`: it carries a tree mask, so only a masked bucket serves)."""
        b = next((s for s in self.batch_sizes if s >= batch), None)
        lens = self.masked_lens if tree else self.query_lens
        q = next((s for s in lens if s >= max_query_len), None)
        if b is None or q is None or (q in self.masked_lens and b > self.max_masked_batch):
            return None
        return b, q

    def pick_prefill(self, batch: int, max_query_len: int, logit_rows: int) -> tuple[int, int] | None:
        """The prefill bucket of a step of `batch` requests sampling `logit_rows` rows (at most one a
        request: the bucket's logit index has a row a request)."""
        b = next((s for s in self.batch_sizes if s >= batch), None)
        q = next((s for s in self.prefill_lens if s >= max_query_len), None)
        if b is None or q is None or b * q > self.prefill_rows or logit_rows > b:
            return None
        return b, q

    def shapes(self) -> list[tuple[int, int]]:
        return [
            (b, q)
            for q in self.query_lens
            for b in self.batch_sizes
            if q not in self.masked_lens or b <= self.max_masked_batch
        ]

    def prefill_shapes(self) -> list[tuple[int, int]]:
        return [(b, q) for q in self.prefill_lens for b in self.batch_sizes if b * q <= self.prefill_rows]


def prefill_lens(smallest_batch: int, rows: int) -> tuple[int, ...]:
    """Query lens 16, 32, 64, ... of prefill buckets whose smallest batch fits `rows` token rows."""
    lens, q = [], 16
    while smallest_batch * q <= rows:
        lens.append(q)
        q *= 2
    return tuple(lens)


class _Graph:
    """One bucket: its static inputs, its outputs and (on CUDA) the captured graph."""

    def __init__(
        self,
        batch: int,
        query_len: int,
        page_table: torch.Tensor,
        page_size: int,
        max_seq_len: int,
        masked: bool = False,
        prefill: bool = False,
    ) -> None:
        tokens = batch * query_len
        self.head = torch.zeros(graph_head_size(tokens, batch), dtype=torch.int64, device=page_table.device)
        ids, positions, slots, query_start, seq_lens = self.head.split([tokens] * 3 + [batch + 1, batch])
        # Until the first real step: every request query_len tokens over the dummy page.
        query_start.copy_(torch.arange(batch + 1) * query_len)
        seq_lens.fill_(query_len)
        self.ids, self.positions = ids, positions
        self.mask = self.causal = None
        if masked:
            rows = torch.arange(query_len, device=page_table.device)
            self.causal = (rows[:, None] >= rows[None, :]).expand(batch, -1, -1).contiguous()
            self.mask = self.causal.clone()
        self.attention = AttentionBatch(
            query_start, seq_lens, slots, page_table[:batch], page_size, query_len, max_seq_len, self.mask
        )
        # A prefill bucket's logit rows, one a request at most (pads read row 0).
        self.logit_index = (
            torch.zeros(batch, dtype=torch.int64, device=page_table.device) if prefill else None
        )
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Outputs | None = None


class CudaGraphs:
    """Captures every bucket of `buckets` at construction (on CUDA); `run` executes a padded step."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        kv_cache: KVCache,
        buckets: GraphBuckets,
        max_seq_len: int,
        capture: tuple[int, ...] = (),
    ) -> None:
        self.model, self.backend, self.kv_cache = model, backend, kv_cache
        self.buckets, self.capture_layers = buckets, capture
        page_size = kv_cache.page_size
        device = kv_cache.k.device
        self.page_table = torch.zeros(
            max(buckets.batch_sizes), -(-max_seq_len // page_size), dtype=torch.int64, device=device
        )
        self.graphs = {
            (b, q): _Graph(b, q, self.page_table, page_size, max_seq_len, q in buckets.masked_lens)
            for b, q in buckets.shapes()
        }
        self.prefill = {
            (b, q): _Graph(b, q, self.page_table, page_size, max_seq_len, prefill=True)
            for b, q in buckets.prefill_shapes()
        }
        self.captured = device.type == "cuda"
        self.pool = None  # the graphs' memory pool (later captures over these buckets share it)
        if self.captured:
            self._capture_all()

    def run(
        self, step: StepInput, capture: tuple[int, ...] = (), future: torch.Tensor | None = None
    ) -> Outputs:
        """The outputs of a padded step's real rows (views of the bucket's static outputs: consume
        them before the next step). `future`: see `ModelRunner.execute`."""
        if capture != self.capture_layers:
            raise ValueError(f"capture: graphs were captured for layers {self.capture_layers}, not {capture}")
        a = step.attention
        key = (a.batch_size, a.max_query_len)
        graph = self.prefill[key] if step.graphed == PREFILL_GRAPH else self.graphs[key]
        graph.head.copy_(step.packed[: graph.head.numel()])
        self.page_table[: a.batch_size, : a.page_table.shape[1]].copy_(a.page_table)
        if graph.mask is not None:
            graph.mask.copy_(a.custom_mask if a.custom_mask is not None else graph.causal)
        rows = step.logit_rows.shape[0]
        if graph.logit_index is not None:
            graph.logit_index.zero_()
            graph.logit_index[:rows].copy_(step.logit_rows)
        if future is not None:
            resolve_future_ids(graph.ids, future)
        hidden, aux, logits = self.replay(graph)
        tokens = step.num_tokens if step.num_tokens is not None else rows  # a verify's: its logit rows
        return hidden[:tokens], None if aux is None else aux[:tokens], logits[:rows]

    def replay(self, graph: _Graph) -> Outputs:
        """A bucket's forward over what its static inputs (and the page table) hold now: the caller
        wrote them (`run`, or the device loop on the device); outputs of every padded row."""
        if self.captured:
            graph.graph.replay()
            return graph.outputs
        return self._forward(graph)

    def forward(self, graph: _Graph) -> Outputs:
        """A bucket's forward run (or captured, inside a caller's capture) over its static inputs."""
        return self._forward(graph)

    def _forward(self, graph: _Graph) -> Outputs:
        ctx = self.backend.prepare(graph.attention, self.kv_cache)
        hidden, aux = self.model.forward_features(graph.ids, graph.positions, ctx, self.capture_layers)
        rows = hidden if graph.logit_index is None else hidden.index_select(0, graph.logit_index)
        return hidden, aux, self.model.compute_logits(rows)

    def _capture_all(self) -> None:
        pool = None
        every = [*self.graphs.values(), *self.prefill.values()]
        # Largest first, so smaller buckets reuse the pool's blocks.
        for graph in sorted(every, key=lambda g: (-g.ids.shape[0], -g.attention.batch_size)):
            graph.graph, graph.outputs = capture(lambda graph=graph: self._forward(graph), pool)
            pool = graph.graph.pool()
        self.pool = pool
        torch.cuda.synchronize()


def capture(forward: Callable[[], T], pool=None) -> tuple[torch.cuda.CUDAGraph, T]:
    """`forward` run once on a side stream (compiling its kernels and setting up cuBLAS off the
    graph), then captured into a graph on `pool`; returns the graph and the captured outputs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph, pool=pool):
        outputs = forward()
    return graph, outputs


@contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection inside a capture: a collection there that frees an older engine's graph
    resets it while the stream captures, which CUDA refuses, and the capture fails (the H200, a
    bench's third engine built in one process; torch no longer collects before a capture itself).
    What it would have freed waits for the next collection, outside any capture."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
