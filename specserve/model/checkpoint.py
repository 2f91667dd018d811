"""One entry point for any checkpoint: a ``.gguf`` file or an HF safetensors folder."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from specserve.model.arch import ModelArch
from specserve.model.gguf_loader import load_gguf
from specserve.model.hf_loader import load_hf_folder


@dataclass(frozen=True)
class Checkpoint:
    arch: ModelArch
    tensors: Mapping[str, torch.Tensor]
    path: Path
    format: Literal["gguf", "hf"]


def load_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    if path.is_dir():
        arch, tensors = load_hf_folder(path)
        return Checkpoint(arch, tensors, path, "hf")
    if path.is_file() and path.suffix == ".gguf":
        arch, tensors = load_gguf(path)
        return Checkpoint(arch, tensors, path, "gguf")
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    raise ValueError(f"{path} is neither a .gguf file nor an HF checkpoint folder")
