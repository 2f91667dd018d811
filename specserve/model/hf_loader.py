"""Read a Hugging Face checkpoint folder (config.json + safetensors, single or sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from specserve.model.arch import ModelArch, arch_from_hf_config

SHARD_INDEX = "model.safetensors.index.json"
# A draft head's token ranking (specserve/model/head_checkpoint.py): beside its weights, none of them.
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def load_hf_folder(path: str | Path) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    """The architecture and tensors of an HF folder; tensors keep their stored dtype."""
    folder = Path(path)
    return arch_from_hf_config(read_hf_config(folder)), load_safetensors_folder(folder)


def read_hf_config(folder: Path) -> dict:
    config = folder / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{folder} is not an HF checkpoint folder: no config.json")
    return json.loads(config.read_text())


def load_safetensors_folder(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder's safetensors files (shards listed by the index, else every file)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        tensors.update(load_file(file))
    return tensors


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / SHARD_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(f for f in folder.glob("*.safetensors") if f.name != DRAFT_VOCAB_FILE)
    if files:
        return files
    if any(folder.glob("*.bin")):
        raise ValueError(
            f"{folder} holds only PyTorch .bin weights; convert them to safetensors "
            "(pickled .bin files can run code on load, so they are not read)"
        )
    raise FileNotFoundError(f"no *.safetensors files in {folder}")
