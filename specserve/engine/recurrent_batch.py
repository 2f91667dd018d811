"""One step's layout for the Mamba-2 layers of a hybrid model, built on the host from the scheduled
items (the attention layers read `AttentionBatch` as always).

The layers work on padded [B, Q] grids (`RecurrentGroup`): request b's tokens are rows 0..n_b - 1;
decodes and verifies share a grid, each prefill chunk has its own (no decode is padded to a prompt). Every row has a
parent: the row before it, or for a draft tree (`step_input.item_forest`) its parent node; the
first row's parent is the request's live state. So a row's state is the recurrence applied along
its path, and its convolution reads the inputs of its last `conv_kernel - 1` ancestors (`window`:
indices into [the live window's entries; the step's rows]). Chains and trees are the same
computation with a different ancestor relation.

Items that verify drafts are *tracked*: the state after each of their rows from the root (the last
verified token) on is written to a snapshot, and their live slot is left alone until verify says
which row was the last accepted (`accepted_snapshots`); every other item's end state goes straight
to its slot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from specserve.engine.scheduler import ScheduledItem
from specserve.engine.step_input import item_forest


@dataclass(frozen=True)
class RecurrentGroup:
    """Requests scanned together on one padded [B, Q] grid (device tensors)."""

    slots: torch.Tensor  # [B] int64: each request's live state slot
    fresh: torch.Tensor  # [B] bool: starts at position 0 (zero state and window, whatever the slot holds)
    token_rows: torch.Tensor  # [B, Q] int64: the step's flat token index of request b's row t (padding: 0)
    valid: torch.Tensor  # [B, Q] bool
    grid_rows: torch.Tensor  # [Tg] int64: b * Q + t of every real row ...
    tokens: torch.Tensor  # [Tg] int64: ... and its flat token index
    window: torch.Tensor  # [B, Q, K] int64: a row's convolution inputs, oldest first (see above)
    last_rows: torch.Tensor  # [B] int64: each request's last row
    live: torch.Tensor  # [U] int64: requests whose end state goes to their slot (untracked)
    snap_rows: torch.Tensor  # [S] int64: b * Q + t of every tracked row, in snapshot order
    tree_flags: torch.Tensor | None  # [B] bool: the request's rows form a tree (None: no tree)
    tree_ancestors: torch.Tensor | None  # [B, Qt, Qt] bool: ancestor-or-self among a tree's rows
    block: int  # rows scanned at once; tracked and tree items fit in the first block


@dataclass(frozen=True)
class RecurrentBatch:
    """A step's groups: decodes and verifies together (every item no longer than the longest
    verified draft + 1), each other item (a prefill chunk) alone."""

    groups: tuple[RecurrentGroup, ...]
    num_snapshots: int
    # Host side: (item index, its first snapshot, its slot) per tracked item.
    tracked: tuple[tuple[int, int, int], ...] = ()


def build_recurrent_batch(
    items: list[ScheduledItem], conv_kernel: int, chunk_size: int, device: torch.device
) -> RecurrentBatch:
    forests = [item_forest(item) for item in items]
    verified = max(
        (it.num_tokens for it, f in zip(items, forests, strict=True) if it.draft or f is not None), default=1
    )
    block = max(chunk_size, verified)  # a verified item lies in one block
    starts = np.cumsum([0, *(item.num_tokens for item in items)])
    short = [i for i, item in enumerate(items) if item.num_tokens <= verified]
    alone = [[i] for i, item in enumerate(items) if item.num_tokens > verified]
    groups, tracked = [], []
    for members in ([short] if short else []) + alone:
        group, group_tracked = _group(items, forests, members, starts, conv_kernel, block, device)
        groups.append(group)
        tracked += group_tracked
    # Tracked items are short: all in the first group, whose snapshot order is the step's.
    snapshots = sum(items[i].num_tokens - items[i].num_known + 1 for i, _, _ in tracked)
    return RecurrentBatch(tuple(groups), snapshots, tuple(tracked))


def _group(
    items: list[ScheduledItem],
    forests: list[np.ndarray | None],
    members: list[int],
    starts: np.ndarray,
    k: int,
    block: int,
    device: torch.device,
) -> tuple[RecurrentGroup, list[tuple[int, int, int]]]:
    lens = [items[i].num_tokens for i in members]
    batch, width = len(members), max(lens)
    token_rows = np.zeros((batch, width), dtype=np.int64)
    valid = np.zeros((batch, width), dtype=bool)
    window = np.zeros((batch, width, k), dtype=np.int64)
    grid_rows, snap_rows, live, tracked = [], [], [], []
    trees: dict[int, np.ndarray] = {}
    for b, index in enumerate(members):
        item, parents = items[index], forests[index]
        n, rows = item.num_tokens, np.arange(item.num_tokens)
        token_rows[b, :n] = starts[index] + rows
        valid[b, :n] = True
        grid_rows.append(b * width + rows)
        if parents is None:  # a chain: row t reads rows t - K + 1 .. t, shifted by the K - 1 window entries
            window[b, :n] = rows[:, None] + np.arange(k)[None, :]
        else:
            window[b, :n] = _tree_window(parents, k)
            trees[b] = _ancestors(parents)
        if item.draft:  # snapshots from the root (the last verified token) on
            tracked.append((index, len(snap_rows), item.request.state_slot))
            snap_rows.extend(b * width + r for r in range(item.num_known - 1, n))
        else:
            live.append(b)
    tree_flags = tree_ancestors = None
    if trees:
        side = max(len(a) for a in trees.values())
        ancestors = np.zeros((batch, side, side), dtype=bool)
        for b, a in trees.items():
            ancestors[b, : len(a), : len(a)] = a
        tree_flags = torch.as_tensor(np.isin(np.arange(batch), list(trees)), device=device)
        tree_ancestors = torch.as_tensor(ancestors, device=device)

    def ints(values) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values, dtype=np.int64), device=device)

    group = RecurrentGroup(
        slots=ints([items[i].request.state_slot for i in members]),
        fresh=torch.as_tensor([items[i].start == 0 for i in members], device=device),
        token_rows=ints(token_rows),
        valid=torch.as_tensor(valid, device=device),
        grid_rows=ints(np.concatenate(grid_rows)),
        tokens=ints(np.concatenate([starts[i] + np.arange(items[i].num_tokens) for i in members])),
        window=ints(window),
        last_rows=ints([n - 1 for n in lens]),
        live=ints(live),
        snap_rows=ints(snap_rows),
        tree_flags=tree_flags,
        tree_ancestors=tree_ancestors,
        block=block,
    )
    return group, tracked


def accepted_snapshots(
    batch: RecurrentBatch, emitted: Mapping[int, list[int]], drawn_at: Mapping[int, list[int]]
) -> tuple[list[int], list[int]]:
    """(snapshot, slot) pairs that commit each tracked item's last accepted token: the node its last
    emitted token was drawn at (a tree's accepted path, `drawn_at`), or the chain's root + accepted."""
    sources, slots = [], []
    for index, first, slot in batch.tracked:
        path = drawn_at.get(index)
        sources.append(first + (path[-1] if path else len(emitted[index]) - 1))
        slots.append(slot)
    return sources, slots


def _tree_window(parents: np.ndarray, k: int) -> np.ndarray:
    """Each row's K convolution inputs, oldest first: its ancestors at distance K-1 .. 0 along the
    parent path (row r is entry K - 1 + r), then past the first row the live window's entries."""
    out = np.zeros((len(parents), k), dtype=np.int64)
    for r in range(len(parents)):
        path = [r]
        while len(path) < k and parents[path[-1]] >= 0:
            path.append(int(parents[path[-1]]))
        depth = len(path) - 1  # of the furthest row reached: past it, the window (newest last)
        for d in range(k):
            out[r, k - 1 - d] = k - 1 + path[d] if d <= depth else k - 1 - (d - depth)
    return out


def _ancestors(parents: np.ndarray) -> np.ndarray:
    """[n, n] bool: row j is row i or one of its ancestors (parents precede children)."""
    n = len(parents)
    seen = np.eye(n, dtype=bool)
    for r in range(n):
        if parents[r] >= 0:
            seen[r] |= seen[parents[r]]
    return seen
