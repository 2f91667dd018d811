"""Chain acceptance in one launch: accept tests, first rejection, emitted tokens, accept counts.

Speculative verify leaves, per request, `n` draft rows and one bonus row. Draft row j is accepted
iff u_j * q_j(d_j) < p_j(d_j) (rejection sampling; q = 1 for deterministic drafts), and the chain
stops at the first rejection, whose row emits its residual draw; an all-accepted chain emits the
bonus row's draw. Done in torch this is a gather, a compare, a cumprod and a scatter per step,
plus index bookkeeping on the host; here one program per request walks its rows and writes the
emitted tokens straight into a padded [B, max_drafts + 1] block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["width"])  # a per-step size: no compile per size class
def _verify_chain_kernel(
    probs_ptr,
    q_ptr,
    draft_ptr,
    start_ptr,
    count_ptr,
    u_ptr,
    replacement_ptr,
    tokens_ptr,
    accepted_ptr,
    probs_stride,
    q_stride,
    width,
    HAS_Q: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(start_ptr + b)
    count = tl.load(count_ptr + b)
    accepted = count * 0
    running = count >= 0  # still inside the accepted prefix
    for j in range(0, width - 1):
        row = start + j
        active = running & (j < count)
        d = tl.load(draft_ptr + row, mask=active, other=0)
        p = tl.load(probs_ptr + row * probs_stride + d, mask=active, other=0.0).to(tl.float64)
        if HAS_Q:
            q = tl.load(q_ptr + row * q_stride + d, mask=active, other=1.0).to(tl.float64)
        else:
            q = 1.0
        u = tl.load(u_ptr + row, mask=active, other=1.0)
        ok = active & (u * q < p)
        tl.store(tokens_ptr + b * width + j, d, mask=ok)
        accepted += ok.to(accepted.dtype)
        running = ok
    tl.store(tokens_ptr + b * width + accepted, tl.load(replacement_ptr + start + accepted))
    tl.store(accepted_ptr + b, accepted)


def verify_chain(
    probs: torch.Tensor,
    draft: torch.Tensor,
    row_start: torch.Tensor,
    num_drafts: torch.Tensor,
    u: torch.Tensor,
    replacement: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    max_drafts: int | None = None,
    *,
    check_bounds: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, max_drafts + 1] int64, -1 past each chain's end; accepted draft counts [B]).

    Request b owns rows row_start[b] .. row_start[b] + num_drafts[b]: its drafts, then the bonus
    row. `draft_probs` None means deterministic drafts (q(d) = 1)."""
    probs, draft_probs, max_drafts = _prepare(
        probs, draft, row_start, num_drafts, u, replacement, draft_probs, max_drafts, check_bounds
    )
    batch = row_start.shape[0]
    tokens = torch.full((batch, max_drafts + 1), -1, dtype=torch.int64, device=probs.device)
    accepted = torch.zeros(batch, dtype=torch.int64, device=probs.device)
    if batch:
        q = draft_probs if draft_probs is not None else probs
        _verify_chain_kernel[(batch,)](
            probs,
            q,
            draft,
            row_start,
            num_drafts,
            u,
            replacement,
            tokens,
            accepted,
            probs.stride(0),
            q.stride(0),
            max_drafts + 1,
            HAS_Q=draft_probs is not None,
        )
    return tokens, accepted


def verify_chain_ref(
    probs: torch.Tensor,
    draft: torch.Tensor,
    row_start: torch.Tensor,
    num_drafts: torch.Tensor,
    u: torch.Tensor,
    replacement: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    max_drafts: int | None = None,
    *,
    check_bounds: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, vectorised over a [B, max_drafts + 1] grid of (request, row in its chain)."""
    probs, draft_probs, max_drafts = _prepare(
        probs, draft, row_start, num_drafts, u, replacement, draft_probs, max_drafts, check_bounds
    )
    j = torch.arange(max_drafts + 1, device=probs.device)
    is_draft = j[None, :] < num_drafts[:, None]  # [B, W]
    rows = torch.where(is_draft, row_start[:, None] + j, row_start[:, None])
    d = draft[rows]
    p = probs[rows, d].double()
    q = draft_probs[rows, d].double() if draft_probs is not None else torch.ones_like(p)
    ok = is_draft & (u[rows] * q < p)
    accepted = ok.long().cumprod(dim=1).sum(dim=1)
    tokens = torch.where(j[None, :] < accepted[:, None], d, -1)
    last = replacement[row_start + accepted]
    tokens = tokens.scatter(1, accepted[:, None], last[:, None])
    return tokens, accepted


def _prepare(probs, draft, row_start, num_drafts, u, replacement, draft_probs, max_drafts, check_bounds):
    """Shapes and dtypes checked, vocab dimensions made unit-stride, max_drafts known, bounds checked."""
    probs, draft_probs = _check(probs, draft, row_start, num_drafts, u, replacement, draft_probs)
    if max_drafts is None:
        max_drafts = int(num_drafts.max().item()) if num_drafts.numel() else 0
    if check_bounds:
        _check_bounds(probs, draft, row_start, num_drafts, max_drafts)
    return probs, draft_probs, max_drafts


def _check(probs, draft, row_start, num_drafts, u, replacement, draft_probs):
    if probs.dim() != 2 or probs.dtype != torch.float32:
        raise ValueError(f"probs: expected a float32 [R, V] tensor, got {probs.dtype} {tuple(probs.shape)}")
    rows = probs.shape[0]
    for name, t, dtype in (
        ("draft", draft, torch.int64),
        ("u", u, torch.float64),
        ("replacement", replacement, torch.int64),
    ):
        if t.shape != (rows,) or t.dtype != dtype:
            raise ValueError(f"{name}: expected {dtype} [{rows}], got {t.dtype} {tuple(t.shape)}")
    for name, t in (("row_start", row_start), ("num_drafts", num_drafts)):
        if t.dim() != 1 or t.dtype != torch.int64 or t.shape != row_start.shape:
            raise ValueError(
                f"{name}: expected int64 [B] (B = len(row_start)), got {t.dtype} {tuple(t.shape)}"
            )
    if probs.stride(1) != 1:
        probs = probs.contiguous()
    if draft_probs is not None:
        if draft_probs.shape != probs.shape or draft_probs.dtype != torch.float32:
            raise ValueError(
                f"draft_probs: expected float32 {tuple(probs.shape)}, got {tuple(draft_probs.shape)}"
            )
        if draft_probs.stride(1) != 1:
            draft_probs = draft_probs.contiguous()
    return probs, draft_probs


def _check_bounds(probs, draft, row_start, num_drafts, max_drafts: int) -> None:
    """Every chain inside [0, R), no chain longer than max_drafts, every draft id inside [0, V)."""
    rows, vocab = probs.shape
    if not row_start.numel():
        return
    if bool((num_drafts < 0).any()) or int(num_drafts.max()) > max_drafts:
        raise ValueError(f"num_drafts: every count must be in [0, max_drafts={max_drafts}]")
    if bool((row_start < 0).any()) or bool((row_start + num_drafts >= rows).any()):
        raise ValueError(f"row_start: a chain's rows fall outside [0, {rows})")
    j = torch.arange(max_drafts + 1, device=draft.device)
    is_draft = j[None, :] < num_drafts[:, None]
    ids = draft[torch.where(is_draft, row_start[:, None] + j, row_start[:, None])][is_draft]
    if bool(((ids < 0) | (ids >= vocab)).any()):
        raise ValueError(f"draft: a draft token id falls outside [0, {vocab})")
