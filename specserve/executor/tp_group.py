"""A TP group's torch.distributed setup: rendezvous address, init, teardown, and one agreement.

A replica's ranks form their own default (world) group; every collective runs on a second group of
the same ranks (`TPInfo.group`), made with the step timeout. Two timeouts because joining and
stepping differ: a rank may take minutes to start (a new worker process, CUDA init), while a step
that waits that long on a rank means the rank is hung, and its replica should fail and be replaced.
Idle followers never reach the step timeout: rank 0 pings them (`Engine.keepalive`).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from specserve.model.parallel import NO_TP, TPInfo

DEFAULT_TIMEOUT_S = 300.0  # longest one collective waits for a rank (ServeConfig.tp_timeout_s)
SETUP_TIMEOUT_S = 600.0  # longest joining the group waits for every rank


def pick_rendezvous_address(host: str = "127.0.0.1") -> str:
    """`tcp://host:port` with a port the OS reports free (bound to port 0, then released). Rank 0
    picks it and publishes it to the followers; another process could take the port in between,
    which init then reports as an address in use, never as a silent mix-up of groups."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port = sock.getsockname()[1]
    return f"tcp://{host}:{port}"


def tp_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_tp_group(
    rank: int,
    size: int,
    address: str,
    backend: str,
    device: torch.device | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> TPInfo:
    """Join the group at `address` (rank 0 hosts the store there); blocks until every rank joined
    (at most max(timeout_s, SETUP_TIMEOUT_S)). `timeout_s` bounds each collective after that: a rank
    that waits longer on a peer raises. `device`: this rank's GPU, made current before NCCL starts
    (ignored by gloo)."""
    if size == 1:
        return NO_TP
    if not address.startswith("tcp://"):
        raise ValueError(f"address: expected tcp://host:port, got {address!r}")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    if backend == "nccl" and device is not None:
        # A bare "cuda" is this process's current GPU (a Ray actor sees only its own, as cuda:0).
        torch.cuda.set_device(device if device.index is not None else torch.cuda.current_device())
    setup = timedelta(seconds=max(timeout_s, SETUP_TIMEOUT_S))
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=size, timeout=setup)
    group = dist.new_group(list(range(size)), timeout=timedelta(seconds=timeout_s), backend=backend)
    return TPInfo(rank, size, group)


def destroy_tp_group(tp: TPInfo) -> None:
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def agree_num_pages(pages: int, tp: TPInfo, device: torch.device) -> int:
    """The KV pool size every rank allocates: the fewest pages any rank can afford. Each rank offers
    what its own free memory holds at its own bytes per token (rank 0 also holds the drafter's KV,
    an uneven head split gives the first ranks more heads), so the MIN covers every rank."""
    if tp.size == 1:
        return pages
    value = torch.tensor([pages], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=tp.group)
    return int(value.item())
