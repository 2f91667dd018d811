"""Copy HF-named checkpoint tensors into a module whose q/k/v and gate/up projections are stacked.

Shared by the target and the draft heads: every parameter row must be covered exactly once, so a
missing or misnamed tensor fails at load instead of leaving uninitialised weights behind.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

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
        for name, tensor in tensors.items():
            target, rows = _destination(module, name, params)
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


def _destination(module: nn.Module, name: str, params: dict[str, nn.Parameter]) -> tuple[nn.Parameter, slice]:
    param_name = stacked_name(name)
    if param_name not in params:
        raise ValueError(f"checkpoint has a tensor the model does not: {name}")
    if param_name == name:
        return params[name], slice(None)
    owner = module.get_submodule(param_name.rsplit(".", 1)[0])
    shard = next(s for s in STACKED if f".{s}." in name)
    return params[param_name], owner.shard_rows(shard)
