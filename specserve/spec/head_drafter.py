"""Drafting with a head that reads the target's hidden states: EAGLE, EAGLE-3, a chain of MTP layers.

The head's KV (its own tensors on the target's pages) holds, for step module i at position p, the
pair (token x_{p+1}, hidden h_i(p-1)) run through module i, where h_0(p-1) is really the target's
feature at p (module 0 pairs each token with the feature that predicted it) and h_i(p-1) for i > 0
is module i-1's output at p-1 (zero before position 0). So module i at p sees exactly the inputs
step i of a draft chain started at p - i would give it.

- `after_target` (the "draft extend") runs every module over the positions whose target features
  the last forward produced and whose next token is now known: verified tokens only, so that KV
  stays valid. The newest pair's prediction is the request's first draft token; each module's
  output at the newest position is kept (`HeadState.tails`) for the next extend and for drafting.
- `draft` continues the chain. Step s uses module min(s, k-1). While s < k the module has never seen
  positions past the verified ones, so it runs over all of them (s rows: the earlier drafts are its
  tokens, module s-1's outputs its hidden states) and its KV is what an extend would have written;
  after that the last module is reused one row per step, fed its own previous output.

- With CUDA graphs (`use_graphs`, specserve/spec/draft_graphs.py) a greedy chain runs in one graph
  replay, and an extend over short feeds in another, whose greedy seeds stay on the device until
  the chain reads them back with its drafts; batches they do not fit run the eager path above.

- `skip_target` (a step with speculation off, adaptive speculation's plain decode) keeps the
  features instead (`Request.draft_backlog`, at most MAX_BACKLOG positions: then it extends over
  them at once); the next extend, or the catch-up at the start of the next draft, runs over the
  backlog and the new positions together, so the head's KV and tails are as if it had never paused.

- `draft_tree` (topk > 1) grows an EAGLE-2 tree from the extend's prediction (`TreeSearch`). Step s
  runs module min(s, k-1) over the nodes on the paths to the nodes it expands (a forest under a tree
  mask, in the head's KV past the verified positions), each node paired with the module output the
  chain rule above names at its parent: module m-1's while the node is no deeper than m (the module
  is new to that path), else module m's own. Shared ancestors are recomputed, not kept per branch.
  After verify, the extend runs over the accepted path (`TargetFeed.rows`), rewriting that KV.

A head's drafts are its argmax (a tree's: the top-k by cumulative log-probability) for sampling
requests too: verify then takes each as a one-hot q, accepting it with the target's probability of
it, which is lossless for any drafts (`specserve/spec/verify.py`), as SGLang's and vLLM's EAGLE
verifies do. Drafts drawn from q accepted a little more at T = 0.7 (a chain of 5 on MT-Bench: 2.14
against 1.96; a tree of 8x32: 2.84 against 2.82, docs/draft-training.md), but only deterministic ones
run in the draft graphs and the device loop, which sampling requests then share with greedy ones.

Every draft is therefore a pure function of the token sequence (invariant 5; the tests compare it
with a from-scratch computation), except after a prefix-cache hit, where the MTP tails at the cached
boundary are unknown and taken as zero: that costs acceptance, never correctness.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.attention.backend import AttentionBackend
from specserve.engine.host_copy import to_device
from specserve.engine.kv_cache import KVCache
from specserve.engine.request import Request
from specserve.engine.step_input import build_draft_input, build_forest_input
from specserve.model.draft_heads import DraftHead
from specserve.spec.draft_graphs import DeviceTokens, DraftGraphs, DraftGraphShapes
from specserve.spec.drafter import Drafter, TargetFeed, greedy_drafts
from specserve.spec.tree import DraftTree, Expansion, TreeSearch, tree_feed
from specserve.spec.tree_graphs import TreeGraphs, TreeShape

# Positions of target features a request keeps while nothing drafts, before the head extends over them.
MAX_BACKLOG = 32


@dataclass(frozen=True)
class HeadState:
    """A request's drafting state after an extend over positions up to `position`."""

    position: int  # the newest extended position (the request's last verified token - 1)
    tails: torch.Tensor  # [k, H] each module's output at `position`
    token: int | None = None  # the first draft (None when the request will not decode next)
    logits: torch.Tensor | None = None  # [V_draft] the draft logits it came from (trees start there)
    # With draft graphs, a greedy first draft stays on the device until read: row `seed_row` of it.
    seeds: DeviceTokens | None = None
    seed_row: int = 0

    @property
    def seeded(self) -> bool:
        return self.token is not None or self.seeds is not None

    def first_draft(self) -> int:
        return self.token if self.token is not None else self.seeds.host()[self.seed_row]


@dataclass(slots=True)
class Backlog:
    """Target features of positions `start ...` the head has not extended over, and their next tokens.
    Grown in place by every plain step (`add`): it is host work on each of them, for every request."""

    start: int
    tokens: list[int]
    chunks: list[tuple[torch.Tensor, int, int]]  # rows [a, b) of a step's kept features, in order

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def add(self, tokens: Sequence[int], kept: torch.Tensor, a: int, b: int) -> None:
        self.tokens.extend(tokens)
        self.chunks.append((kept, a, b))

    def features(self) -> list[torch.Tensor]:
        """[n_i, F] parts, [len(tokens), F] together (sliced only now: a view per step and request
        was most of the host work the backlog took)."""
        return [kept[a:b] for kept, a, b in self.chunks]


class HeadDrafter(Drafter):
    needs_pages = True

    def __init__(
        self, head: DraftHead, vocab: int, num_pages: int, page_size: int, backend: AttentionBackend
    ) -> None:
        self.head, self.vocab, self.page_size = head, vocab, page_size
        self.num_modules = len(head.step_modules)
        self.capture = head.spec.aux_layers
        weight = next(head.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        self.kv_cache = KVCache.allocate(head.spec.arch, num_pages, page_size, self.dtype, self.device)
        self.backend = backend
        self.graphs: DraftGraphs | None = None  # CUDA graphs of the chain and the extend (`use_graphs`)
        self.tree_graphs: TreeGraphs | None = None  # and of tree searches

    def use_graphs(
        self,
        batch_sizes: tuple[int, ...],
        chain_steps: int,
        depth: int,
        max_seq_len: int,
        prefill: tuple[tuple[int, int], ...] = (),
        trees: tuple[TreeShape, ...] = (),
    ) -> None:
        """Draft through CUDA graphs (captured now on CUDA; the same static buffers run eagerly on
        the CPU): chains of up to `chain_steps` drafts (0: no chain graphs) and extends over up to
        `depth` + 1 tokens (an accepted chain or tree path and its bonus token), for batches up to
        the largest of `batch_sizes`; `prefill`: the target's prefill buckets (batch, query len),
        whose prompts the head extends over next; `trees`: the tree shapes searched on the device
        (a head of one step module only; specserve/spec/tree_graphs.py)."""
        first = self.head.spec
        fc = getattr(self.head.step_modules[0], "fc", None)
        features = fc.in_features if first.method == "eagle3" else first.arch.hidden_size
        shapes = DraftGraphShapes(batch_sizes, max(chain_steps - 1, 0), (depth + 1,), tuple(prefill))
        self.graphs = DraftGraphs(self.head, self.backend, self.kv_cache, shapes, max_seq_len, features)
        if trees and self.num_modules == 1:
            self.tree_graphs = TreeGraphs(
                self.head, self.backend, self.kv_cache, batch_sizes, trees, max_seq_len
            )

    # ---- draft extend ----------------------------------------------------------------------

    def skip_target(self, feeds: list[TargetFeed], features: torch.Tensor) -> None:
        now, keep = [], []
        for f in feeds:
            if not f.tokens:
                continue
            old = f.request.draft_backlog
            joined = old is not None and old.end == f.start
            if len(f.tokens) + (len(old.tokens) if joined else 0) > MAX_BACKLOG:
                now.append(f)  # extended now, its backlog with it
            else:
                keep.append((f, old if joined else None))
        if keep:
            # One copy of the rows and one gather for the whole batch, each request keeping the span
            # of its part (`Backlog.add`): per request (a pageable copy of its rows, a gather, a concatenation with its
            # backlog) they were host work linear in the batch on every plain step of adaptive
            # speculation with a head (docs/benchmarks.md, nineteenth session).
            rows = torch.tensor([r for f, _ in keep for r in f.rows])
            kept = features.index_select(0, to_device(rows, features.device))
            offset = 0
            for f, old in keep:
                end = offset + len(f.rows)
                if old is not None:
                    old.add(f.tokens, kept, offset, end)
                else:
                    f.request.draft_backlog = Backlog(f.start, list(f.tokens), [(kept, offset, end)])
                offset = end
        if now:
            self.after_target(now, features)

    def _catch_up(self, reqs: list[Request]) -> None:
        """Extend over the backlogs of requests about to draft (their seed comes from it)."""
        feeds = [TargetFeed(r, r.num_computed, [], [], True) for r in reqs if r.draft_backlog is not None]
        if feeds:
            self.after_target(feeds, None)

    def _with_backlogs(
        self, feeds: list[TargetFeed], features: torch.Tensor | None
    ) -> tuple[list[TargetFeed], torch.Tensor | None]:
        """Each feed preceded by its request's backlog when that ends where the feed starts (a
        backlog that does not is stale, e.g. across a retraction, and dropped); the backlogs'
        features appended to `features`, their rows pointing there."""
        if not any(f.request.draft_backlog is not None for f in feeds):
            return feeds, features
        parts = [] if features is None else [features]
        offset = 0 if features is None else features.shape[0]
        out = []
        for f in feeds:
            backlog, f.request.draft_backlog = f.request.draft_backlog, None
            if backlog is None or backlog.end != f.start:
                out.append(f)
                continue
            rows = [*range(offset, offset + len(backlog.tokens)), *f.rows]
            parts.extend(backlog.features())
            offset += len(backlog.tokens)
            tokens = backlog.tokens + list(f.tokens)
            out.append(TargetFeed(f.request, backlog.start, tokens, rows, f.seed))
        return out, torch.cat(parts) if parts else features

    def after_target(self, feeds: list[TargetFeed], features: torch.Tensor | None) -> None:
        feeds, features = self._with_backlogs(feeds, features)
        feeds = [f for f in feeds if f.tokens]
        if not feeds:
            return
        graphs = self.graphs
        if graphs is not None and graphs.extend_bucket(len(feeds), max(len(f.tokens) for f in feeds)):
            previous = self._previous_tails(feeds, slice(0, -1)) if self.num_modules > 1 else None
            out = graphs.run_extend(
                [(f.request, f.start, f.tokens) for f in feeds],
                features,
                [r for f in feeds for r in f.rows],
                previous,
            )
            # A copy either way: the graph's output is overwritten by the next replay in its pool.
            self._store(
                feeds,
                out.tails,
                lambda index: out.logits.clone() if index is None else out.logits.index_select(0, index),
            )
            return
        inp = build_draft_input([(f.request, f.start, f.tokens) for f in feeds], self.page_size, self.device)
        ctx = self.backend.prepare(inp.attention, self.kv_cache)
        rows = to_device(torch.tensor([r for f in feeds for r in f.rows]), features.device)
        hidden = features.index_select(0, rows).to(self.dtype)
        lens = [len(f.tokens) for f in feeds]
        first_rows = np.cumsum([0, *lens[:-1]])
        last = inp.last_rows
        tails, seed_hidden, out = [], None, None
        for i in range(self.num_modules):
            if out is not None:  # module i pairs each token with module i-1's output one position back
                hidden = _shift_in(out, self._previous_tails(feeds, i - 1), first_rows, self.device)
            out, to_logits = self.head.run(i, inp.input_ids, hidden, inp.positions, ctx, from_target=i == 0)
            tails.append(out.index_select(0, last))
            if i == 0:
                seed_hidden = to_logits.index_select(0, last)
        stacked = torch.stack(tails, dim=1)  # [B, k, H]
        self._store(
            feeds,
            stacked,
            lambda index: self.head.logits(
                0, seed_hidden if index is None else seed_hidden.index_select(0, index)
            ),
        )

    def _previous_tails(self, feeds: list[TargetFeed], module: int | slice) -> torch.Tensor:
        """Module `module`'s output (or those of a slice of modules) just before each feed's first
        position (zero where unknown)."""
        zero = torch.zeros(self.head.spec.arch.hidden_size, dtype=self.dtype, device=self.device)
        if isinstance(module, slice):
            zero = zero.expand(len(range(self.num_modules)[module]), -1)
        rows = []
        for f in feeds:
            state: HeadState | None = f.request.draft_state
            known = state is not None and state.position == f.start - 1
            rows.append(state.tails[module] if known else zero)
        return torch.stack(rows)

    def _store(
        self,
        feeds: list[TargetFeed],
        tails: torch.Tensor,
        seed_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Each feed's state: `tails` [B, k, H]; `seed_logits(index)`: module 0's draft logits at the
        last rows of feeds `index` (those that seed a draft; None: every feed, no index copied)."""
        seeded = [b for b, f in enumerate(feeds) if f.seed]
        tokens, logits, seeds = [], None, None
        if seeded:
            every = len(seeded) == len(feeds)
            logits = seed_logits(None if every else to_device(torch.tensor(seeded), self.device))
            if self.graphs is not None:
                # Read with verify's results and the chain's drafts (one host sync a step), or
                # when first needed.
                seeds = DeviceTokens(self.graphs.greedy_tokens(logits))
            else:
                tokens = greedy_drafts(logits, self.head.to_target_ids)
        by_feed = dict(zip(seeded, range(len(seeded)), strict=True))
        # Every row's view in one call each (indexing a tensor row by row costs microseconds a row).
        tail_rows = tails.unbind(0)
        logit_rows = logits.unbind(0) if logits is not None else ()
        for b, f in enumerate(feeds):
            j = by_feed.get(b)
            f.request.draft_state = HeadState(
                position=f.start + len(f.tokens) - 1,
                tails=tail_rows[b],
                token=tokens[j] if j is not None and seeds is None else None,
                logits=logit_rows[j] if j is not None else None,
                seeds=seeds if j is not None else None,
                seed_row=j or 0,
            )
            f.request.draft_computed = f.start + len(f.tokens)

    # ---- drafting --------------------------------------------------------------------------

    def draft(self, reqs: list[Request], budgets: list[int]) -> None:
        """Steps 1..budget-1 of each request's chain (step 0 came from the extend). Graphed chains
        stay on the device (`take_pending_drafts`)."""
        if self.graphs is not None:
            self.graphs.take_pending()  # a round nobody verified (e.g. the cost profile's)
        self._catch_up(reqs)
        chains = [(r, k) for r, k in zip(reqs, budgets, strict=True) if k > 0 and has_seed(r)]
        if self._graph_fits(chains):  # their seeds may still be on the device
            self._draft_graphed(chains)
            return
        for req, _ in chains:
            req.draft, req.draft_probs = [req.draft_state.first_draft()], None
        # request -> the previous step's outputs, one per row it ran (step 0: module 0 at the seed)
        outputs = {id(r): r.draft_state.tails[:1] for r, _ in chains}
        step = 1
        while chains := [(r, k) for r, k in chains if k > step]:
            self._draft_step([r for r, _ in chains], step, outputs)
            step += 1

    def _graph_fits(self, chains: list[tuple[Request, int]]) -> bool:
        """The chain graphs can draft these chains."""
        graphs = self.graphs
        return (
            graphs is not None
            and bool(chains)
            and graphs.fits_chain(len(chains), max(k for _, k in chains) - 1)
        )

    def take_pending_drafts(self) -> torch.Tensor | None:
        return self.graphs.take_pending() if self.graphs is not None else None

    def _draft_graphed(self, chains: list[tuple[Request, int]]) -> None:
        """Every chain in one graph replay, from the extend's seeds and tails (the seeds, where they
        are still on the device, stay there with the drafts: placeholders until verify reads them)."""
        reqs = [r for r, _ in chains]
        states: list[HeadState] = [r.draft_state for r in reqs]
        drafts = self.graphs.launch_chain(
            reqs,
            seed_tokens(states, self.device),
            [s.tails for s in states],
            [s.position for s in states],
            [k - 1 for _, k in chains],
        )
        for req, chain in zip(reqs, drafts, strict=True):
            req.draft, req.draft_probs = chain, None

    def _draft_step(self, reqs: list[Request], step: int, outputs: dict[int, torch.Tensor]) -> None:
        module = self.head.module_for_step(step)
        fresh = module == step  # a module new to this chain runs over every position since the seed
        feeds, hidden_rows = [], []
        for req in reqs:
            state: HeadState = req.draft_state
            if fresh:
                first = state.position + 1
                feeds.append((req, first, req.draft[:step]))
                hidden_rows.append(state.tails[module - 1 : module])
                if step > 1:
                    hidden_rows.append(outputs[id(req)])
            else:
                feeds.append((req, state.position + step, [req.draft[-1]]))
                hidden_rows.append(outputs[id(req)][-1:])
        inp = build_draft_input(feeds, self.page_size, self.device)
        ctx = self.backend.prepare(inp.attention, self.kv_cache)
        hidden = torch.cat(hidden_rows)
        out, to_logits = self.head.run(module, inp.input_ids, hidden, inp.positions, ctx, from_target=False)
        logits = self.head.logits(module, to_logits.index_select(0, inp.last_rows))
        tokens = greedy_drafts(logits, self.head.to_target_ids)
        starts = np.cumsum([0, *[len(t) for _, _, t in feeds]])
        for i, req in enumerate(reqs):
            outputs[id(req)] = out[starts[i] : starts[i + 1]]
            req.draft.append(tokens[i])

    # ---- tree drafting ---------------------------------------------------------------------

    def draft_tree(self, reqs: list[Request], depths: list[int], topk: int, num_nodes: int) -> None:
        self._catch_up(reqs)
        active = [(r, d) for r, d in zip(reqs, depths, strict=True) if d > 0 and has_seed(r)]
        if not active:
            return
        trees = self._graph_trees(active, topk, num_nodes)
        if trees is None:
            trees = self._host_trees(active, topk, num_nodes)
        for (req, _), tree in zip(active, trees, strict=True):
            req.draft, req.draft_tree = list(tree.tokens) if tree else [], tree

    def _graph_trees(
        self, active: list[tuple[Request, int]], topk: int, num_nodes: int
    ) -> list[DraftTree | None] | None:
        """The trees searched on the device in one graph replay (None: no graph fits)."""
        graphs = self.tree_graphs
        key = graphs.pick(len(active), max(d for _, d in active), topk, num_nodes) if graphs else None
        if key is None:
            return None
        states: list[HeadState] = [r.draft_state for r, _ in active]
        return graphs.run(
            [r for r, _ in active],
            [s.logits for s in states],
            [s.tails[0] for s in states],
            [s.position for s in states],
            [d for _, d in active],
            key,
        )

    def _host_trees(
        self, active: list[tuple[Request, int]], topk: int, num_nodes: int
    ) -> list[DraftTree | None]:
        """EAGLE-2's search on the host (`TreeSearch`), a head forward a step."""
        search = TreeSearch(
            [r for r, _ in active],
            [d for _, d in active],
            topk,
            num_nodes,
            self.vocab,
            self.head.to_target_ids,
            deterministic=True,
        )
        states: list[HeadState] = [r.draft_state for r, _ in active]
        search.expand(search.roots(), torch.stack([s.logits for s in states]))
        # Module outputs by (module, bank row): rows 0..B-1 the roots (the extend's tails), then
        # one row per node the first time it is fed.
        most = max(d for _, d in active)
        bank = torch.zeros(
            self.num_modules,
            len(active) * (1 + topk * max(most - 1, 0)),
            states[0].tails.shape[-1],
            dtype=self.dtype,
            device=self.device,
        )
        bank[:, : len(active)] = torch.stack([s.tails for s in states], dim=1)
        # Each node's bank row once fed (-1: not yet), per (request, node id).
        rows = np.full(search.token.shape, -1, dtype=np.int64)
        step = 1
        while len(where := search.frontier(step)):
            search.expand(where, self._tree_step(search, where, step, bank, rows))
            step += 1
        return search.trees()

    def _tree_step(
        self,
        search: TreeSearch,
        where: Expansion,
        step: int,
        bank: torch.Tensor,
        rows: np.ndarray,
    ) -> torch.Tensor:
        """Draft logits at the nodes step `step` expands (their paths fed as forests)."""
        module = self.head.module_for_step(step)
        fed = tree_feed(search, where)
        b, node = fed.request, fed.node
        new = rows[b, node] < 0  # first fed now: the next bank rows, in feed order
        rows[b[new], node[new]] = len(search.reqs) + (rows >= 0).sum() + np.arange(new.sum())
        up = search.parent[b, node]
        src_module = np.where(search.depth[b, node] <= module, module - 1, module)
        src_row = np.where(up < 0, b, rows[b, np.maximum(up, 0)])
        reqs = [search.reqs[i] for i in fed.requests.tolist()]
        starts = [r.draft_state.position + 1 for r in reqs]
        inp = build_forest_input(
            reqs, starts, search.token[b, node], fed.lens, fed.forest, fed.rows, self.page_size, self.device
        )
        ctx = self.backend.prepare(inp.attention, self.kv_cache)
        index = to_device(torch.from_numpy(np.stack([src_module, src_row, rows[b, node]])), self.device)
        hidden = bank[index[0], index[1]]
        out, to_logits = self.head.run(module, inp.input_ids, hidden, inp.positions, ctx, from_target=False)
        bank[module].index_copy_(0, index[2], out.to(bank.dtype))
        return self.head.logits(module, to_logits.index_select(0, inp.last_rows))


def has_seed(req: Request) -> bool:
    state = req.draft_state
    return isinstance(state, HeadState) and state.seeded and state.position == req.num_computed - 1


def seed_tokens(states: list[HeadState], device: torch.device) -> list[int] | torch.Tensor:
    """The first drafts of these states: on the device where one extend left them all there."""
    seeds = states[0].seeds
    if seeds is None or any(s.seeds is not seeds for s in states):
        return [s.first_draft() for s in states]
    rows = [s.seed_row for s in states]
    if rows == list(range(seeds.ids.shape[0])):
        return seeds.ids
    return seeds.ids.index_select(0, to_device(torch.tensor(rows), device))


def _shift_in(out: torch.Tensor, previous: torch.Tensor, first_rows: np.ndarray, device) -> torch.Tensor:
    """Row r of the result is out[r - 1], except each feed's first row, which takes `previous`."""
    index = np.arange(out.shape[0]) - 1 + previous.shape[0]
    index[first_rows] = np.arange(previous.shape[0])
    return torch.cat([previous, out]).index_select(0, to_device(torch.from_numpy(index), device))
