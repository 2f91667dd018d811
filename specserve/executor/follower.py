"""A TP follower: ranks 1..N-1 of an engine replica, each running the target's forward on its shard.

`run_follower(config, rank, size, address)` is the whole life of a follower process or actor: join
the group rank 0 published, load this rank's shard, agree on the KV pool size, follow rank 0's steps
until it shuts the engine down, leave the group. It is a plain function of plain arguments (the
config may be a dict, as `dataclasses.asdict` writes it), so a Ray actor method can call it as is;
the actor must see its own GPU as its current device (Ray sets CUDA_VISIBLE_DEVICES per actor).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from specserve.config import EngineConfig
from specserve.engine.engine import attention_backend, context_length, local_kv_heads, make_graphs, pool_pages
from specserve.engine.kv_cache import KVCache
from specserve.executor.host_threads import settle_host_threads
from specserve.executor.runner import follower_loop
from specserve.executor.tp_group import (
    DEFAULT_TIMEOUT_S,
    agree_num_pages,
    destroy_tp_group,
    init_tp_group,
    tp_backend,
)
from specserve.model.loader import load_model
from specserve.model.parallel import TPInfo


def run_follower(
    config: EngineConfig | Mapping, rank: int, size: int, address: str, timeout_s: float = DEFAULT_TIMEOUT_S
) -> int:
    """Serve one engine as TP rank `rank` of `size` (rendezvous at `address`, `tcp://host:port`);
    returns the number of steps run once rank 0 calls `Engine.shutdown()`. `timeout_s`: the group's
    collective timeout, the same on every rank."""
    return run_followers([config], rank, size, address, timeout_s)[0]


def run_followers(
    configs: Sequence[EngineConfig | Mapping],
    rank: int,
    size: int,
    address: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[int]:
    """Serve one engine per config, in order, in one group session (rank 0 builds and shuts down
    its engines in the same order): tests amortise a process start over several engines this way.
    `timeout_s` bounds every collective (a dead rank 0 ends the wait with an error)."""
    configs = [EngineConfig.from_value(c) for c in configs]
    device = configs[0].torch_device()
    tp = init_tp_group(rank, size, address, tp_backend(device), device, timeout_s)
    try:
        return [serve_follower(config, tp) for config in configs]
    finally:
        destroy_tp_group(tp)


def serve_follower(config: EngineConfig, tp: TPInfo) -> int:
    """Load this rank's shard and follow one engine's steps (the group is already up)."""
    if config.tp_size != tp.size or tp.is_driver:
        raise ValueError(f"tp_size: config says {config.tp_size}, group has {tp.size}; rank {tp.rank}")
    device, dtype = config.torch_device(), config.torch_dtype()
    loaded = load_model(config.model, device, dtype, tp)
    settle_host_threads(device)
    arch, kv_heads = loaded.arch, local_kv_heads(loaded.arch, tp)
    # The same collective as rank 0's Engine._num_pages (a follower holds no drafter KV).
    per_token = KVCache.bytes_per_token(arch, dtype, kv_heads)
    num_pages = agree_num_pages(pool_pages(config.cache, device, per_token), tp, device)
    kv_cache = KVCache.allocate(arch, num_pages, config.cache.page_size, dtype, device, kv_heads)
    backend = attention_backend(config)
    # Captured in step with rank 0 (Engine.__init__), which makes its graphs after the same KV agreement.
    graphs = make_graphs(config, loaded.model, backend, kv_cache, context_length(config, arch))
    return follower_loop(loaded.model, backend, kv_cache, tp, graphs)
