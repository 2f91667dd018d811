"""A whole TP group on this host: followers in spawned processes, rank 0 in the caller.

For tests and single-host use; a Ray deployment starts the same `run_followers` in actors instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch.multiprocessing as mp

from specserve.config import EngineConfig
from specserve.executor.follower import run_followers
from specserve.executor.tp_group import (
    DEFAULT_TIMEOUT_S,
    destroy_tp_group,
    init_tp_group,
    pick_rendezvous_address,
    tp_backend,
)
from specserve.model.parallel import TPInfo


@contextmanager
def local_tp_group(
    configs: Sequence[EngineConfig], timeout_s: float = DEFAULT_TIMEOUT_S, join_timeout_s: float = 60.0
) -> Iterator[TPInfo]:
    """Start ranks 1..N-1 (N = the configs' `tp_size`), each serving one engine per config in order,
    join as rank 0 and yield its TPInfo: build `Engine(config, tp=...)` for each config in that order
    and `shutdown()` each. On GPU rank r uses cuda:r. `timeout_s` bounds every collective; on exit the
    followers get `join_timeout_s` to finish, and one that failed or hung raises RuntimeError."""
    size = _group_size(configs)
    address = pick_rendezvous_address()
    spawn = mp.get_context("spawn")
    followers = []
    for rank in range(1, size):
        payload = [dataclasses.asdict(_on_rank(c, rank)) for c in configs]  # plain dicts, as Ray sends
        proc = spawn.Process(
            target=run_followers, args=(payload, rank, size, address, timeout_s), daemon=True
        )
        proc.start()
        followers.append(proc)
    device = _on_rank(configs[0], 0).torch_device()
    ok = False
    try:
        tp = init_tp_group(0, size, address, tp_backend(device), device, timeout_s)
        try:
            yield tp
            ok = True
        finally:
            destroy_tp_group(tp)
    finally:
        _reap(followers, join_timeout_s if ok else 5.0, check=ok)


def _group_size(configs: Sequence[EngineConfig]) -> int:
    sizes = {c.tp_size for c in configs}
    devices = {c.torch_device().type for c in configs}
    if not configs or len(sizes) != 1 or len(devices) != 1:
        raise ValueError("tp_size: a local group serves configs of one tp_size and one device type")
    return sizes.pop()


def _on_rank(config: EngineConfig, rank: int) -> EngineConfig:
    """Rank r's config: its own GPU when the engine runs on CUDA."""
    if config.torch_device().type != "cuda":
        return config
    return dataclasses.replace(config, device=f"cuda:{rank}")


def _reap(followers: list, timeout_s: float, check: bool) -> None:
    """Join every follower; kill the ones still running. With `check`, a follower that did not exit
    cleanly raises (without it the caller's own exception is already on its way)."""
    bad = []
    for proc in followers:
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
            bad.append(f"pid {proc.pid} hung")
        elif proc.exitcode != 0:
            bad.append(f"pid {proc.pid} exited with {proc.exitcode}")
    if check and bad:
        raise RuntimeError(f"TP followers did not exit cleanly: {', '.join(bad)}")
