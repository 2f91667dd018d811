"""Seeded random tiny Llama-3 / Qwen2 HF folders for tests (a helper module, not a test file).

Weights use a larger init std than HF's default so logits are spread out (no near-ties that flip
greedy choices between implementations), and norm weights and biases are randomised too: HF
initialises them to ones/zeros, which would hide a mixed-up norm or a dropped bias.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

SEED = 1234
INIT_STD = 0.1
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _shape(tokenizer: PreTrainedTokenizerBase, vocab_size: int | None = None) -> dict:
    return dict(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=INIT_STD,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def save_tiny_llama3(
    path: str | Path, tokenizer: PreTrainedTokenizerBase, vocab_size: int | None = None
) -> Path:
    """3 layers, GQA 4/2, llama3 rope scaling, theta 500000, untied lm_head. A `vocab_size` below the
    tokenizer's makes a small-vocabulary target (prompts as ids), where random drafts get accepted."""
    config = LlamaConfig(
        **_shape(tokenizer, vocab_size),
        num_hidden_layers=3,
        rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_ROPE),
        tie_word_embeddings=False,
    )
    return _save(LlamaForCausalLM, config, path, tokenizer)


def save_tiny_qwen2(
    path: str | Path, tokenizer: PreTrainedTokenizerBase, vocab_size: int | None = None, **shape
) -> Path:
    """2 layers, GQA 4/2, q/k/v bias (always on in Qwen2), tied embeddings. `shape` overrides config
    fields (e.g. 6 query / 3 KV heads for an uneven tensor-parallel split)."""
    config = Qwen2Config(
        **{**_shape(tokenizer, vocab_size), **shape}, num_hidden_layers=2, tie_word_embeddings=True
    )
    return _save(Qwen2ForCausalLM, config, path, tokenizer)


def _save(model_cls, config, path: str | Path, tokenizer: PreTrainedTokenizerBase) -> Path:
    path = Path(path)
    torch.manual_seed(SEED)
    model = model_cls(config).eval()
    _randomise_norms_and_biases(model)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[config.eos_token_id],  # a list, as Llama-3 checkpoints write it
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@torch.no_grad()
def _randomise_norms_and_biases(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(SEED + 1)
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.copy_(INIT_STD * torch.randn(param.shape, generator=gen))
        elif "norm" in name:
            param.copy_(1.0 + INIT_STD * torch.randn(param.shape, generator=gen))


def save_tiny_bamba(
    path: str | Path, tokenizer: PreTrainedTokenizerBase, vocab_size: int | None = None, **shape
) -> Path:
    """A hybrid: 4 layers, attention at 1 and 3 (GQA 4/2, half of each head rotated), Mamba-2 at 0
    and 2 (8 heads of 16 channels in 2 groups, state 16, convolution width 4) and a small scan block
    (8 rows), so prompts span several blocks. `shape` overrides config fields."""
    from transformers import BambaConfig, BambaForCausalLM

    config = BambaConfig(
        **{
            **_shape(tokenizer, vocab_size),
            "num_hidden_layers": 4,
            "attn_layer_indices": [1, 3],
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_n_groups": 2,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_chunk_size": 8,
            "tie_word_embeddings": False,
            **shape,
        }
    )
    path = _save(BambaForCausalLM, config, path, tokenizer)
    return path
