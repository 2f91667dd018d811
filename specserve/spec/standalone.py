"""Standalone drafting: a smaller Llama-family model with the target's tokenizer drafts the chain.

Its KV cache is its own tensors but shares the target's pages and slot layout, so a request's pages
serve both models and the scheduler's accounting covers the drafter too. `Request.draft_computed`
counts the tokens whose draft KV is valid; each drafting pass first catches up on the rest (the
whole prompt the first time, then the last verified tokens), then samples one token per step from
the drafter's own filtered distribution q, which verify needs for its acceptance test.
"""

from __future__ import annotations

import torch

from specserve.attention.torch_backend import TorchAttentionBackend
from specserve.engine.kv_cache import KVCache
from specserve.engine.request import Request
from specserve.engine.step_input import build_draft_input
from specserve.model.loader import LoadedModel
from specserve.spec.drafter import Drafter, choose_drafts


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
    ) -> None:
        if draft.arch.vocab_size != target_vocab:
            raise ValueError(
                f"speculative.draft_model: its vocabulary ({draft.arch.vocab_size}) differs from "
                f"the target's ({target_vocab}); a standalone drafter must share the tokenizer"
            )
        self.model, self.vocab = draft.model, target_vocab
        self.page_size, self.device = page_size, device
        self.kv_cache = KVCache.allocate(draft.arch, num_pages, page_size, dtype, device)
        self.backend = TorchAttentionBackend()

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
        inp = build_draft_input(feeds, self.page_size, self.device)
        ctx = self.backend.prepare(inp.attention, self.kv_cache)
        hidden = self.model(inp.input_ids, inp.positions, ctx)
        logits = self.model.compute_logits(hidden[inp.last_rows])
        reqs = [r for r, _, _ in feeds]
        return choose_drafts(logits, reqs, [r.num_output + step for r in reqs], self.vocab)
