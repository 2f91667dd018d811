"""CUDA graphs of a hidden-state head's drafting: the draft chain and the draft extend.

Eagerly, each head forward costs far more host time (operator dispatch, input building, a `.tolist()`
per step) than device time; with these graphs a greedy round's drafting is two replays and no host
sync of its own (its drafts are read with verify's results).

- **Chain** (`run_chain`), per (batch bucket, steps): steps 1 .. budget-1 of every request's chain
  after the extend's first draft, as `HeadDrafter._draft_step` runs them: step s runs module
  m = min(s, k-1), over the s positions since the extend while m is new to the chain (MTP's
  "fresh" steps: the drafts so far paired with module m-1's tail and outputs), else over the newest
  position, fed its own previous output (EAGLE / EAGLE-3: every step). The host fills the first
  draft (straight from the extend's device output when it left it there: `DeviceTokens`), the
  tails, the newest extended position, the steps and the page table into static buffers; each step
  computes its token ids, positions, KV slots, context lengths and hidden rows on the device in one
  launch (`chain_step_input`), runs the module and its logits, and takes the argmax (`row_argmax`,
  mapped to target ids and stored in the drafts buffer the next step reads), with no host sync.
  The drafts stay on the device (`launch_chain`): a request's draft holds placeholders -(1 + k)
  naming them, which the target's verify step resolves on the device (as overlap scheduling's
  future tokens), and the engine reads them back with verify's argmax, one host sync a
  speculative step (`run_chain` reads them at once). A request with fewer
  steps than the batch's most turns, for its extra steps, into a pad row (positions from 0, KV to
  the dummy slot: its reserved pages end with its own budget; outputs ignored). Pad rows have an
  all-zero page table, so they read and write the dummy page only. Argmax chains: a head drafts
  them for sampling requests too (verify takes its drafts as one-hot q).
- **Extend** (`run_extend`), per (batch bucket, query len): `HeadDrafter.after_target`'s forward
  over every module for feeds of at most that many tokens (a joined backlog or a prefill is
  longer: eager), padded as a target step is (`build_draft_input(pad=...)`: pad tokens at position
  0 writing the dummy slot, pad requests with no tokens). Module i > 0 pairs each token with module
  i-1's output one position back through a host-computed shift index into [previous tails;
  outputs]. Out come every module's tail and module 0's logits at each feed's last row; the seed is
  chosen from them (the argmax, on the device: `greedy_tokens`).

Graphs are captured largest first into one memory pool of their own (never the target's: its
outputs are still read after the extend). The attention's key-split count is fixed at capture for
the longest context. Outputs live in the pool: what outlives the next replay is copied out. Without
CUDA the same static buffers and padding run eagerly, so the CPU tests cover the logic (rows of a
padded bucket may round differently from an eager batch's in matmuls, never in tokens).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.attention.backend import AttentionBackend, AttentionBatch
from specserve.engine.host_copy import to_device
from specserve.engine.kv_cache import DUMMY_PAGE, KVCache
from specserve.engine.request import Request
from specserve.engine.step_input import build_draft_input, graph_head_size
from specserve.executor.cuda_graphs import capture
from specserve.model.draft_heads import DraftHead
from specserve.spec.drafter import resolve_drafts
from specserve_kernels import use_triton
from specserve_kernels.argmax import row_argmax, row_argmax_ref
from specserve_kernels.head_glue import chain_step_input, chain_step_input_ref

# SPECSERVE_DRAFT_GRAPHS=0 drafts eagerly even where the target's steps run in CUDA graphs (to time both).
DRAFT_GRAPHS_ENV = "SPECSERVE_DRAFT_GRAPHS"


def draft_graphs_enabled() -> bool:
    return os.environ.get(DRAFT_GRAPHS_ENV, "1") != "0"


@dataclass(frozen=True)
class DraftGraphShapes:
    """What a head drafter's graphs cover."""

    batch_sizes: tuple[int, ...]  # ascending, the target's graph batch buckets
    chain_steps: int  # most chain steps after the first draft one round runs (0: no chain graphs)
    extend_lens: tuple[int, ...]  # ascending query lens of extend buckets (() : none)
    # The target's prefill buckets (batch, query len): the extends over the prompts they ran.
    prefill: tuple[tuple[int, int], ...] = ()

    def batch(self, batch: int) -> int | None:
        return next((b for b in self.batch_sizes if b >= batch), None)

    def extend_shapes(self) -> list[tuple[int, int]]:
        every = [(b, q) for q in self.extend_lens for b in self.batch_sizes]
        return every + [(b, q) for b, q in self.prefill if q > max(self.extend_lens, default=0)]


class DeviceTokens:
    """Draft tokens left on the device (a graphed extend's greedy seeds), read to the host once, when
    first needed: a chain graph takes them as its first inputs and reads them back with its drafts."""

    __slots__ = ("ids", "_host")

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids
        self._host: list[int] | None = None

    def host(self) -> list[int]:
        if self._host is None:
            self._host = self.ids.tolist()
        return self._host


@dataclass(frozen=True)
class ExtendOutputs:
    """Per feed (the first B rows are real): each module's output at its last token [B, k, H], and
    module 0's draft logits there [B, V_draft]."""

    tails: torch.Tensor
    logits: torch.Tensor


class _ChainBucket:
    """The static inputs of chain graphs of one batch size: each row's first draft, its newest
    extended position, the steps it runs, and its modules' tails there."""

    def __init__(
        self, batch: int, modules: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.head = torch.zeros(3 * batch, dtype=torch.int64, device=device)
        self.ids, self.base, self.steps = self.head.split(batch)
        self.tails = torch.zeros(batch, modules, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}


class _ExtendBucket:
    """The static inputs and outputs of one extend bucket."""

    def __init__(
        self,
        batch: int,
        query_len: int,
        page_table: torch.Tensor,
        page_size: int,
        max_seq_len: int,
        features: torch.Tensor,
    ) -> None:
        device = page_table.device
        tokens = batch * query_len
        self.batch, self.query_len = batch, query_len
        self.head = torch.zeros(graph_head_size(tokens, batch), dtype=torch.int64, device=device)
        ids, positions, slots, query_start, seq_lens = self.head.split([tokens] * 3 + [batch + 1, batch])
        query_start.copy_(torch.arange(batch + 1) * query_len)  # until the first run: the dummy page
        seq_lens.fill_(query_len)
        self.ids, self.positions = ids, positions
        # Each feed's last row, and each row's source in [previous tails (batch rows); outputs].
        self.rows = torch.zeros(batch + tokens, dtype=torch.int64, device=device)
        self.last, self.shift = self.rows.split([batch, tokens])
        self.features = features[:tokens]  # the target features of its rows (shared by all buckets)
        self.attention = AttentionBatch(
            query_start, seq_lens, slots, page_table[:batch], page_size, query_len, max_seq_len
        )
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: ExtendOutputs | None = None


class DraftGraphs:
    """A `HeadDrafter`'s graphs (captured at construction on CUDA); `run_chain` and `run_extend`."""

    def __init__(
        self,
        head: DraftHead,
        backend: AttentionBackend,
        kv_cache: KVCache,
        shapes: DraftGraphShapes,
        max_seq_len: int,
        feature_size: int,
    ) -> None:
        self.head, self.backend, self.kv_cache, self.shapes = head, backend, kv_cache, shapes
        self.max_seq_len, self.page_size = max_seq_len, kv_cache.page_size
        self.num_modules = len(head.step_modules)
        weight = next(head.parameters())
        device, dtype = weight.device, weight.dtype
        hidden = head.spec.arch.hidden_size
        most = max(shapes.batch_sizes)
        self.page_table = torch.zeros(
            most, -(-max_seq_len // self.page_size), dtype=torch.int64, device=device
        )
        self.query_start = torch.arange(most + 1, dtype=torch.int64, device=device)  # one row a request
        # Each chain graph's drafts, after a first row holding its input tokens.
        self.tokens = torch.zeros(shapes.chain_steps + 1, most, dtype=torch.int64, device=device)
        self.chain = (
            {b: _ChainBucket(b, self.num_modules, hidden, dtype, device) for b in shapes.batch_sizes}
            if shapes.chain_steps > 0
            else {}
        )
        # Module outputs just before each feed (modules 0 .. k-2), for modules 1 .. k-1 of the extend.
        self.previous = torch.zeros(most, max(self.num_modules - 1, 1), hidden, dtype=dtype, device=device)
        extends = shapes.extend_shapes()
        rows = max((b * q for b, q in extends), default=0)
        features = torch.zeros(rows, feature_size, dtype=dtype, device=device)
        self.extend = {
            (b, q): _ExtendBucket(b, q, self.page_table, self.page_size, max_seq_len, features)
            for b, q in extends
        }
        self._extend_lens = sorted({q for _, q in extends})
        self.argmax = row_argmax if use_triton(device) else row_argmax_ref
        self._pending: torch.Tensor | None = None  # `launch_chain`'s drafts, not read yet
        self.captured = device.type == "cuda"
        if self.captured:
            self._capture_all()

    # ---- the chain ---------------------------------------------------------------------------

    def fits_chain(self, batch: int, steps: int) -> bool:
        return 0 < steps <= self.shapes.chain_steps and self.shapes.batch(batch) is not None

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy draft (target ids) of rows of draft logits, left on the device (no sync)."""
        return self.head.to_target_ids(self.argmax(logits))

    def run_chain(
        self,
        reqs: Sequence[Request],
        tokens: Sequence[int] | torch.Tensor,
        tails: Sequence[torch.Tensor],
        positions: Sequence[int],
        steps: Sequence[int],
    ) -> list[list[int]]:
        """Greedy chain steps 1 .. steps[i] of request i, from its extend's state: its first draft
        `tokens[i]` (host ints, or a device tensor), each module's tail `tails[i]` ([k, H]) at its
        newest extended position `positions[i]`. The KV slots of every position it drafts must be
        held. Returns each request's first draft followed by the new ones."""
        chains = self.launch_chain(reqs, tokens, tails, positions, steps)
        return resolve_drafts(chains, self.take_pending().tolist())

    def launch_chain(
        self,
        reqs: Sequence[Request],
        tokens: Sequence[int] | torch.Tensor,
        tails: Sequence[torch.Tensor],
        positions: Sequence[int],
        steps: Sequence[int],
    ) -> list[list[int]]:
        """`run_chain` without the host read: the drafts stay on the device (`take_pending`), and
        each request's chain comes back as placeholders, -(1 + k) for entry k of that tensor (what
        a step's input ids resolve on the device: `resolve_future_ids`)."""
        n, most = len(reqs), max(steps)
        batch = self.shapes.batch(n)
        bucket = self.chain[batch]
        ends = [p + s + 1 for p, s in zip(positions, steps, strict=True)]
        table = page_table_of(reqs, ends, self.page_size, batch)
        head = np.zeros((3, batch), dtype=np.int64)
        on_device = isinstance(tokens, torch.Tensor)
        head[1, :n], head[2, :n] = positions, steps
        if not on_device:
            head[0, :n] = tokens
        packed = to_device(
            torch.from_numpy(np.concatenate([head.ravel(), table.ravel()])), bucket.head.device
        )
        bucket.head.copy_(packed[: 3 * batch])
        if on_device:
            bucket.ids[:n].copy_(tokens)
        self.page_table[:batch, : table.shape[1]].copy_(packed[3 * batch :].view(table.shape))
        torch.stack(list(tails), out=bucket.tails[:n])
        if self.captured:
            bucket.graphs[most].replay()
        else:
            self.chain_forward(bucket, batch, most)
        # Row j of `tokens` holds every request's draft j: request i's draft j is entry j * W + i.
        width = self.tokens.shape[1]
        self._pending = self.tokens[: most + 1].view(-1)
        return [[-1 - (j * width + i) for j in range(s + 1)] for i, s in enumerate(steps)]

    @property
    def pending(self) -> torch.Tensor | None:
        """What `take_pending` would return, left in place."""
        return self._pending

    def take_pending(self) -> torch.Tensor | None:
        """The device drafts the last `launch_chain` left for its placeholders to name (valid until
        the next chain replay), once; None when none are pending."""
        pending, self._pending = self._pending, None
        return pending

    def greedy_into(self, logits: torch.Tensor, out: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """The greedy draft (target ids) of rows of draft logits into `out` (any stride), only where
        `keep` when given: one split argmax, the map to target ids and the store folded into it."""
        self.argmax(logits, out=out, table=self.head.draft_to_target, keep=keep)

    @torch.inference_mode()
    def chain_forward(
        self, bucket: _ChainBucket, batch: int, steps: int, drafts: torch.Tensor | None = None
    ) -> None:
        """Steps 1 .. `steps` as `HeadDrafter._draft_step` runs them, every row in each: step s runs
        module m = min(s, k-1), over the s positions since the extend while m is new to the chain
        (fresh), else over the newest one. A row past its own steps turns into a pad row (positions
        from 0, KV to the dummy slot) and its outputs are ignored. `drafts` [batch, steps + 1] (any
        strides) takes the seed and each step's draft (default: `tokens`' rows, what `launch_chain`
        leaves pending). A step is one glue launch (`chain_step_input`: ids, positions, slots,
        lengths and hidden rows), the module, its lm_head and the split argmax."""
        head, ps = self.head, self.page_size
        table = self.page_table[:batch]
        if drafts is None:
            drafts = self.tokens[: steps + 1, :batch].t()
        glue = chain_step_input if use_triton(table.device) else chain_step_input_ref
        out = bucket.tails[:, :1]  # module 0's output at the seed
        for step in range(1, steps + 1):
            module = head.module_for_step(step)
            fresh = module == step  # the drafts so far, with module m-1's tail, then its outputs
            rows = step if fresh else 1  # else the last module again: its own output, one row
            first = bucket.tails[:, step - 1] if fresh else None
            inp = glue(
                bucket.ids, bucket.steps, bucket.base, table, drafts, first, out,
                step=step, rows=rows, page_size=ps, dummy_slot=DUMMY_PAGE * ps,
            )  # fmt: skip
            attention = AttentionBatch(
                inp.query_start, inp.seq_lens, inp.slots, table, ps, rows, self.max_seq_len
            )
            ctx = self.backend.prepare(attention, self.kv_cache)
            flat, to_logits = head.run(module, inp.ids, inp.hidden, inp.positions, ctx, from_target=False)
            out = flat.view(batch, rows, -1)
            self.greedy_into(head.logits(module, to_logits.view(batch, rows, -1)[:, -1]), drafts[:, step])

    # ---- the extend --------------------------------------------------------------------------

    def extend_bucket(self, batch: int, max_len: int) -> tuple[int, int] | None:
        b = self.shapes.batch(batch)
        q = next((q for q in self._extend_lens if q >= max_len and (b, q) in self.extend), None)
        return None if b is None or q is None else (b, q)

    def run_extend(
        self,
        feeds: list[tuple[Request, int, list[int]]],
        features: torch.Tensor,
        rows: Sequence[int],
        previous: torch.Tensor | None,
    ) -> ExtendOutputs:
        """The extend's forward over (request, start, tokens) feeds that fit a bucket: the feeds'
        tokens pair with `features` rows `rows` (in order), module i > 0 with `previous[:, i-1]`
        ([B, k-1, H]: module i-1's output before each feed) at a feed's first token. The tails are
        a copy; the logits a view of the graph's output (select the rows wanted before the next
        replay)."""
        n, lens = len(feeds), [len(t) for _, _, t in feeds]
        batch, query_len = self.extend_bucket(n, max(lens))
        graph = self.extend[(batch, query_len)]
        tokens = batch * query_len
        first = np.cumsum([0, *lens[:-1]])
        last = np.zeros(batch, dtype=np.int64)
        last[:n] = first + np.asarray(lens) - 1
        shift = np.arange(tokens, dtype=np.int64) - 1 + batch
        shift[first] = np.arange(n)
        inp = build_draft_input(
            feeds, self.page_size, graph.head.device, (batch, query_len), [last, shift, np.asarray(rows)]
        )
        # The packed buffer: the graph's head, the page table, the n last rows, then `last`, `shift`.
        head_size = graph.head.shape[0]
        graph.head.copy_(inp.packed[:head_size])
        table = inp.attention.page_table
        self.page_table[:batch, : table.shape[1]].copy_(table)
        start = head_size + table.numel() + n
        graph.rows.copy_(inp.packed[start : start + graph.rows.shape[0]])
        index = inp.extra[2]
        if features.dtype == graph.features.dtype:  # gathered straight into the static rows
            torch.index_select(features, 0, index, out=graph.features[: index.shape[0]])
        else:
            graph.features[: index.shape[0]].copy_(features.index_select(0, index))
        if previous is not None:
            self.previous[:n].copy_(previous)
        if self.captured:
            graph.graph.replay()
            out = graph.outputs
            return ExtendOutputs(out.tails[:n].clone(), out.logits[:n])
        out = self._extend_forward(graph)
        return ExtendOutputs(out.tails[:n], out.logits[:n])

    @torch.inference_mode()
    def _extend_forward(self, graph: _ExtendBucket) -> ExtendOutputs:
        head = self.head
        ctx = self.backend.prepare(graph.attention, self.kv_cache)
        hidden, out, tails, seed = graph.features, None, [], None
        previous = self.previous[: graph.batch]
        for i in range(self.num_modules):
            if out is not None:  # module i pairs each token with module i-1's output one position back
                hidden = torch.cat([previous[:, i - 1], out]).index_select(0, graph.shift)
            out, to_logits = head.run(i, graph.ids, hidden, graph.positions, ctx, from_target=i == 0)
            tails.append(out.index_select(0, graph.last))
            if i == 0:
                seed = to_logits.index_select(0, graph.last)
        return ExtendOutputs(torch.stack(tails, dim=1), head.logits(0, seed))

    # ---- capture -----------------------------------------------------------------------------

    def _capture_all(self) -> None:
        jobs = [
            (b * q, (lambda g=g: self._extend_forward(g)), g, None) for (b, q), g in self.extend.items()
        ] + [
            (b * n, (lambda c=c, b=b, n=n: self.chain_forward(c, b, n)), c, n)
            for b, c in self.chain.items()
            for n in range(1, self.shapes.chain_steps + 1)
        ]
        pool = None
        for _, forward, owner, steps in sorted(jobs, key=lambda job: -job[0]):  # largest first
            graph, outputs = capture(forward, pool)
            pool = graph.pool()
            if steps is None:
                owner.graph, owner.outputs = graph, outputs
            else:
                owner.graphs[steps] = graph
        torch.cuda.synchronize()


def page_table_of(reqs: Sequence[Request], ends: Sequence[int], page_size: int, batch: int) -> np.ndarray:
    """[batch, pages] pages of each request up to position `ends[i]` (exclusive); pad rows all zero
    (the dummy page)."""
    widths = [-(-e // page_size) for e in ends]
    table = np.zeros((batch, max(widths)), dtype=np.int64)
    for row, (req, width) in enumerate(zip(reqs, widths, strict=True)):
        pages = req.page_mirror.first(req.pages, width)
        table[row, : len(pages)] = pages
    return table
