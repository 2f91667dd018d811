"""From a model name (asset, GGUF file or HF folder) to a ready model and its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from specserve.assets import ModelLocation, resolve_model
from specserve.model.arch import ModelArch
from specserve.model.checkpoint import load_checkpoint
from specserve.model.llama import LlamaForCausalLM
from specserve.model.tokenizer import eos_token_ids, load_tokenizer


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    arch: ModelArch
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: tuple[int, ...]
    location: ModelLocation


def load_model(name_or_path: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    location = resolve_model(name_or_path)
    checkpoint = load_checkpoint(location.path)
    model = build_model(checkpoint.arch, checkpoint.tensors, device, dtype)
    tokenizer = load_tokenizer(location.path)
    folder = location.path if location.kind == "hf" else None
    eos = eos_token_ids(tokenizer, checkpoint.arch, folder)
    return LoadedModel(model, checkpoint.arch, tokenizer, eos, location)


def build_model(arch: ModelArch, tensors, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    model.load_weights(tensors)
    # to_empty left the rope tables uninitialised; rebuild them (in fp32, whatever the compute dtype).
    model.rope = type(model.rope)(arch).to(device)
    return model.eval()
