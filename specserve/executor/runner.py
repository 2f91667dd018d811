"""The target's forward for one engine step, and the protocol that keeps a TP group in lockstep.

Per step, rank 0 broadcasts a header [command, *StepInput.layout()] and then the step's packed int64
buffer (ids, logit rows, positions and the attention layout, exactly what `build_step_input` copied
to the device); every rank then runs the forward (row-parallel all-reduces inside) and the logits
(one all-gather). A header with command SHUTDOWN ends the followers' loop; KEEPALIVE, sent while rank 0
is idle, only restarts their wait (which is a collective, bounded by the group's timeout). The EAGLE-3 capture
list is not sent: it changes which residual streams rank 0 keeps, never which collectives run.
MOVE_KV [command, moves, segments + 1, ...] and then the moves' int64 buffer (sources, destinations,
segment bounds) compacts accepted tree paths in every rank's KV cache (`specserve_kernels.kv_move`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from specserve.attention.backend import AttentionBackend
from specserve.engine.host_copy import to_device
from specserve.engine.kv_cache import KVCache
from specserve.engine.state_pool import StatePool
from specserve.engine.step_input import (
    STEP_LAYOUT_LEN,
    StepInput,
    packed_size,
    resolve_future_ids,
    unpack_step_input,
)
from specserve.executor.cuda_graphs import CudaGraphs, GraphBuckets
from specserve.model.llama import LlamaForCausalLM
from specserve.model.parallel import TPInfo
from specserve_kernels import use_triton
from specserve_kernels.kv_move import move_kv, move_kv_ref

SHUTDOWN, STEP, KEEPALIVE, MOVE_KV = 0, 1, 2, 3
HEADER_LEN = 1 + STEP_LAYOUT_LEN

StepResult = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]


class ModelRunner:
    """One step of the target: (final hidden [T, H], captured residual streams or None, fp32 logits
    of `step.logit_rows` [R, V]). At TP size 1 this is the whole story: a direct call. A step padded
    to a CUDA-graph bucket replays that graph (`graphs`; every rank captured the same buckets)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        kv_cache: KVCache,
        graphs: CudaGraphs | None = None,
        states: StatePool | None = None,
    ) -> None:
        self.model, self.backend, self.kv_cache, self.graphs = model, backend, kv_cache, graphs
        self.states = states  # a hybrid model's recurrent state (its steps carry `recurrent`)

    @property
    def graph_buckets(self) -> GraphBuckets | None:
        return None if self.graphs is None else self.graphs.buckets

    def execute(
        self, step: StepInput, capture: tuple[int, ...] = (), future: torch.Tensor | None = None
    ) -> StepResult:
        """`future`: the tokens an earlier step sampled, still on the device; ids -(k + 1) of this
        step stand for future[k] (overlap scheduling)."""
        if step.graphed:
            return self.graphs.run(step, capture, future)
        if future is not None:
            resolve_future_ids(step.input_ids, future)
        ctx = self.backend.prepare(step.attention, self.kv_cache)
        if self.states is None:
            hidden, aux = self.model.forward_features(step.input_ids, step.positions, ctx, capture)
        else:
            if step.recurrent is None:
                raise ValueError("a hybrid model's step needs its recurrent layout (Engine.build_input)")
            states = self.states.context(step.recurrent)
            hidden, aux = self.model.forward_features(step.input_ids, step.positions, ctx, capture, states)
        return hidden, aux, self.model.compute_logits(hidden[step.logit_rows])

    def move_kv(self, src: list[int], dst: list[int], segments: list[int]) -> None:
        """Copy KV slots src[m] -> dst[m] in every layer, in order within each segment (moves
        already checked by `specserve_kernels.kv_move.check_moves`)."""
        packed = torch.tensor([*src, *dst, *segments], dtype=torch.int64)
        self._apply_moves(to_device(packed, self.kv_cache.k.device), len(src))

    def _apply_moves(self, packed: torch.Tensor, moves: int) -> None:
        src, dst, segments = packed[:moves], packed[moves : 2 * moves], packed[2 * moves :]
        move = move_kv if use_triton(packed.device) else move_kv_ref
        move(self.kv_cache.k, self.kv_cache.v, src, dst, segments, check_bounds=False)

    def shutdown(self) -> None:
        """Release the followers (none at size 1)."""

    def keepalive(self) -> None:
        """Ping idle followers (none at size 1)."""


class DriverRunner(ModelRunner):
    """TP rank 0: tell the followers each step before running it alongside them."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        kv_cache: KVCache,
        tp: TPInfo,
        graphs: CudaGraphs | None = None,
    ) -> None:
        super().__init__(model, backend, kv_cache, graphs)
        self.tp, self.closed = tp, False
        self.src = _driver_rank(tp)

    def execute(
        self, step: StepInput, capture: tuple[int, ...] = (), future: torch.Tensor | None = None
    ) -> StepResult:
        """`future`: as at size 1; the ids are resolved (on the device, in the packed buffer) before
        the broadcast, so followers never see a future id and need no sampled tokens of their own."""
        if self.closed:
            raise RuntimeError("the TP group was shut down")
        if future is not None:
            resolve_future_ids(step.input_ids, future)
        self._send_header(STEP, step.layout())
        dist.broadcast(step.packed, src=self.src, group=self.tp.group)
        return super().execute(step, capture)

    def _apply_moves(self, packed: torch.Tensor, moves: int) -> None:
        if self.closed:
            raise RuntimeError("the TP group was shut down")
        self._send_header(MOVE_KV, [moves, packed.shape[0] - 2 * moves] + [0] * (STEP_LAYOUT_LEN - 2))
        dist.broadcast(packed, src=self.src, group=self.tp.group)
        super()._apply_moves(packed, moves)

    def shutdown(self) -> None:
        if not self.closed:
            self._send_header(SHUTDOWN, [0] * STEP_LAYOUT_LEN)
            self.closed = True

    def keepalive(self) -> None:
        if not self.closed:
            self._send_header(KEEPALIVE, [0] * STEP_LAYOUT_LEN)

    def _send_header(self, command: int, layout: list[int]) -> None:
        header = torch.tensor([command, *layout], dtype=torch.int64, device=self.kv_cache.k.device)
        dist.broadcast(header, src=self.src, group=self.tp.group)


def make_runner(
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    kv_cache: KVCache,
    tp: TPInfo,
    graphs: CudaGraphs | None = None,
    states: StatePool | None = None,
) -> ModelRunner:
    """A direct call at TP size 1, else rank 0's broadcasting runner (no recurrent states: hybrid
    models run at TP size 1)."""
    if tp.size == 1:
        return ModelRunner(model, backend, kv_cache, graphs, states)
    assert states is None, "hybrid models run at TP size 1"
    return DriverRunner(model, backend, kv_cache, tp, graphs)


def follower_loop(
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    kv_cache: KVCache,
    tp: TPInfo,
    graphs: CudaGraphs | None = None,
) -> int:
    """Run every step rank 0 broadcasts until it sends SHUTDOWN; returns the number of steps run."""
    runner = ModelRunner(model, backend, kv_cache, graphs)
    device, src = kv_cache.k.device, _driver_rank(tp)
    steps = 0
    while True:
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
        dist.broadcast(header, src=src, group=tp.group)
        command, *layout = header.tolist()
        if command == SHUTDOWN:
            return steps
        if command == KEEPALIVE:
            continue
        if command == MOVE_KV:
            moves, bounds = layout[:2]
            packed = torch.empty(2 * moves + bounds, dtype=torch.int64, device=device)
            dist.broadcast(packed, src=src, group=tp.group)
            runner._apply_moves(packed, moves)
            continue
        packed = torch.empty(packed_size(layout), dtype=torch.int64, device=device)
        dist.broadcast(packed, src=src, group=tp.group)
        runner.execute(unpack_step_input(layout, packed))
        steps += 1


def _driver_rank(tp: TPInfo) -> int:
    """The global rank of the group's rank 0 (what broadcast's `src` names)."""
    return 0 if tp.group is None else dist.get_global_rank(tp.group, 0)
