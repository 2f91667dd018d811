"""A one-module head's draft trees searched on the device, in CUDA graphs.

`TreeSearch` (specserve/spec/tree.py) grows EAGLE-2's tree on the host: each step a numpy pass over
the nodes, the head's forward over the paths it expands, and a host read of the logits' top k, so a
round of depth 5 cost 12-16 ms at batch 1 on the H100 and H200 (docs/benchmarks.md, sixth and
nineteenth sessions) where a graphed chain took ~1.5. With every request's tree of one shape (topk
k, depth D, the best N nodes kept) the search has fixed shapes and runs in one graph replay, and
the host reads the trees once:

- **Node ids by depth.** Depth 1 holds ids [0, k), the root's top k in order; depth d > 1 holds
  k + (d-2)k² + i·k + c, child c (its top-k order) of the i-th node of depth d-1's frontier.
- **Step s** (1 .. D-1) takes the frontier, the k best nodes of depth s (ties to the lower id, as
  `TreeSearch.frontier`), feeds the head every node a frontier named so far (step s's at rows
  (s-1)k .. sk-1, written at context slots root + row, under the mask of each fed node's ancestors;
  nodes fed before are fed again, the same inputs giving the same outputs, so each step's mask
  covers its own rows only), and expands the frontier from its rows' logits: scores summed in
  float64 as `TreeSearch.expand` sums them.
- **The tree** is the best N nodes (score descending, then depth, then id: `TreeSearch._kept`), rows
  parents-first, each row's candidates its children in id order, as `TreeSearch.trees` lays it out.

Requests draft to their own depth: a shallower request's deeper nodes are left out and its KV
writes at steps past its depth go to the dummy slot. Pad rows have an all-zero page table. The
head's drafts are its top k for sampling requests too (verify takes them as deterministic, one-hot
q), so one graph serves every request. Without CUDA the same static buffers run eagerly, which is
what the CPU tests compare with the host search (`tests/test_tree_graphs.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.attention.backend import AttentionBackend, AttentionBatch
from specserve.engine.host_copy import to_device
from specserve.engine.kv_cache import DUMMY_PAGE, KVCache
from specserve.engine.request import Request
from specserve.executor.cuda_graphs import capture
from specserve.model.draft_heads import DraftHead
from specserve.spec.draft_graphs import page_table_of
from specserve.spec.tree import DraftTree, top_logprobs


@dataclass(frozen=True, order=True)
class TreeShape:
    """What one tree graph drafts: `depth` steps deep, `topk` children a node, the best `nodes` kept."""

    depth: int
    topk: int
    nodes: int

    @property
    def capacity(self) -> int:
        """Nodes a tree of full depth grows before the best are kept."""
        return self.size(self.depth)

    @property
    def kept(self) -> int:
        return min(self.nodes, self.capacity)

    @property
    def fed(self) -> int:
        """Head rows the deepest step feeds: every frontier's k nodes."""
        return (self.depth - 1) * self.topk

    def size(self, depth: int) -> int:
        """Nodes a request `depth` deep grows (0: none)."""
        return 0 if depth < 1 else self.topk + (depth - 1) * self.topk**2

    def level(self, depth: int) -> int:
        """The first node id of a depth."""
        return 0 if depth <= 1 else self.size(depth - 1)


class _TreeBucket:
    """The static inputs of one (batch, shape) graph, its constants, and its packed output."""

    def __init__(
        self, batch: int, shape: TreeShape, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        k = shape.topk
        self.batch, self.shape = batch, shape
        self.head = torch.zeros(2 * batch, dtype=torch.int64, device=device)
        self.base, self.depth = self.head.split(batch)  # the root's context slot; depth (0: none)
        self.logits = torch.zeros(batch, vocab, dtype=torch.float32, device=device)  # the root's
        self.tail = torch.zeros(batch, hidden, dtype=dtype, device=device)  # module output at the seed
        # Constants (no host tensor may be made inside a capture).
        per_depth = [k] + [k * k] * (shape.depth - 1)
        self.node_depth = torch.from_numpy(np.repeat(np.arange(1, shape.depth + 1), per_depth)).to(device)
        self.rows = torch.arange(max(shape.fed, 1), device=device)
        self.eye = torch.eye(k, dtype=torch.bool, device=device)
        self.children = torch.arange(k, device=device)
        self.row_ids = torch.arange(1, shape.kept + 1, device=device).expand(batch, -1)
        # The first child id each frontier node of step s gets: level(s + 1) + i * k.
        self.first_child = [
            (shape.level(s + 1) + k * torch.arange(k, device=device)).expand(batch, -1)
            for s in range(shape.depth)
        ]
        self.query_start = [torch.arange(batch + 1, device=device) * (s * k) for s in range(shape.depth)]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.packed: torch.Tensor | None = None


class TreeGraphs:
    """Tree graphs of a one-module head per (batch bucket, shape): `pick` a bucket, `run` it."""

    def __init__(
        self,
        head: DraftHead,
        backend: AttentionBackend,
        kv_cache: KVCache,
        batch_sizes: Sequence[int],
        shapes: Sequence[TreeShape],
        max_seq_len: int,
    ) -> None:
        assert len(head.step_modules) == 1, "tree graphs draft with one step module"
        self.head, self.backend, self.kv_cache = head, backend, kv_cache
        self.page_size, self.max_seq_len = kv_cache.page_size, max_seq_len
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.shapes = tuple(sorted(set(shapes)))
        weight = next(head.parameters())
        device, dtype = weight.device, weight.dtype
        vocab = head.output_head(0).weight.shape[0]
        self.page_table = torch.zeros(
            self.batch_sizes[-1], -(-max_seq_len // self.page_size), dtype=torch.int64, device=device
        )
        self.buckets = {
            (b, s): _TreeBucket(b, s, vocab, head.spec.arch.hidden_size, dtype, device)
            for b in self.batch_sizes
            for s in self.shapes
            if vocab >= s.topk
        }
        self.captured = device.type == "cuda"
        if self.captured:
            pool = None
            for key in sorted(self.buckets, key=lambda key: -key[0] * key[1].fed):  # largest first
                bucket = self.buckets[key]
                bucket.graph, bucket.packed = capture(lambda b=bucket: self.search(b), pool)
                pool = bucket.graph.pool()
            torch.cuda.synchronize()

    def pick(self, batch: int, depth: int, topk: int, nodes: int) -> tuple[int, TreeShape] | None:
        """The bucket for `batch` requests at most `depth` deep (the shallowest graph that deep)."""
        b = next((b for b in self.batch_sizes if b >= batch), None)
        shape = next(
            (s for s in self.shapes if s.topk == topk and s.nodes == nodes and s.depth >= depth), None
        )
        return None if b is None or shape is None or (b, shape) not in self.buckets else (b, shape)

    def run(
        self,
        reqs: Sequence[Request],
        logits: Sequence[torch.Tensor],
        tails: Sequence[torch.Tensor],
        positions: Sequence[int],
        depths: Sequence[int],
        key: tuple[int, TreeShape],
    ) -> list[DraftTree | None]:
        """Each request's tree from its extend's state: its root's draft logits, module 0's output at
        its newest extended position `positions[i]` (the tree's nodes are written from the next
        one on; their KV slots must be held), `depths[i]` deep. One host read."""
        bucket = self.buckets[key]
        shape, n = bucket.shape, len(reqs)
        head = np.zeros((2, bucket.batch), dtype=np.int64)
        head[0, :n] = [p + 1 for p in positions]
        head[1, :n] = depths
        ends = [p + 1 + shape.topk * max(d - 1, 1) for p, d in zip(positions, depths, strict=True)]
        table = page_table_of(reqs, ends, self.page_size, bucket.batch)
        packed = to_device(
            torch.from_numpy(np.concatenate([head.ravel(), table.ravel()])), bucket.head.device
        )
        bucket.head.copy_(packed[: head.size])
        self.page_table[: bucket.batch, : table.shape[1]].copy_(packed[head.size :].view(table.shape))
        torch.stack(list(logits), out=bucket.logits[:n])
        torch.stack(list(tails), out=bucket.tail[:n])
        if self.captured:
            bucket.graph.replay()
            out = bucket.packed
        else:
            out = self.search(bucket)
        return _trees(out[:n].cpu().numpy(), shape, depths)

    # ---- the search (captured) ---------------------------------------------------------------

    @torch.inference_mode()
    def search(self, b: _TreeBucket) -> torch.Tensor:
        """Every request's tree, packed [batch, 2 kept + 2 (kept + 1) topk]: tokens, parents, candidates' tokens and rows (`_trees` reads it)."""
        shape, batch, k = b.shape, b.batch, b.shape.topk
        device = b.logits.device
        scores, ids = self._top(b.logits, k)
        token = torch.zeros(batch, shape.capacity, dtype=torch.int64, device=device)
        score = torch.zeros(batch, shape.capacity, dtype=torch.float64, device=device)
        parent = torch.full((batch, shape.capacity), -1, dtype=torch.int64, device=device)
        child = torch.full_like(parent, -1)  # each expanded node's first child id
        token[:, :k], score[:, :k] = ids, scores.double()
        fed = torch.zeros(batch, shape.fed, dtype=torch.int64, device=device)
        hidden = b.tail.new_zeros(batch, shape.fed, b.tail.shape[-1])
        mask = torch.zeros(batch, shape.fed, shape.fed, dtype=torch.bool, device=device)
        slots, positions = self._layout(b) if shape.fed else (None, None)
        outputs = None
        for s in range(1, shape.depth):
            lo, r0, r1 = shape.level(s), (s - 1) * k, s * k
            order = torch.sort(-score[:, lo : shape.level(s + 1)], dim=1, stable=True).indices[:, :k]
            front = order + lo
            fed[:, r0:r1] = front
            live = (b.depth > s)[:, None]
            child.scatter_(1, front, torch.where(live, b.first_child[s], -1))
            if s == 1:
                hidden[:, r0:r1] = b.tail[:, None]
            else:  # each frontier node is the child of row (s-2)k + order // k's node
                up = (s - 2) * k + order // k
                hidden[:, r0:r1] = outputs.gather(1, up[..., None].expand(-1, -1, hidden.shape[-1]))
                mask[:, r0:r1] = mask.gather(1, up[..., None].expand(-1, -1, shape.fed))
            mask[:, r0:r1, r0:r1] |= b.eye
            live_slots = torch.where(live, slots[:, :r1], DUMMY_PAGE * self.page_size)
            outputs, logits = self._feed(b, s, token.gather(1, fed[:, :r1]), live_slots, positions[:, :r1],
                                         hidden[:, :r1], mask[:, :r1, :r1])  # fmt: skip
            child_scores, child_ids = self._top(logits, k)
            new = slice(shape.level(s + 1), shape.level(s + 1) + k * k)
            token[:, new] = child_ids.view(batch, k * k)
            total = score.gather(1, front)[..., None] + child_scores.double().view(batch, k, k)
            score[:, new] = total.view(batch, k * k)
            parent[:, new] = front[..., None].expand(-1, -1, k).reshape(batch, k * k)
        return self._select(b, token, score, parent, child)

    def _top(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k likeliest draft tokens (target ids) and their log-probabilities (`TreeSearch._top`)."""
        scores, ids = top_logprobs(logits, k)
        return scores, self.head.to_target_ids(ids)

    def _layout(self, b: _TreeBucket) -> tuple[torch.Tensor, torch.Tensor]:
        """Every fed row's KV slot and position [batch, fed], computed once a search: row j of a
        request is written at context slot root + j (past its page table: the dummy slot) and feeds
        a node of depth j // k + 1, at position root - 1 + that depth."""
        ps, table = self.page_size, self.page_table[: b.batch]
        context = b.base[:, None] + b.rows[: b.shape.fed]
        page = table.gather(1, (context // ps).clamp(max=table.shape[1] - 1))
        inside = context < table.shape[1] * ps
        slots = torch.where(inside, page * ps + context % ps, DUMMY_PAGE * ps)
        return slots, b.base[:, None] + b.rows[: b.shape.fed] // b.shape.topk

    def _feed(
        self,
        b: _TreeBucket,
        step: int,
        ids: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over the fed nodes [batch, rows] (written at `slots`, the dummy slot for requests
        past their depth): its outputs [batch, rows, H], and the draft logits of the newest k rows
        (step `step`'s frontier) [batch * k, V_draft]."""
        batch, rows = ids.shape
        table = self.page_table[:batch]
        seq_lens = torch.where(b.depth > step, b.base + rows, rows)
        attention = AttentionBatch(
            b.query_start[step],
            seq_lens,
            slots.reshape(-1),
            table,
            self.page_size,
            rows,
            self.max_seq_len,
            mask,
        )
        ctx = self.backend.prepare(attention, self.kv_cache)
        out, to_logits = self.head.run(
            0,
            ids.reshape(-1),
            hidden.reshape(batch * rows, -1),
            positions.reshape(-1),
            ctx,
            from_target=False,
        )
        newest = to_logits.view(batch, rows, -1)[:, rows - b.shape.topk :]
        return out.view(batch, rows, -1), self.head.logits(0, newest.reshape(batch * b.shape.topk, -1))

    def _select(
        self,
        b: _TreeBucket,
        token: torch.Tensor,
        score: torch.Tensor,
        parent: torch.Tensor,
        child: torch.Tensor,
    ) -> torch.Tensor:
        """The best `kept` nodes in rows, their parents' rows and each row's candidates, packed.
        A request's nodes are ids below its size, so one stable sort with the rest last keeps
        `TreeSearch._kept`'s order (score, then depth, then id: ids ascend with depth)."""
        shape, batch, k = b.shape, b.batch, b.shape.topk
        present = b.node_depth[None, :] <= b.depth[:, None]
        order = torch.sort(torch.where(present, -score, float("inf")), dim=1, stable=True).indices
        kept = order[:, : shape.kept]
        row_of = torch.full_like(token, -1).scatter_(1, kept, b.row_ids)
        up = parent.gather(1, kept)
        parents = torch.where(up < 0, 0, row_of.gather(1, up.clamp(min=0))).clamp(min=0)
        first = torch.cat([torch.zeros_like(kept[:, :1]), child.gather(1, kept)], dim=1)
        has = (first >= 0)[..., None]
        cand = (first.clamp(min=0)[..., None] + b.children).view(batch, -1)
        cand_tokens = torch.where(has, token.gather(1, cand).view(has.shape[0], -1, k), -1)
        cand_rows = torch.where(has, row_of.gather(1, cand).view(has.shape[0], -1, k), -1)
        return torch.cat(
            [token.gather(1, kept), parents, cand_tokens.view(batch, -1), cand_rows.view(batch, -1)], dim=1
        )


def _trees(packed: np.ndarray, shape: TreeShape, depths: Sequence[int]) -> list[DraftTree | None]:
    """Each request's `DraftTree` (None where it drafts nothing) from its packed row."""
    kept, k = shape.kept, shape.topk
    cuts = np.cumsum([kept, kept, (kept + 1) * k])
    tokens, parents, cand_tokens, cand_rows = np.split(packed, cuts, axis=1)
    out: list[DraftTree | None] = []
    for i, depth in enumerate(depths):
        n = min(shape.size(depth), kept)
        if n == 0:
            out.append(None)
            continue
        out.append(
            DraftTree(
                tuple(tokens[i, :n].tolist()),
                parents[i, :n].copy(),
                cand_tokens[i].reshape(kept + 1, k)[: n + 1].copy(),
                cand_rows[i].reshape(kept + 1, k)[: n + 1].copy(),
            )
        )
    return out
