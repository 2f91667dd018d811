"""The recurrent state of a hybrid model's Mamba-2 layers: one slot per running request.

A slot holds, for every Mamba-2 layer, the SSM state [heads, head_dim, state_size] (fp32 whatever
the compute dtype: it accumulates over the whole sequence) and the convolution window, the last
`conv_kernel - 1` inputs of the causal convolution [conv_kernel - 1, conv_dim]. The slot always holds
the state after the request's first `num_computed` tokens.

Slots are accounted like KV pages (`KVManager` takes one with a request's first pages and gives it
back with them: finish, abort, retract), and `check` asserts the partition after every engine test.
A step that verifies drafts also writes per-token *snapshots* (the state after each draft token,
for a tree after each node along its parent path); once verify knows the last accepted token, its
snapshot is copied into the live slot (`commit`, `specserve_kernels.state_commit`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specserve.engine.host_copy import to_device
from specserve.model.arch import ModelArch
from specserve_kernels import check_indices, use_triton
from specserve_kernels.state_commit import check_commits, commit_states, commit_states_ref

if TYPE_CHECKING:  # the batch module imports the scheduler, which imports this one (via KVManager)
    from specserve.engine.recurrent_batch import RecurrentBatch


class OutOfSlots(Exception):
    """Every state slot is held; the scheduler answers as it does to a short page pool."""


@dataclass(frozen=True)
class RecurrentContext:
    """What a hybrid model's Mamba-2 layer `i` reads and writes in one step."""

    batch: RecurrentBatch
    ssm: torch.Tensor  # [mamba layers, slots, heads, head_dim, state] fp32, the live states
    conv: torch.Tensor  # [mamba layers, slots, conv_kernel - 1, conv_dim]
    snap_ssm: torch.Tensor  # [mamba layers, snapshots, heads, head_dim, state]
    snap_conv: torch.Tensor  # [mamba layers, snapshots, conv_kernel - 1, conv_dim]


class StatePool:
    def __init__(self, arch: ModelArch, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        if arch.mamba is None:
            raise ValueError("a state pool is for hybrid models (arch.mamba)")
        if num_slots < 1:
            raise ValueError("num_slots: need at least 1")
        m, layers = arch.mamba, len(arch.mamba_layers)
        self.ssm_shape = (m.num_heads, m.head_dim, m.state_size)
        self.conv_shape = (m.conv_kernel - 1, m.conv_dim)
        self.ssm = torch.zeros(layers, num_slots, *self.ssm_shape, dtype=torch.float32, device=device)
        self.conv = torch.zeros(layers, num_slots, *self.conv_shape, dtype=dtype, device=device)
        self.capacity = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._held: set[int] = set()
        # The snapshots of the last step run (what `commit` reads).
        self._snapshots = self._snapshot_buffers(0)

    @staticmethod
    def bytes_per_slot(arch: ModelArch, dtype: torch.dtype) -> int:
        m = arch.mamba
        if m is None:
            return 0
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_layer = 4 * m.num_heads * m.head_dim * m.state_size + itemsize * (m.conv_kernel - 1) * m.conv_dim
        return len(arch.mamba_layers) * per_layer

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfSlots(f"all {self.capacity} state slots are held")
        slot = self._free.popleft()
        self._held.add(slot)
        return slot

    def release(self, slot: int) -> None:
        assert slot in self._held, f"state slot {slot} released but not held"
        self._held.remove(slot)
        self._free.append(slot)

    def context(self, batch: RecurrentBatch) -> RecurrentContext:
        """A step's view: the live states and fresh snapshot buffers for its tracked tokens."""
        self._snapshots = self._snapshot_buffers(batch.num_snapshots)
        return RecurrentContext(batch, self.ssm, self.conv, *self._snapshots)

    def commit(self, sources: list[int], slots: list[int]) -> None:
        """Live slot slots[r] takes snapshot sources[r] of the last step (every layer, SSM state
        and convolution window)."""
        if not sources:
            return
        check_commits(sources, slots, self._snapshots[0].shape[1], self.capacity)
        device = self.ssm.device
        src, dst = to_device(torch.tensor([sources, slots], dtype=torch.int64), device).unbind(0)
        commit = commit_states if use_triton(device) else commit_states_ref
        commit(self.ssm, self.conv, *self._snapshots, src, dst, check_bounds=check_indices())

    def check(self, *, idle: bool) -> None:
        """Assert the partition of slots into free and held; with `idle`, none may be held."""
        free = set(self._free)
        assert len(free) == len(self._free), "a state slot is on the free list twice"
        assert not free & self._held, "a state slot is both free and held"
        assert len(free) + len(self._held) == self.capacity, "state slots leaked"
        if idle:
            assert not self._held, f"{len(self._held)} state slots still held with no request running"

    def _snapshot_buffers(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        layers = self.ssm.shape[0]
        return (
            torch.empty(layers, count, *self.ssm_shape, dtype=self.ssm.dtype, device=self.ssm.device),
            torch.empty(layers, count, *self.conv_shape, dtype=self.conv.dtype, device=self.conv.device),
        )
