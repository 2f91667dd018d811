"""Copy HF-named checkpoint tensors into a module whose q/k/v and gate/up projections are stacked.

Shared by the target and the draft heads: every parameter row must be covered exactly once, so a
missing or misnamed tensor fails at load instead of leaving uninitialised weights behind. Under
tensor parallelism the tensors are still the full checkpoint ones: a layer holding a shard
(`TPShard`) picks its rows or columns before the copy, so every rank reads the same files.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from specserve.model.parallel import TPShard

# Checkpoint projection -> the stacked module that holds it.
STACKED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def load_stacked_weights(
    module: nn.Module, tensors: Mapping[str, torch.Tensor], optional: Iterable[str] = ()
) -> None:
    """Copy `tensors` in, casting to each parameter's dtype. Parameters named in `optional` may be
    absent (shared with another module, e.g. a tied lm_head); any other gap raises ValueError."""
    params = dict(module.named_parameters())
    filled: dict[str, int] = dict.fromkeys(params, 0)
    with torch.no_grad():
        for name, full in tensors.items():
            target, rows, owner, shard = _destination(module, name, params)
            tensor = _local_part(name, owner, shard, full)
            if target.shape[1:] != tensor.shape[1:] or target[rows].shape[0] != tensor.shape[0]:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not fit the model")
            target[rows].copy_(tensor.to(target.dtype))
            filled[stacked_name(name)] += tensor.shape[0]
    skip = set(optional)
    missing = [n for n, p in params.items() if filled[n] != p.shape[0] and n not in skip]
    if missing:
        raise ValueError(f"checkpoint lacks tensors for: {missing[:5]}")


def stacked_name(name: str) -> str:
    """The parameter holding checkpoint tensor `name` (q_proj -> qkv_proj, ...)."""
    for shard, stacked in STACKED.items():
        if f".{shard}." in name:
            return name.replace(f".{shard}.", f".{stacked}.")
    return name


def _local_part(name: str, owner: nn.Module, shard: str | None, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name` (all of it unless its layer is TP-sharded)."""
    if not isinstance(owner, TPShard):
        return full
    try:
        return owner.take_shard(shard, full)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


def _destination(
    module: nn.Module, name: str, params: dict[str, nn.Parameter]
) -> tuple[nn.Parameter, slice, nn.Module, str | None]:
    """(parameter, its rows that tensor `name` fills, the module owning it, the stacked shard or None)."""
    param_name = stacked_name(name)
    if param_name not in params:
        raise ValueError(f"checkpoint has a tensor the model does not: {name}")
    owner = module.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else module
    if param_name == name:
        return params[name], slice(None), owner, None
    shard = next(s for s in STACKED if f".{s}." in name)
    return params[param_name], owner.shard_rows(shard), owner, shard
