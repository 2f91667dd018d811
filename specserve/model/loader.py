"""From a model name (asset, GGUF file or HF folder) to a ready model and its tokenizer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from specserve.assets import ModelLocation, ModelNotFound, resolve_model
from specserve.model.arch import ModelArch
from specserve.model.bamba import BambaForCausalLM
from specserve.model.checkpoint import load_checkpoint
from specserve.model.llama import LlamaForCausalLM
from specserve.model.parallel import NO_TP, TPInfo
from specserve.model.tokenizer import eos_token_ids, load_tokenizer


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM | BambaForCausalLM
    arch: ModelArch
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: tuple[int, ...]
    location: ModelLocation
    # (embed_tokens, lm_head) whole, beside a vocab-sharded TP model: what a draft head on rank 0 binds.
    full_vocab: tuple[nn.Embedding, nn.Linear] | None = None


def load_model(
    name_or_path: str,
    device: torch.device,
    dtype: torch.dtype,
    tp: TPInfo = NO_TP,
    full_vocab: bool = False,
    field: str = "model",
) -> LoadedModel:
    """This rank's shard of the model (the whole model at TP size 1); with `full_vocab` and TP, also
    whole copies of the embedding and lm_head, cut from the same checkpoint tensors. A name or path
    that is no loadable model is a ValueError naming `field` (the setting that gave it)."""
    try:
        location = resolve_model(name_or_path)
        checkpoint = load_checkpoint(location.path)
        tokenizer = load_tokenizer(location.path)
    except (ValueError, KeyError, OSError) as err:  # nothing there, a config lacking a setting, no tokenizer
        what = f"its config lacks {err}" if isinstance(err, KeyError) else str(err)
        raise ValueError(
            f"{field}: {what}" if isinstance(err, ModelNotFound) else f"{field}: {name_or_path!r}: {what}"
        ) from err
    model = build_model(checkpoint.arch, checkpoint.tensors, device, dtype, tp)
    vocab = None
    if full_vocab and tp.size > 1:
        vocab = build_full_vocab(checkpoint.arch, checkpoint.tensors, device, dtype)
    folder = location.path if location.kind == "hf" else None
    eos = eos_token_ids(tokenizer, checkpoint.arch, folder)
    return LoadedModel(model, checkpoint.arch, tokenizer, eos, location, vocab)


def build_model(
    arch: ModelArch, tensors, device: torch.device, dtype: torch.dtype, tp: TPInfo = NO_TP
) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = BambaForCausalLM(arch, tp) if arch.is_hybrid else LlamaForCausalLM(arch, tp)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    model.load_weights(tensors)
    # to_empty left the rope tables uninitialised; rebuild them (in fp32, whatever the compute dtype).
    model.rope = type(model.rope)(arch).to(device)
    return model.eval()


def build_full_vocab(
    arch: ModelArch, tensors: Mapping[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> tuple[nn.Embedding, nn.Linear]:
    """The unsharded embedding and lm_head (sharing one weight when the checkpoint ties them)."""
    embed_weight = tensors["model.embed_tokens.weight"].to(device, dtype)
    embed = nn.Embedding.from_pretrained(embed_weight, freeze=True)
    head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False, device="meta")
    tied = arch.tie_word_embeddings
    head_weight = embed_weight if tied else tensors["lm_head.weight"].to(device, dtype)
    head.weight = nn.Parameter(head_weight, requires_grad=False)
    return embed, head.eval()
