"""The Mamba-2 mixer of a hybrid model (Bamba's `mamba` layers), over the engine's state slots.

Per token t: in_proj gives the gate z, the convolution input xBC and the step size dt; a depthwise
causal convolution (width K) over xBC along the token's path, then SiLU, gives x, B, C; then per
head h, with a = exp(dt * A_h) (A_h = -exp(A_log_h)):

    state_t = a_t * state_parent(t) + dt_t * x_t ⊗ B_t        y_t = state_t · C_t + D_h * x_t

and the output is out_proj(RMSNorm(y * silu(z))) (the norm per group of channels).

The recurrence runs in its quadratic "SSD" form over blocks of rows (`ssd_scan`): within a block,
y_t = Σ_{s ⪯ t} exp(A (P_t - P_s)) (C_t · B_s) dt_s x_s + exp(A P_t) (C_t · state_in), where s ⪯ t
means s is t or an ancestor and P_t sums dt along t's path. A chain's ancestors are the rows before
it; a draft tree's are its parent path: the same formula verifies chains and trees, and gives the
state after any row (the snapshots verify commits from). Everything recurrent is fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specserve.engine.recurrent_batch import RecurrentGroup
from specserve.engine.state_pool import RecurrentContext
from specserve.model.arch import ModelArch


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(z), over groups of `group_size` channels (fp32)."""

    def __init__(self, size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gated = y.float() * F.silu(z.float())
        groups = gated.view(*gated.shape[:-1], -1, self.group_size)
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.float() * normed.view(gated.shape)


class Mamba2Mixer(nn.Module):
    """`index`: this layer's place among the model's Mamba-2 layers (its state-pool layer)."""

    def __init__(self, arch: ModelArch, index: int) -> None:
        super().__init__()
        m = arch.mamba
        assert m is not None
        self.shape, self.index = m, index
        self.in_proj = nn.Linear(arch.hidden_size, m.inner_size + m.conv_dim + m.num_heads, bias=m.proj_bias)
        self.conv1d = nn.Conv1d(m.conv_dim, m.conv_dim, m.conv_kernel, groups=m.conv_dim, bias=m.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(m.num_heads))
        self.A_log = nn.Parameter(torch.empty(m.num_heads))
        self.D = nn.Parameter(torch.empty(m.num_heads))
        self.norm = GatedRMSNorm(m.inner_size, m.inner_size // m.num_groups, arch.rms_norm_eps)
        self.out_proj = nn.Linear(m.inner_size, arch.hidden_size, bias=m.proj_bias)

    def forward(self, hidden: torch.Tensor, states: RecurrentContext) -> torch.Tensor:
        m = self.shape
        z, xbc, dt = self.in_proj(hidden).split([m.inner_size, m.conv_dim, m.num_heads], dim=-1)
        y = torch.empty(hidden.shape[0], m.inner_size, dtype=torch.float32, device=hidden.device)
        for group in states.batch.groups:
            out = self._scan_group(group, xbc, dt, states)  # [B * Q, inner]
            y.index_copy_(0, group.tokens, out.index_select(0, group.grid_rows))
        return self.out_proj(self.norm(y, z).to(hidden.dtype))

    def _scan_group(
        self, g: RecurrentGroup, xbc: torch.Tensor, dt: torch.Tensor, states: RecurrentContext
    ) -> torch.Tensor:
        m, i = self.shape, self.index
        batch, width = g.token_rows.shape
        fresh = g.fresh[:, None, None]
        window_in = torch.where(fresh, 0, states.conv[i, g.slots])  # [B, K - 1, C]
        seq = torch.cat([window_in, xbc[g.token_rows]], dim=1)  # [B, K - 1 + Q, C]
        x, b, c = self._conv(seq, g.window).split(
            [m.inner_size, m.num_groups * m.state_size, m.num_groups * m.state_size], dim=-1
        )
        heads_per_group = m.num_heads // m.num_groups
        b = b.view(batch, width, m.num_groups, m.state_size).repeat_interleave(heads_per_group, dim=2)
        c = c.view(batch, width, m.num_groups, m.state_size).repeat_interleave(heads_per_group, dim=2)
        step = F.softplus(dt[g.token_rows].float() + self.dt_bias.float())
        step = step.clamp(m.time_step_min, m.time_step_max)  # [B, Q, H]
        x = x.reshape(batch, width, m.num_heads, m.head_dim)
        initial = torch.where(fresh[..., None], 0.0, states.ssm[i, g.slots])  # [B, H, P, N]
        y, end, snaps = ssd_scan(x, step, -torch.exp(self.A_log.float()), b, c, initial, g)
        y = y + self.D.float()[:, None] * x
        rows = torch.arange(batch, device=seq.device)
        if g.live.numel():
            live = g.live
            states.ssm[i, g.slots[live]] = end[live]
            last_window = g.window[live, g.last_rows[live], 1:]  # [U, K - 1]
            states.conv[i, g.slots[live]] = seq[rows[live, None], last_window]
        if g.snap_rows.numel():
            sb, st = g.snap_rows // width, g.snap_rows % width
            states.snap_ssm[i] = snaps
            states.snap_conv[i] = seq[sb[:, None], g.window[sb, st, 1:]]
        return y.reshape(batch * width, m.inner_size)

    def _conv(self, seq: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """SiLU(depthwise convolution) of each row over its window [B, Q, K] of `seq` [B, K-1+Q, C],
        accumulated in fp32, rounded to the compute dtype as the reference does, returned as fp32."""
        weight = self.conv1d.weight[:, 0, :].float()  # [C, K]
        rows = torch.arange(seq.shape[0], device=seq.device)[:, None]
        out = torch.zeros(*window.shape[:2], seq.shape[2], dtype=torch.float32, device=seq.device)
        for k in range(window.shape[2]):
            out += weight[:, k] * seq[rows, window[:, :, k]].float()
        if self.conv1d.bias is not None:
            out += self.conv1d.bias.float()
        return F.silu(out).to(seq.dtype).float()


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    initial: torch.Tensor,
    g: RecurrentGroup,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The recurrence over a group's rows in blocks of `g.block`: x [B, Q, H, P], dt [B, Q, H],
    a = A [H], b and c [B, Q, H, N], initial [B, H, P, N] (all fp32). Returns y [B, Q, H, P] (without
    the D skip), each request's state after its last row, and the states after the snapshot rows."""
    batch, width = g.valid.shape
    state, outputs, snaps = initial, [], None
    requests = torch.arange(batch, device=x.device)
    for start in range(0, width, g.block):
        stop = min(start + g.block, width)
        rows = slice(start, stop)
        block = _Block.of(_block_ancestors(g, start, stop), x[:, rows], dt[:, rows], a, b[:, rows])
        carried = torch.einsum("bthn,bhpn->bthp", c[:, rows], state) * torch.exp(block.path)[..., None]
        weights = torch.exp(block.gaps) * torch.einsum("bthn,bshn->btsh", c[:, rows], b[:, rows])
        outputs.append(torch.einsum("btsh,bshp->bthp", weights, block.inputs) + carried)
        if start == 0 and g.snap_rows.numel():
            snaps = block.states_after(state, g.snap_rows // width, g.snap_rows % width)
        last = (g.last_rows - start).clamp(0, stop - start - 1)
        reached = (g.last_rows >= start)[:, None, None, None]
        state = torch.where(reached, block.states_after(state, requests, last), state)
    return torch.cat(outputs, dim=1), state, snaps


@dataclass(frozen=True)
class _Block:
    """One block's path decays: P [B, n, H] (the decay summed along each row's path), the gaps
    P_t - P_s [B, n, n, H] (-inf where s is not on t's path), the inputs dt_s x_s and B_s."""

    path: torch.Tensor
    gaps: torch.Tensor
    inputs: torch.Tensor  # [B, n, H, P]
    b: torch.Tensor  # [B, n, H, N]

    @classmethod
    def of(
        cls, ancestors: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor
    ) -> _Block:
        path = torch.einsum("bts,bsh->bth", ancestors.float(), dt * a)
        gaps = (path[:, :, None, :] - path[:, None, :, :]).masked_fill(~ancestors[..., None], float("-inf"))
        return cls(path, gaps, x * dt[..., None], b)

    def states_after(self, state: torch.Tensor, req: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        """The state [R, H, P, N] after row row[r] of request req[r], from the block's input `state`."""
        added = torch.einsum(
            "rsh,rshp,rshn->rhpn", torch.exp(self.gaps[req, row]), self.inputs[req], self.b[req]
        )
        return torch.exp(self.path[req, row])[:, :, None, None] * state[req] + added


def _block_ancestors(g: RecurrentGroup, start: int, stop: int) -> torch.Tensor:
    """[B, n, n] bool: row s (of this block) is row t or an ancestor of it; padding rows none."""
    n = stop - start
    valid = g.valid[:, start:stop]
    causal = torch.ones(n, n, dtype=torch.bool, device=valid.device).tril()
    ancestors = causal[None] & valid[:, :, None] & valid[:, None, :]
    if start == 0 and g.tree_ancestors is not None:  # trees lie in the first block (g.block >= tree)
        side = g.tree_ancestors.shape[1]
        tree = torch.zeros_like(ancestors)
        tree[:, :side, :side] = g.tree_ancestors
        ancestors = torch.where(g.tree_flags[:, None, None], tree, ancestors)
    return ancestors
