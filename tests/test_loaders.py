"""Checkpoint loaders: HF folders, GGUF (against transformers' own GGUF reader) and tokenizers."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from specserve.model import gguf_header
from specserve.model import tokenizer as tokenizer_module
from specserve.model.arch import ModelArch, RopeScaling, arch_from_hf_config
from specserve.model.checkpoint import load_checkpoint
from specserve.model.gguf_header import parse_header, read_header
from specserve.model.gguf_loader import hf_name, unpermute_rope_rows
from specserve.model.hf_loader import load_hf_folder
from specserve.model.tokenizer import eos_token_ids, load_tokenizer

from tiny_models import save_tiny_llama3, save_tiny_qwen2

SAMPLES = [
    "Hello world!",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    "  leading spaces, tabs\tand unicode: héllo 🤖 日本語",
    "def f(x):\n    return x ** 2\n",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
]


# --- fixtures: each expensive thing once per module -----------------------------------------------


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm2_gguf: Path):
    """The reference: transformers converting the GGUF's tokenizer directly (~10 s)."""
    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def tiny_llama3(tmp_path_factory, gguf_tokenizer) -> Path:
    return save_tiny_llama3(tmp_path_factory.mktemp("tiny_llama3"), gguf_tokenizer)


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory, gguf_tokenizer) -> Path:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"), gguf_tokenizer)


@pytest.fixture(scope="module")
def ours_gguf(smollm2_gguf: Path):
    return load_checkpoint(smollm2_gguf)


@pytest.fixture(scope="module")
def reference_gguf_state(smollm2_gguf: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.state_dict()


def _hf_state(folder: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()


def _assert_same_tensors(ours, reference, tied: bool) -> None:
    reference = dict(reference)
    if tied:  # transformers lists the tied lm_head; the checkpoint (rightly) does not store it
        reference.pop("lm_head.weight")
    assert set(ours) == set(reference)
    for name, tensor in reference.items():
        assert ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name], tensor), name


# --- HF folders -----------------------------------------------------------------------------------


def test_tiny_llama3_arch(tiny_llama3: Path, gguf_tokenizer):
    arch, _ = load_hf_folder(tiny_llama3)
    assert arch == ModelArch(
        vocab_size=len(gguf_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64),
        max_position=512,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=gguf_tokenizer.bos_token_id,
        eos_token_ids=(gguf_tokenizer.eos_token_id,),
    )


def test_tiny_qwen2_arch(tiny_qwen2: Path):
    arch, tensors = load_hf_folder(tiny_qwen2)
    assert arch.attention_bias and arch.tie_word_embeddings
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (2, 4, 2, 16)
    assert arch.rope_scaling == RopeScaling() and arch.rope_theta == 10000.0
    assert "model.layers.0.self_attn.q_proj.bias" in tensors
    assert "lm_head.weight" not in tensors


@pytest.mark.parametrize("which", ["tiny_llama3", "tiny_qwen2"])
def test_hf_tensors_equal_state_dict(which: str, request):
    folder = request.getfixturevalue(which)
    arch, tensors = load_hf_folder(folder)
    _assert_same_tensors(tensors, _hf_state(folder), tied=arch.tie_word_embeddings)


def test_sharded_safetensors(tiny_llama3: Path, tmp_path: Path):
    model = LlamaForCausalLM.from_pretrained(tiny_llama3, dtype=torch.float32)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="1MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    arch, tensors = load_hf_folder(tmp_path)
    assert arch == load_hf_folder(tiny_llama3)[0]
    _assert_same_tensors(tensors, model.state_dict(), tied=False)


def test_stored_dtype_is_kept(tiny_qwen2: Path, tmp_path: Path):
    (tmp_path / "config.json").write_text((tiny_qwen2 / "config.json").read_text())
    half = {k: v.to(torch.bfloat16) for k, v in load_hf_folder(tiny_qwen2)[1].items()}
    save_file(half, tmp_path / "model.safetensors")
    assert {t.dtype for t in load_hf_folder(tmp_path)[1].values()} == {torch.bfloat16}


def test_missing_config_is_a_clear_error(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_folder(tmp_path)


def test_bin_only_folder_is_refused(tiny_llama3: Path, tmp_path: Path):
    (tmp_path / "config.json").write_text((tiny_llama3 / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"\.bin.*safetensors"):
        load_hf_folder(tmp_path)


def test_unknown_architecture_names_it_and_the_supported_ones(tiny_llama3: Path, tmp_path: Path):
    config = json.loads((tiny_llama3 / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        load_checkpoint(tmp_path)


# --- config parsing: transformers 4.x layouts and refusals ----------------------------------------

BASE = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=32,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
)


def test_v4_rope_layouts():
    linear = arch_from_hf_config(BASE | {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2}})
    assert (linear.rope_theta, linear.rope_scaling) == (5e5, RopeScaling("linear", 2.0))
    llama3 = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    arch = arch_from_hf_config(BASE | {"rope_theta": 5e5, "rope_scaling": llama3})
    assert arch.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    assert arch_from_hf_config(BASE).rope_scaling == RopeScaling()


def test_defaults_and_eos_lists():
    arch = arch_from_hf_config(BASE | {"eos_token_id": [7, 9], "head_dim": None})
    assert arch.eos_token_ids == (7, 9)
    assert (arch.num_kv_heads, arch.head_dim, arch.tie_word_embeddings) == (4, 16, False)
    assert arch_from_hf_config(BASE | {"eos_token_id": 3}).eos_token_ids == (3,)


def test_unsupported_rope_type_is_named():
    with pytest.raises(ValueError, match="yarn"):
        arch_from_hf_config(BASE | {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}})


def test_sliding_window():
    mistral = BASE | {"architectures": ["MistralForCausalLM"], "max_position_embeddings": 32768}
    with pytest.raises(ValueError, match="sliding"):
        arch_from_hf_config(mistral | {"sliding_window": 4096})
    assert arch_from_hf_config(mistral | {"sliding_window": None}).attention_bias is False
    qwen2 = BASE | {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}
    assert arch_from_hf_config(qwen2 | {"use_sliding_window": False}).attention_bias is True
    with pytest.raises(ValueError, match="sliding"):
        arch_from_hf_config(qwen2 | {"use_sliding_window": True})


# --- GGUF -----------------------------------------------------------------------------------------


def test_unpermute_inverts_llama_cpp_permute():
    n_head, head_dim, cols = 3, 8, 5
    w = torch.randn(n_head * head_dim, cols)
    # llama.cpp convert_hf_to_gguf.py's LlamaModel.permute
    permuted = w.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_rope_rows(permuted, n_head), w)


def test_unknown_gguf_tensor_is_refused():
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="rope_freqs"):
        hf_name("rope_freqs.weight")


@pytest.mark.slow
def test_gguf_arch(ours_gguf):
    assert ours_gguf.format == "gguf"
    arch = ours_gguf.arch
    assert (arch.num_layers, arch.hidden_size, arch.intermediate_size) == (30, 576, 1536)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.vocab_size) == (9, 3, 64, 49152)
    assert arch.rope_theta == 100000.0 and arch.rope_scaling == RopeScaling()
    assert arch.tie_word_embeddings and not arch.attention_bias
    assert (arch.bos_token_id, arch.eos_token_ids, arch.max_position) == (1, (2,), 8192)
    assert arch.rms_norm_eps == pytest.approx(1e-5)


def test_a_gguf_header_is_parsed_once_per_file(smollm2_gguf: Path, tmp_path, monkeypatch):
    """The loader's header (shape, converter, each tensor's type, layout and offset) comes from
    `gguf.GGUFReader` once per file, then from the cache: equal to a fresh parse, its tensor views
    equal to the reader's; a damaged entry is parsed afresh, and a changed file gets its own."""
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    parses = []
    original = gguf_header.parse_header
    monkeypatch.setattr(gguf_header, "parse_header", lambda p: parses.append(p) or original(p))
    reference = parse_header(smollm2_gguf)
    assert read_header(smollm2_gguf) == reference and len(parses) == 1
    assert read_header(smollm2_gguf) == reference and len(parses) == 1  # from the entry
    (entry,) = (tmp_path / "gguf-headers").iterdir()
    file = np.memmap(smollm2_gguf, mode="r")
    reader = gguf.GGUFReader(smollm2_gguf)
    for span, tensor in zip(reference.tensors, reader.tensors, strict=True):
        assert span.name == tensor.name and span.tensor_type == tensor.tensor_type
        assert np.array_equal(span.data(file), tensor.data)
    entry.write_text("{")
    assert read_header(smollm2_gguf) == reference and len(parses) == 2
    assert json.loads(entry.read_text())["format"] == gguf_header.FORMAT
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(smollm2_gguf, copy)
    assert read_header(copy) == reference and len(parses) == 3
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert read_header(copy) == reference and len(parses) == 4
    assert len(list((tmp_path / "gguf-headers").iterdir())) == 3


@pytest.mark.slow
def test_gguf_tensors_equal_transformers_gguf_loading(ours_gguf, reference_gguf_state):
    assert {t.dtype for t in ours_gguf.tensors.values()} == {torch.float32}
    _assert_same_tensors(ours_gguf.tensors, reference_gguf_state, tied=True)


# --- tokenizers -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_gguf_tokenizer_cache_round_trip(smollm2_gguf: Path, gguf_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    converted = load_tokenizer(smollm2_gguf)
    entries = list((tmp_path / "tokenizers").iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith(".")  # no temp dir left behind

    def converted_again(*_):
        raise AssertionError("the cached conversion was not used")

    monkeypatch.setattr(tokenizer_module, "_convert_gguf_tokenizer", converted_again)
    cached = load_tokenizer(smollm2_gguf)  # the point of the cache: no second conversion

    assert gguf_tokenizer.chat_template
    for tok in (converted, cached):
        assert tok.chat_template == gguf_tokenizer.chat_template
        assert [tok.encode(s) for s in SAMPLES] == [gguf_tokenizer.encode(s) for s in SAMPLES]
        assert tok.apply_chat_template(
            CHAT, add_generation_prompt=True
        ) == gguf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
        assert (tok.eos_token_id, tok.bos_token_id, len(tok)) == (
            gguf_tokenizer.eos_token_id,
            gguf_tokenizer.bos_token_id,
            len(gguf_tokenizer),
        )


def test_hf_folder_tokenizer(tiny_llama3: Path, gguf_tokenizer):
    tok = load_tokenizer(tiny_llama3)
    assert tok.chat_template == gguf_tokenizer.chat_template
    assert tok.encode(SAMPLES[1]) == gguf_tokenizer.encode(SAMPLES[1])


def test_eos_token_ids_union(tiny_llama3: Path, gguf_tokenizer, tmp_path: Path):
    arch = load_hf_folder(tiny_llama3)[0]
    eos = gguf_tokenizer.eos_token_id
    assert eos_token_ids(gguf_tokenizer, arch, tiny_llama3) == (eos,)
    assert eos_token_ids(gguf_tokenizer, arch) == (eos,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 0, 5]}))
    assert eos_token_ids(gguf_tokenizer, arch, tmp_path) == (eos, 0, 5)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_token_ids(gguf_tokenizer, arch, tmp_path) == (eos, 7)
