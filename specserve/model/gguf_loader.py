"""Read a llama.cpp GGUF into float32 tensors under Hugging Face parameter names."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from gguf.quants import dequantize

from specserve.model.arch import ModelArch
from specserve.model.gguf_header import read_header

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_gguf(path: str | Path) -> tuple[ModelArch, dict[str, torch.Tensor]]:
    """Dequantise every tensor of a GGUF to float32, named and laid out as in HF transformers (the
    header parsed once per file, `gguf_header`)."""
    header = read_header(path)
    arch = header.arch
    # Only llama.cpp's llama converter interleaves q/k rows for its rope; qwen2's does not.
    permuted = header.architecture == "llama"
    file = np.memmap(path, mode="r")
    tensors = {}
    for t in header.tensors:
        name = hf_name(t.name)
        weight = torch.from_numpy(_to_float32(dequantize(t.data(file), t.tensor_type)))
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = unpermute_rope_rows(weight, arch.num_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = unpermute_rope_rows(weight, arch.num_kv_heads)
        tensors[name] = weight
    return arch, tensors


def hf_name(gguf_name: str) -> str:
    """The HF parameter name of a GGUF tensor; ValueError for one we have no place for."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m[2] not in _BLOCK_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{m[1]}.{_BLOCK_NAMES[m[2]]}.{m[3]}"


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rope) to get HF's rotate-half order.

    The converter viewed rows as (n_head, 2, head_dim/2) and swapped the last two axes.
    """
    return w.reshape(n_head, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _to_float32(a: np.ndarray) -> np.ndarray:
    # Unquantised tensors come back as read-only views of the memory map; torch wants its own copy.
    return a.astype(np.float32, copy=not a.flags.writeable or a.dtype != np.float32)
