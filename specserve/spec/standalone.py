"""Standalone drafting: a smaller Llama-family model with the target's tokenizer drafts the chain.

Its KV cache is its own tensors but shares the target's pages and slot layout, so a request's pages
serve both models and the scheduler's accounting covers the drafter too. `Request.draft_computed`
counts the tokens whose draft KV is valid; each drafting pass first catches up on the rest (the
whole prompt the first time, then the last verified tokens), then samples one token per step from
the drafter's own filtered distribution q, which verify needs for its acceptance test.

A tree (topk > 1) starts from the same catch-up; each further step runs the model over the nodes on
the paths to the nodes it expands, under a tree mask, in the KV slots past the verified tokens (it
recomputes the shared ancestors rather than keep per-branch KV: a few rows, no bookkeeping). Only the
verified tokens' draft KV stays valid; the next catch-up covers the accepted path.
"""

from __future__ import annotations

import torch

from specserve.attention.backend import AttentionBackend
from specserve.engine.kv_cache import KVCache
from specserve.engine.request import Request
from specserve.engine.step_input import DraftInput, build_draft_input, build_forest_input
from specserve.model.loader import LoadedModel
from specserve.spec.drafter import Drafter, choose_drafts
from specserve.spec.tree import Expansion, TreeSearch, tree_feed


class StandaloneDrafter(Drafter):
    needs_pages = True

    def __init__(
        self,
        draft: LoadedModel,
        target_vocab: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: AttentionBackend,
    ) -> None:
        if draft.arch.is_hybrid:
            raise ValueError(
                "speculative.draft_model: a hybrid (Mamba-2) model cannot draft; the standalone drafter "
                "keeps only a KV cache (use a Llama-family draft model)"
            )
        if draft.arch.vocab_size != target_vocab:
            raise ValueError(
                f"speculative.draft_model: its vocabulary ({draft.arch.vocab_size}) differs from "
                f"the target's ({target_vocab}); a standalone drafter must share the tokenizer"
            )
        self.model, self.vocab = draft.model, target_vocab
        self.page_size, self.device = page_size, device
        self.kv_cache = KVCache.allocate(draft.arch, num_pages, page_size, dtype, device)
        self.backend = backend

    def draft(self, reqs: list[Request], budgets: list[int]) -> None:
        """Fill `draft` (and, for sampling requests, `draft_probs`) with up to each budget of tokens."""
        budget = {id(r): k for r, k in zip(reqs, budgets, strict=True) if k > 0}
        active = [r for r in reqs if id(r) in budget]
        feeds = [(r, r.draft_computed, r.token_ids[r.draft_computed :]) for r in active]
        probs: dict[int, list[torch.Tensor]] = {id(r): [] for r in active}
        step = 0
        while feeds:
            tokens, q = self._one_step(feeds, step)
            for i, ((req, start, fed), token) in enumerate(zip(feeds, tokens, strict=True)):
                req.draft_computed = start + len(fed)
                req.draft.append(token)
                if q is not None:
                    probs[id(req)].append(q[i])
            feeds = [
                (r, r.draft_computed, [r.draft[-1]]) for r, _, _ in feeds if len(r.draft) < budget[id(r)]
            ]
            step += 1
        for req in active:
            req.draft_probs = None if req.params.greedy else torch.stack(probs[id(req)])

    def _one_step(
        self, feeds: list[tuple[Request, int, list[int]]], step: int
    ) -> tuple[list[int], torch.Tensor | None]:
        reqs = [r for r, _, _ in feeds]
        logits = self._logits(build_draft_input(feeds, self.page_size, self.device))
        return choose_drafts(logits, reqs, [r.num_output + step for r in reqs], self.vocab)

    def draft_tree(self, reqs: list[Request], depths: list[int], topk: int, num_nodes: int) -> None:
        active = [(r, d) for r, d in zip(reqs, depths, strict=True) if d > 0]
        if not active:
            return
        search = TreeSearch([r for r, _ in active], [d for _, d in active], topk, num_nodes, self.vocab)
        feeds = [(r, r.draft_computed, r.token_ids[r.draft_computed :]) for r, _ in active]
        search.expand(search.roots(), self._logits(build_draft_input(feeds, self.page_size, self.device)))
        for req, _ in active:
            req.draft_computed = len(req.token_ids)
        step = 1
        while len(where := search.frontier(step)):
            search.expand(where, self._tree_logits(search, where))
            step += 1
        for (req, _), tree in zip(active, search.trees(), strict=True):
            req.draft, req.draft_tree = list(tree.tokens) if tree else [], tree

    def _tree_logits(self, search: TreeSearch, where: Expansion) -> torch.Tensor:
        """Logits at the expanded nodes: each request feeds the union of their paths as a forest."""
        fed = tree_feed(search, where)
        reqs = [search.reqs[b] for b in fed.requests.tolist()]
        tokens = search.token[fed.request, fed.node]
        starts = [len(r.token_ids) for r in reqs]
        return self._logits(
            build_forest_input(
                reqs, starts, tokens, fed.lens, fed.forest, fed.rows, self.page_size, self.device
            )
        )

    def _logits(self, inp: DraftInput) -> torch.Tensor:
        """The draft model's logits at `inp.last_rows`."""
        ctx = self.backend.prepare(inp.attention, self.kv_cache)
        hidden = self.model(inp.input_ids, inp.positions, ctx)
        return self.model.compute_logits(hidden[inp.last_rows])
