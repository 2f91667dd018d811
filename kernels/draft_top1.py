"""Fused top-1 draft token and its probability in one pass over the vocabulary.

p(argmax) = exp(x_max - x_max) / Σ exp(x_i - x_max) = 1 / Σ exp(x_i - x_max): an online-softmax
sweep (running max and rescaled running sum) gives it without materialising the softmax. The
probability is computed, never assumed to be 1. Ties go to the lowest token id, as `torch.argmax`.
Rows must hold at least one finite logit; -inf entries (masked tokens) are fine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve_kernels.argmax import logit_rows


@triton.jit
def _draft_top1_kernel(logits_ptr, token_ptr, prob_ptr, vocab, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row * stride
    run_max = tl.full((), float("-inf"), tl.float32)
    run_sum = tl.full((), 0.0, tl.float32)
    run_arg = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        block_max = tl.max(x, axis=0)
        block_arg = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64) + start
        new_max = tl.maximum(run_max, block_max)
        # Shift by a finite value: while everything seen is -inf, -inf - -inf would be NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
        run_arg = tl.where(block_max > run_max, block_arg, run_arg)  # strict: earlier ties win
        run_max = new_max
    tl.store(token_ptr + row, run_arg)
    tl.store(prob_ptr + row, 1.0 / run_sum)


def draft_top1(logits: torch.Tensor, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] logits (any float dtype) → (top-1 token ids [B] int64, their probabilities [B] float32)."""
    logits = logit_rows(logits)
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    probs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _draft_top1_kernel[(rows,)](logits, tokens, probs, vocab, logits.stride(0), BLOCK=block)
    return tokens, probs


def draft_top1_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: softmax in (at least) fp32, then argmax and its probability."""
    x = logits if logits.dtype == torch.float64 else logits.float()
    probs = torch.softmax(x, dim=-1)
    token = x.argmax(dim=-1)
    return token, probs.gather(1, token[:, None]).squeeze(1)
