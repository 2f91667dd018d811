"""Helpers for engine tests (a helper module, not a test file)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.engine.engine import Engine
from specserve.engine.request import Request
from specserve.engine.scheduler import ScheduledItem
from specserve.engine.step_input import build_step_input
from specserve.types import SamplingParams


def last_logits(engine: Engine, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Last-position logits [B, V] of a batch of prompts, through the engine's paged path in one step
    (its runner: under TP rank 0 this drives the followers too)."""
    reqs = [
        Request(f"probe-{i}", list(p), SamplingParams(max_new_tokens=1), seed=0)
        for i, p in enumerate(prompts)
    ]
    try:
        for req in reqs:
            assert engine.kv.reserve(req, req.prompt_len), "KV pool too small for the probe"
        items = [ScheduledItem.of(req, req.prompt_len) for req in reqs]
        inp = build_step_input(items, engine.kv.page_size, engine.device)
        _, _, logits = engine.runner.execute(inp)
        return logits[inp.sample_logit_rows]
    finally:
        for req in reqs:
            engine.kv.free(req)


def hf_greedy(model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by HF transformers `generate` (stops at EOS like the engine does)."""
    ids = torch.tensor([list(prompt)], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        top_p=None,
        top_k=None,
        temperature=None,
    )
    return out[0, ids.shape[1] :].tolist()


def hf_last_logits(model, prompt: Sequence[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([list(prompt)], device=model.device)).logits[0, -1].float()


def max_rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()
