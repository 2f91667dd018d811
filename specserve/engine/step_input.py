"""Turn a scheduled batch into the model's input tensors, built on the host and copied once.

Besides ids, positions and the attention layout, it decides which token rows need logits: the last
row of each request that completes its known tokens (to sample), and prompt rows whose next token's
input logprob was asked for. Everything else skips the lm_head.

Every int tensor of a step is a view of one flat int64 buffer (`StepInput.packed`): one host-to-device
copy, and under tensor parallelism the one tensor rank 0 broadcasts; `StepInput.layout()` holds the
sizes that cut it up again (`unpack_step_input`). The buffer starts with what a CUDA graph's static
inputs hold (ids, positions, slots, query starts, seq lens: `graph_head_size`), so a graphed step
copies them in one piece.

A decode or verify step (every logit row is a token row, in order) that fits a CUDA-graph bucket is
padded to it here: pad requests have no tokens (their query start repeats, their seq len is 0), and
pad tokens past the real ones belong to no request, sit at position 0 and write their K/V to the
dummy slot 0, so no real slot or row is touched.

A draft tree (`Request.draft_tree`, topk > 1) is a request's tokens given as a forest: token j's
parent among the step's tokens (-1: the context before them). It sits at position start + depth but
at context slot start + j, and sees its ancestors only: the step gets a custom mask, built on the
device from the flat indices of its ancestor entries (a few hundred ints a tree), causal for every
other request. A step with trees is padded only to a graph bucket that has a tree mask. The forests
of a step are laid out together (`Forest`: flat parents), one array pass per tree depth; a drafter's
forward over draft-tree nodes comes in flat too (`build_forest_input`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from specserve.attention.backend import AttentionBatch
from specserve.engine.host_copy import to_device
from specserve.engine.request import FUTURE_TOKEN, Request
from specserve.engine.scheduler import ScheduledItem

if TYPE_CHECKING:  # it builds on `item_forest` below
    from specserve.engine.recurrent_batch import RecurrentBatch


@dataclass(frozen=True)
class InputLogprobRows:
    """Rows of the logits tensor that score prompt tokens `first_token ...` of one request."""

    item: int
    first_token: int
    logit_rows: range


@dataclass(frozen=True)
class StepInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attention: AttentionBatch
    logit_rows: torch.Tensor  # [R] token rows whose logits are computed
    sample_items: tuple[int, ...]  # items that sample (verify) tokens, in logits-row order
    # Per sample item, its rows of the logits tensor: the last known token, then each draft token.
    sample_rows: tuple[range, ...]
    sample_logit_rows: torch.Tensor  # [S] every sample row, concatenated, on the device
    input_logprobs: tuple[InputLogprobRows, ...]
    packed: torch.Tensor  # the flat int64 device buffer every tensor above is a view of
    # Padded to a CUDA-graph bucket (batch_size, max_query_len): the runner replays that graph
    # (STEP_GRAPH: decode/verify, whose first `logit_rows.shape[0]` rows are this step's;
    # PREFILL_GRAPH: a prefill bucket, which computes the logits of `logit_rows`); 0: eager.
    graphed: int = 0
    # Ancestor entries of the tree mask packed after the sample rows; -1: no custom mask.
    mask_entries: int = -1
    # A hybrid model's Mamba-2 layout (`specserve.engine.recurrent_batch`), set by the engine; rank 0 only.
    recurrent: RecurrentBatch | None = None
    # The real token rows of a padded step (its first rows); None: a follower's, which reads no outputs.
    num_tokens: int | None = None

    def layout(self) -> list[int]:
        """The sizes (STEP_LAYOUT_LEN ints) that rebuild this step's device tensors from `packed`."""
        a = self.attention
        return [
            self.input_ids.shape[0],
            self.logit_rows.shape[0],
            self.sample_logit_rows.shape[0],
            a.batch_size,
            a.page_table.shape[1],
            a.page_size,
            a.max_query_len,
            a.max_seq_len,
            int(self.graphed),
            self.mask_entries,
        ]


STEP_LAYOUT_LEN = 10
STEP_GRAPH, PREFILL_GRAPH = 1, 2  # `StepInput.graphed`


def graph_head_size(tokens: int, batch: int) -> int:
    """Leading elements of a packed step a CUDA graph copies: ids, positions, slots, query starts, seq lens."""
    return 3 * tokens + 2 * batch + 1


def _packed_shapes(layout: Sequence[int]) -> list[tuple[int, ...]]:
    """Shapes of the step's arrays in packing order: ids, positions, slots, query starts, seq lens,
    page table (`_batch_tensors`), then logit rows and sample rows (the `extra` of `build_step_input`),
    then, with a tree mask, its per-request tree flags and ancestor entries."""
    tokens, logit_rows, sample_rows, batch, max_pages = layout[:5]
    mask = [(batch,), (layout[9],)] if layout[9] >= 0 else []
    return [*_batch_shapes(tokens, batch, max_pages), (logit_rows,), (sample_rows,), *mask]


def _batch_shapes(tokens: int, batch: int, max_pages: int) -> list[tuple[int, ...]]:
    return [(tokens,), (tokens,), (tokens,), (batch + 1,), (batch,), (batch, max_pages)]


def packed_size(layout: Sequence[int]) -> int:
    return sum(math.prod(shape) for shape in _packed_shapes(layout))


def unpack_step_input(layout: Sequence[int], packed: torch.Tensor) -> StepInput:
    """The device tensors of a step from its packed buffer (a TP follower's copy of rank 0's step).
    The host-side bookkeeping (sample items, logprob rows) stays empty: only rank 0 reads it."""
    views = _split(packed, _packed_shapes(layout))
    ids, pos, *layout_tensors, rows, sample_rows = views[:8]
    mask = tree_mask(*views[8:], layout[6]) if layout[9] >= 0 else None
    attention = _attention_batch(layout_tensors, *layout[5:8], mask)
    return StepInput(ids, pos, attention, rows, (), (), sample_rows, (), packed, layout[8], layout[9])


def build_step_input(
    items: list[ScheduledItem],
    page_size: int,
    device: torch.device,
    graph_bucket: Callable[[int, int], tuple[int, int] | None] | None = None,
    future: Mapping[str, int] | None = None,
    prefill_bucket: Callable[[int, int, int], tuple[int, int] | None] | None = None,
) -> StepInput:
    """`graph_bucket(batch, max_query_len[, tree=True])`: the CUDA-graph bucket (batch, query len) a
    decode or verify step of that shape (with a draft tree: a bucket with a tree mask) is padded to,
    or None (eager); `prefill_bucket(batch, max_query_len, logit_rows)`: the prefill bucket of any
    other step without trees, or None. `future`: for requests whose last
    token an in-flight step is still sampling (FUTURE_TOKEN), that token's row among the in-flight
    step's samples; its id goes in as -(row + 1), for the runner to resolve on the device."""
    ids: list[int] = []
    logit_rows: list[int] = []
    sample_items: list[int] = []
    sample_rows: list[range] = []
    input_lp: list[InputLogprobRows] = []
    forest: list[np.ndarray | None] = []
    for index, item in enumerate(items):
        req, offset = item.request, len(ids)
        forest.append(item_forest(item))
        ids.extend(req.token_ids[item.start : item.start + item.num_known])
        if ids[-1] == FUTURE_TOKEN:
            ids[-1] = -1 - future[req.request_id]
        ids.extend(item.draft)
        rows = _input_logprob_rows(item) if req.params.wants_input_logprobs else None
        if rows is not None:
            first_token, ctx_rows = rows
            input_lp.append(
                InputLogprobRows(index, first_token, range(len(logit_rows), len(logit_rows) + len(ctx_rows)))
            )
            logit_rows.extend(offset + r - item.start for r in ctx_rows)
        if item.completes and not req.prefill_only:
            sample_items.append(index)
            sample_rows.append(range(len(logit_rows), len(logit_rows) + 1 + len(item.draft)))
            logit_rows.extend(range(offset + item.num_known - 1, offset + item.num_tokens))
    flat_sample_rows = [r for rows in sample_rows for r in rows]
    query_lens = [item.num_tokens for item in items]
    pad, graphed = None, 0
    has_tree = any(f is not None for f in forest)
    if graph_bucket is not None and logit_rows == list(range(len(ids))):
        # A tree needs a bucket with a mask; other steps take any (a masked one fills in causal).
        pad = (
            graph_bucket(len(items), max(query_lens), tree=True)
            if has_tree
            else graph_bucket(len(items), max(query_lens))
        )
        graphed = STEP_GRAPH
    if pad is None and prefill_bucket is not None and not has_tree:
        pad, graphed = prefill_bucket(len(items), max(query_lens), len(logit_rows)), PREFILL_GRAPH
    input_ids, pos, attention, (rows, sample_rows_t), packed, mask_entries = _batch_tensors(
        [item.request for item in items],
        [item.start for item in items],
        query_lens,
        ids,
        [logit_rows, flat_sample_rows],
        page_size,
        device,
        pad,
        Forest.of(forest) if has_tree else None,
    )
    return StepInput(
        input_ids=input_ids,
        positions=pos,
        attention=attention,
        logit_rows=rows,
        sample_items=tuple(sample_items),
        sample_rows=tuple(sample_rows),
        sample_logit_rows=sample_rows_t,
        input_logprobs=tuple(input_lp),
        packed=packed,
        graphed=graphed if pad is not None else 0,
        mask_entries=mask_entries,
        num_tokens=len(ids),
    )


@dataclass(frozen=True)
class Forest:
    """Some requests' tokens given as forests, flat: each token's parent among its request's tokens
    (-1: the context before them)."""

    members: np.ndarray  # [M] the requests (batch indices, ascending) whose tokens form forests
    parents: np.ndarray  # [T_M] their tokens' parents, request after request

    @staticmethod
    def of(forests: Sequence[np.ndarray | None]) -> Forest:
        """From one array per request (None: a causal chain)."""
        members = [b for b, parents in enumerate(forests) if parents is not None]
        parents = [np.asarray(forests[b], dtype=np.int64) for b in members]
        return Forest(np.asarray(members, dtype=np.int64), np.concatenate(parents))


def item_forest(item: ScheduledItem) -> np.ndarray | None:
    """An item verifying a draft tree as a forest over its tokens (None: a causal chain): the known
    tokens in a chain, then the first len(item.draft) tree nodes under the last of them."""
    tree = item.request.draft_tree
    if not item.draft or tree is None:
        return None
    known = item.num_known
    return np.concatenate([np.arange(-1, known - 1), known - 1 + tree.parents[: len(item.draft)]])


def resolve_future_ids(ids: torch.Tensor, future: torch.Tensor) -> None:
    """In place and on the device (no host sync): each id -(k + 1) of a step built with `future`
    becomes future[k], the token the earlier step sampled at its sample row k."""
    index = (-1 - ids).clamp_(0, future.shape[0] - 1)
    torch.where(ids < 0, future.index_select(0, index), ids, out=ids)


def _input_logprob_rows(item: ScheduledItem) -> tuple[int, range] | None:
    """Context rows p in this chunk whose logits score prompt token p + 1 (still unrecorded)."""
    next_token = item.request.next_input_logprob_index
    if next_token is None:
        return None
    first_row = max(item.start, next_token - 1)
    last_row = min(item.end, item.request.prompt_len - 1)
    if first_row >= last_row:
        return None
    return first_row + 1, range(first_row, last_row)


def _batch_tensors(
    requests: list[Request],
    starts: Sequence[int],
    query_lens: Sequence[int],
    ids: Sequence[int] | np.ndarray,
    extra: list,
    page_size: int,
    device: torch.device,
    pad: tuple[int, int] | None = None,
    forest: Forest | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch, list[torch.Tensor], torch.Tensor, int]:
    """Ids, positions and the attention layout of requests computing `query_lens` tokens from
    `starts` on, copied to the device in one transfer together with the caller's `extra` int arrays;
    then the flat buffer they all view, and the tree mask's entry count (-1: none). `pad` (batch,
    query len): pad to that CUDA-graph bucket. `forest`: requests whose tokens form forests
    (positions by depth, and a tree mask).

    Every array is written straight into its place in one flat host buffer (pads are its zeros):
    no per-array padding, conversion and concatenation, which cost more than the copy at batch 1."""
    n, tokens = len(requests), len(ids)
    seq_lens = [s + q for s, q in zip(starts, query_lens, strict=True)]
    max_query_len = max(query_lens)
    batch, padded = n, tokens
    if pad is not None:
        batch, max_query_len = pad
        padded = batch * max_query_len
    max_pages = max(-(-s // page_size) for s in seq_lens)
    extra = [np.asarray(a, dtype=np.int64) for a in extra]
    shapes = [*_batch_shapes(padded, batch, max_pages), *(a.shape for a in extra)]
    sizes = [math.prod(shape) for shape in shapes]
    flat = np.zeros(sum(sizes), dtype=np.int64)
    bounds = list(itertools.accumulate(sizes, initial=0))
    ids_v, pos_v, slots_v, qs_v, lens_v, table_v = (
        flat[a:b] for a, b in zip(bounds[:6], bounds[1:7], strict=True)
    )
    table = table_v.reshape(batch, max_pages)
    _fill_page_table(table, requests, seq_lens, page_size)
    ids_v[:tokens] = ids
    qs_v[1 : n + 1] = list(itertools.accumulate(query_lens))
    qs_v[n + 1 :] = tokens
    lens_v[:n] = seq_lens
    if tokens == n or tokens <= PYTHON_TOKENS:  # a decode, or a few tokens: lists beat numpy calls
        positions, slots = _python_slots(requests, starts, query_lens, page_size)
        pos_v[:tokens] = positions
        slots_v[:tokens] = slots
    else:
        positions, slots = _token_slots(table[:n], starts, query_lens, qs_v[: n + 1], page_size)
        pos_v[:tokens] = positions
        slots_v[:tokens] = slots
    for a, lo, hi in zip(extra, bounds[6:-1], bounds[7:], strict=True):
        flat[lo:hi] = a.ravel()
    mask_arrays: list[np.ndarray] = []
    if forest is not None and len(forest.members):
        mask_arrays = _forest_layout(forest, starts, qs_v, max_query_len, pos_v)
        shapes += [a.shape for a in mask_arrays]
        flat = np.concatenate([flat, *mask_arrays])
    packed = to_device(torch.from_numpy(flat), device)
    views = _split(packed, shapes)
    input_ids, pos, slots_t, *layout_tensors = views[:6]
    mask, mask_entries = None, -1
    if mask_arrays:
        all_forests = bool(mask_arrays[0].all())
        mask, mask_entries = tree_mask(*views[-2:], max_query_len, all_forests), mask_arrays[1].shape[0]
    attention = _attention_batch([slots_t, *layout_tensors], page_size, max_query_len, max(seq_lens), mask)
    return input_ids, pos, attention, views[6 : 6 + len(extra)], packed, mask_entries


# Steps of at most this many tokens get positions and slots from Python lists (numpy's calls cost more).
PYTHON_TOKENS = 32


def _python_slots(
    requests: list[Request], starts: Sequence[int], query_lens: Sequence[int], page_size: int
) -> tuple[list[int], list[int]]:
    """Positions and KV slots of every token, request after request, in Python."""
    positions: list[int] = []
    slots: list[int] = []
    for req, start, length in zip(requests, starts, query_lens, strict=True):
        pages = req.pages
        span = range(start, start + length)
        positions.extend(span)
        if page_size == 1:
            slots.extend(pages[p] for p in span)
        else:
            slots.extend(pages[p // page_size] * page_size + p % page_size for p in span)
    return positions, slots


def _token_slots(
    table: np.ndarray,
    starts: Sequence[int],
    query_lens: Sequence[int],
    query_start: np.ndarray,
    page_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Positions (start, start + 1, ...) and KV slots of every token, from the page table."""
    lens = np.asarray(query_lens, dtype=np.int64)
    owner = np.repeat(np.arange(len(lens)), lens)
    positions = np.asarray(starts, dtype=np.int64)[owner] + np.arange(query_start[-1]) - query_start[owner]
    return positions, table[owner, positions // page_size] * page_size + positions % page_size


def _forest_layout(
    forest: Forest,
    starts: Sequence[int],
    query_start: np.ndarray,
    max_query_len: int,
    positions: np.ndarray,
) -> list[np.ndarray]:
    """Set the positions of forest requests' tokens (in place: start + depth); return the tree mask's
    packed arrays: per request (padding included) whether it is a forest, and the flat [B, Q, Q]
    index of every (token, ancestor-or-self) pair of one, ascending. Every forest at once: one
    round per depth, each a few array operations over all their tokens."""
    members, parents = forest.members, forest.parents
    lens = query_start[members + 1] - query_start[members]
    assert len(parents) == lens.sum(), "a forest's size is not its request's query length"
    owner = np.repeat(members, lens)  # each token's request
    first = np.repeat(np.cumsum(lens) - lens, lens)  # its request's first token in `parents`
    local = np.arange(len(parents)) - first  # its index among its request's tokens
    assert (parents < local).all(), "a parent after its child"
    row = (owner * max_query_len + local) * max_query_len  # each token's row of the flat mask
    entries = [row + local]  # (token, self), then (token, ancestor) per round
    depth = np.zeros(len(parents), dtype=np.int64)
    up = parents
    while (live := up >= 0).any():  # every token one ancestor further up per round
        entries.append(row[live] + up[live])
        depth += live
        up = np.where(live, parents[first + np.maximum(up, 0)], -1)
    positions[query_start[owner] + local] = np.asarray(starts, dtype=np.int64)[owner] + depth
    flags = np.zeros(len(query_start) - 1, dtype=np.int64)
    flags[members] = 1
    return [flags, np.sort(np.concatenate(entries))]


def tree_mask(
    flags: torch.Tensor, entries: torch.Tensor, max_query_len: int, all_forests: bool = False
) -> torch.Tensor:
    """The [B, Q, Q] custom mask on the device: causal for requests with flag 0, and for a forest
    request exactly its (token, ancestor-or-self) `entries` (flat indices). `all_forests`: every
    flag is 1 (a drafter's forest feed), known on the host: no causal part to build (3 operators)."""
    shape = (flags.shape[0], max_query_len, max_query_len)
    if all_forests:
        mask = torch.zeros(math.prod(shape), dtype=torch.bool, device=flags.device)
        return mask.index_fill_(0, entries, True).view(shape)
    rows = torch.arange(max_query_len, device=flags.device)
    causal = rows[:, None] >= rows[None, :]
    mask = (causal[None] & (flags == 0)[:, None, None]).contiguous()
    return mask.view(-1).index_fill_(0, entries, True).view(shape)


def _attention_batch(
    tensors: list[torch.Tensor],
    page_size: int,
    max_query_len: int,
    max_seq_len: int,
    custom_mask: torch.Tensor | None = None,
) -> AttentionBatch:
    """From the device views (slots, query starts, seq lens, page table) in packing order."""
    slot_mapping, query_start, seq_lens, page_table = tensors
    return AttentionBatch(
        query_start=query_start,
        seq_lens=seq_lens,
        slot_mapping=slot_mapping,
        page_table=page_table,
        page_size=page_size,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        custom_mask=custom_mask,
    )


def _fill_page_table(table: np.ndarray, requests: list[Request], seq_lens: list[int], page_size: int) -> None:
    """Each request's pages up to its seq len into its row of `table` (zeros past them)."""
    for row, (req, seq_len) in enumerate(zip(requests, seq_lens, strict=True)):
        pages = req.page_mirror.first(req.pages, -(-seq_len // page_size))
        table[row, : len(pages)] = pages


def _split(buffer: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Views of `buffer` in `shapes`, in order: one split, then a view only for the 2-d ones."""
    sizes = [math.prod(shape) for shape in shapes]  # np.prod costs microseconds per call
    parts = buffer[: sum(sizes)].split_with_sizes(sizes)  # the method: no Python wrapper
    return [part if len(shape) == 1 else part.view(shape) for part, shape in zip(parts, shapes, strict=True)]


@dataclass(frozen=True)
class DraftInput:
    """One drafter forward: each request feeds `tokens` at positions from `start` on."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionBatch
    last_rows: torch.Tensor  # [B] the row of each request's last fed token
    packed: torch.Tensor | None = None  # the flat buffer the tensors above view (graph_head_size first)
    extra: tuple[torch.Tensor, ...] = ()  # the caller's `extra` arrays, on the device


def build_draft_input(
    feeds: list[tuple[Request, int, list[int]]],
    page_size: int,
    device: torch.device,
    pad: tuple[int, int] | None = None,
    extra: Sequence[np.ndarray] = (),
) -> DraftInput:
    """Inputs for a drafter's own forward over (request, start position, tokens) — catch-up or one
    draft step. The drafter's KV cache shares the target's page layout, so slots come from the same pages.
    `pad` (batch, query len): padded as a target step to a CUDA-graph bucket (a drafter's graphs,
    specserve/spec/draft_graphs.py); `extra`: more int arrays to copy in the same transfer."""
    ids = [t for _, _, tokens in feeds for t in tokens]
    query_lens = [len(tokens) for _, _, tokens in feeds]
    input_ids, pos, attention, (last, *more), packed, _ = _batch_tensors(
        [req for req, _, _ in feeds],
        [start for _, start, _ in feeds],
        query_lens,
        ids,
        [np.cumsum(query_lens) - 1, *extra],
        page_size,
        device,
        pad,
    )
    return DraftInput(input_ids, pos, attention, last, packed, tuple(more))


def build_forest_input(
    requests: list[Request],
    starts: Sequence[int],
    tokens: np.ndarray,
    lens: np.ndarray,
    parents: np.ndarray,
    rows: np.ndarray,
    page_size: int,
    device: torch.device,
) -> DraftInput:
    """A drafter's forward over draft-tree nodes: request b feeds the next `lens[b]` of the flat
    `tokens` from context slot `starts[b]` on, as a forest (`parents`: each token's parent among its
    request's, -1: the context); `rows` are the token rows whose outputs the caller reads."""
    input_ids, pos, attention, (picked,), _, _ = _batch_tensors(
        requests,
        starts,
        lens.tolist(),
        tokens,
        [rows],
        page_size,
        device,
        forest=Forest(np.arange(len(requests), dtype=np.int64), parents),
    )
    return DraftInput(input_ids, pos, attention, picked)
