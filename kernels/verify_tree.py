"""Tree acceptance in one launch: walk each request's draft tree from its root, emit the tokens.

Each row of a request is a node of its tree (row 0: the root, the last verified token). A row holds up
to K candidates in the order they are tested: a token, the probability of accepting it given that
the candidates before it were rejected (`accept`, from `specserve.spec.tree_verify`), the uniform it
is tested with, and the candidate's own row (or -1 where it has none: a candidate the tree pruned or
the scheduler cut). At the current row the first candidate with u < accept wins: its token is
emitted and, if it has a row, the walk moves there; if it has none, or no candidate wins, the step
ends, emitting the winner or the row's residual draw (`residual`). So a request emits its accepted
path (nodes with rows), then one more token. One program per request writes the emitted tokens and
the accepted rows straight into padded [B, width] blocks.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_cands", "width"])  # per-step sizes: no compile per size class
def _verify_tree_kernel(
    accept_ptr,
    token_ptr,
    child_ptr,
    u_ptr,
    residual_ptr,
    start_ptr,
    tokens_out_ptr,
    path_out_ptr,
    count_out_ptr,
    num_cands,
    width,
    K: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(start_ptr + b)
    cols = tl.arange(0, K)
    in_row = cols < num_cands
    node = start * 0  # local row of the walk; -1 once it has stopped
    accepted = start * 0
    for step in range(0, width):
        running = node >= 0
        # Built from the block (not `in_row & running`): the interpreter refuses a scalar-block mask.
        live = in_row & ((cols * 0 + node) >= 0)
        base = (start + node) * num_cands
        a = tl.load(accept_ptr + base + cols, mask=live, other=0.0)
        u = tl.load(u_ptr + base + cols, mask=live, other=2.0)
        tok = tl.load(token_ptr + base + cols, mask=live, other=-1)
        child = tl.load(child_ptr + base + cols, mask=live, other=-1)
        wins = live & (tok >= 0) & (u < a)
        first = tl.min(tl.where(wins, cols, K), axis=0)
        hit = first < K
        won_tok = tl.sum(tl.where(cols == first, tok, 0), axis=0)
        won_child = tl.sum(tl.where(cols == first, child, 0), axis=0)
        residual = tl.load(residual_ptr + start + node, mask=running, other=0)
        tl.store(tokens_out_ptr + b * width + step, tl.where(hit, won_tok, residual), mask=running)
        moves = running & hit & (won_child > 0)
        tl.store(path_out_ptr + b * width + step, won_child, mask=moves)
        accepted += moves.to(accepted.dtype)
        node = tl.where(moves, won_child, -1)
    tl.store(count_out_ptr + b, accepted)


def verify_tree(
    accept: torch.Tensor,
    tokens: torch.Tensor,
    children: torch.Tensor,
    u: torch.Tensor,
    residual: torch.Tensor,
    row_start: torch.Tensor,
    num_rows: torch.Tensor,
    width: int,
    *,
    vocab: int | None = None,
    check_bounds: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(emitted tokens [B, width] int64, -1 past each request's end; the accepted rows [B, width],
    local to the request, -1 past the path; the path lengths [B]).

    Request b owns rows row_start[b] .. row_start[b] + num_rows[b] - 1 of `accept` / `u` [R, K]
    float64, `tokens` / `children` [R, K] int64 (children: local rows) and `residual` [R] int64.
    `width` must exceed the deepest path (`check_tree_rows`); `vocab` bounds the token ids checked."""
    _check(accept, tokens, children, u, residual, row_start, num_rows, width, vocab, check_bounds)
    batch, num_cands = row_start.shape[0], accept.shape[1]
    out_tokens = torch.full((batch, width), -1, dtype=torch.int64, device=accept.device)
    out_path = torch.full((batch, width), -1, dtype=torch.int64, device=accept.device)
    count = torch.zeros(batch, dtype=torch.int64, device=accept.device)
    if batch:
        _verify_tree_kernel[(batch,)](
            accept,
            tokens,
            children,
            u,
            residual,
            row_start,
            out_tokens,
            out_path,
            count,
            num_cands,
            width,
            K=triton.next_power_of_2(max(num_cands, 1)),
        )
    return out_tokens, out_path, count


def verify_tree_ref(
    accept: torch.Tensor,
    tokens: torch.Tensor,
    children: torch.Tensor,
    u: torch.Tensor,
    residual: torch.Tensor,
    row_start: torch.Tensor,
    num_rows: torch.Tensor,
    width: int,
    *,
    vocab: int | None = None,
    check_bounds: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch, all requests at once, one walk step per iteration."""
    _check(accept, tokens, children, u, residual, row_start, num_rows, width, vocab, check_bounds)
    batch, num_cands = row_start.shape[0], accept.shape[1]
    device = accept.device
    out_tokens = torch.full((batch, width), -1, dtype=torch.int64, device=device)
    out_path = torch.full((batch, width), -1, dtype=torch.int64, device=device)
    count = torch.zeros(batch, dtype=torch.int64, device=device)
    node = torch.zeros(batch, dtype=torch.int64, device=device)
    running = torch.ones(batch, dtype=torch.bool, device=device)
    cols = torch.arange(num_cands, device=device)
    for step in range(width):
        if num_cands == 0 or not running.any():
            if running.any():
                out_tokens[running, step] = residual[row_start[running]]
            break
        row = row_start + node
        tok, child = tokens[row], children[row]
        wins = (tok >= 0) & (u[row] < accept[row])
        first = torch.where(wins, cols, num_cands).amin(dim=1)
        hit = first < num_cands
        pick = first.clamp(max=num_cands - 1)[:, None]
        won_tok, won_child = tok.gather(1, pick)[:, 0], child.gather(1, pick)[:, 0]
        emitted = torch.where(hit, won_tok, residual[row])
        out_tokens[:, step] = torch.where(running, emitted, out_tokens[:, step])
        moves = running & hit & (won_child > 0)
        out_path[:, step] = torch.where(moves, won_child, out_path[:, step])
        count += moves.long()
        node = torch.where(moves, won_child, node)
        running = moves
    return out_tokens, out_path, count


def check_tree_rows(children: np.ndarray, row_start: np.ndarray, num_rows: np.ndarray, width: int) -> None:
    """Raise ValueError unless every request's rows lie inside the row block and form a tree whose
    walk fits `width`: each candidate row is a later row of the same request, each row is some
    row's candidate at most once, and no path from row 0 has `width` or more rows."""
    rows = children.shape[0]
    if (row_start < 0).any() or (num_rows < 1).any() or (row_start + num_rows > rows).any():
        raise ValueError(f"row_start/num_rows: a request's rows fall outside [0, {rows})")
    for start, n in zip(row_start.tolist(), num_rows.tolist(), strict=True):
        block = children[start : start + n]
        own = np.arange(n)[:, None]
        used = block[block >= 0]
        if ((block >= n) | ((block >= 0) & (block <= own))).any():
            raise ValueError("children: a candidate row is not a later row of its own request")
        if np.unique(used).shape[0] != used.shape[0]:
            raise ValueError("children: a row is the candidate of two rows")
        depth = np.zeros(n, dtype=np.int64)
        for r in range(n):  # rows come after their parents, so one pass settles every depth
            kids = block[r][block[r] >= 0]
            depth[kids] = depth[r] + 1
        if n and depth.max() >= width:
            raise ValueError(f"width: a path of {int(depth.max()) + 1} rows does not fit {width}")


def _check(accept, tokens, children, u, residual, row_start, num_rows, width, vocab, check_bounds) -> None:
    if accept.dim() != 2 or accept.dtype != torch.float64:
        raise ValueError(f"accept: expected float64 [R, K], got {accept.dtype} {tuple(accept.shape)}")
    rows, device = accept.shape, accept.device
    for name, t, dtype in (
        ("tokens", tokens, torch.int64),
        ("children", children, torch.int64),
        ("u", u, torch.float64),
    ):
        if t.shape != rows or t.dtype != dtype or t.device != device or not t.is_contiguous():
            raise ValueError(
                f"{name}: expected contiguous {dtype} {tuple(rows)}, got {t.dtype} {tuple(t.shape)}"
            )
    if not accept.is_contiguous():
        raise ValueError("accept: must be contiguous")
    if residual.shape != rows[:1] or residual.dtype != torch.int64:
        raise ValueError(
            f"residual: expected int64 [{rows[0]}], got {residual.dtype} {tuple(residual.shape)}"
        )
    for name, t in (("row_start", row_start), ("num_rows", num_rows)):
        if t.dim() != 1 or t.dtype != torch.int64 or t.shape != row_start.shape:
            raise ValueError(f"{name}: expected int64 [B], got {t.dtype} {tuple(t.shape)}")
    if width < 1:
        raise ValueError(f"width: must be >= 1, got {width}")
    if check_bounds:
        check_tree_rows(children.cpu().numpy(), row_start.cpu().numpy(), num_rows.cpu().numpy(), width)
        top = vocab if vocab is not None else torch.iinfo(torch.int64).max
        if bool(((tokens < -1) | (tokens >= top) | ((children >= 0) & (tokens < 0))).any()):
            raise ValueError(f"tokens: a candidate id falls outside [0, {top}) (or a row has no token)")
        if bool(((residual < 0) | (residual >= top)).any()):
            raise ValueError(f"residual: a token id falls outside [0, {top})")
