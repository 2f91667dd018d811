"""The n-gram chain lookup of `NgramDrafter` over token histories held on the device.

The device loop (`specserve/engine/device_loop.py`) runs speculative steps back to back without the
host reading any token in between, so the next draft must come from tokens that never left the
device. This is the same lookup as `NgramDrafter._propose`: among earlier positions p (p < len - 1)
holding the sequence's last token, the match length is how many of the sequence's last tokens the
tokens up to p repeat (at most `max_match`, and at most len - 1); the latest of the longest wins if
it reaches `min_match`, and the draft is what followed it, cut at the sequence's end.

Here every request's whole history row is compared at once, `max_match` shifted equality tests of
[B, W] int64s: no data-dependent shapes, so the loop's glue can be captured in a CUDA graph, and at
the widths of a serving context (a few thousand tokens) a few microseconds of device time.
`tests/test_ngram_device.py` checks it against `NgramDrafter.propose` draft for draft.
"""

from __future__ import annotations

import torch


def ngram_chain_drafts(
    hist: torch.Tensor, lengths: torch.Tensor, num_steps: int, min_match: int, max_match: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """hist [B, W] int64 (row b's tokens in its first lengths[b] entries, lengths >= 1, anything past
    them); returns (drafts [B, num_steps], valid [B, num_steps]): valid marks the draft tokens
    `NgramDrafter.propose(tokens, num_steps)` returns, a prefix of each row (none without a match)."""
    batch, width = hist.shape
    pos = torch.arange(width, device=hist.device)
    last = (lengths - 1).unsqueeze(1)  # [B, 1] index of the last token
    # Candidate ends: earlier positions holding the last token; each starts a match of length 1.
    alive = (hist == hist.gather(1, last)) & (pos < last)
    length = alive.to(torch.int64)
    top = torch.clamp(last, max=max_match)  # the host caps a match at min(max_match, len - 1)
    for i in range(1, max_match):
        # Position p - i against the sequence's i-th token from the end, while the match lasts.
        suffix = hist.gather(1, (last - i).clamp(min=0))
        shifted = torch.nn.functional.pad(hist[:, : width - i], (i, 0), value=-1)
        alive = alive & (shifted == suffix) & (i < top)
        length += alive
    # The latest of the longest: length first, position breaking ties.
    score = torch.where(length >= min_match, length * width + pos, -1)
    best = score.max(dim=1).values
    end = torch.remainder(best, width).unsqueeze(1)
    ahead = end + 1 + torch.arange(num_steps, device=hist.device)
    valid = (best >= 0).unsqueeze(1) & (ahead <= last)
    drafts = hist.gather(1, ahead.clamp(max=width - 1))
    return drafts, valid
