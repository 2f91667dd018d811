"""The shape of a decoder, read from an HF ``config.json`` or GGUF metadata: the Llama family, and
Bamba's hybrid (Mamba-2 layers between attention layers, `docs/hybrid-models.md`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import gguf


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind`` is ``default``, ``linear`` or ``llama3``."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class MambaShape:
    """A Mamba-2 mixer (Bamba's ``mamba_*`` keys): `num_heads` heads of `head_dim` channels, each
    with a [head_dim, state_size] recurrent state; B and C shared by groups of heads; a depthwise
    causal convolution of width `conv_kernel` over x, B and C."""

    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False
    chunk_size: int = 256  # tokens a prefill scans at once (the quadratic block of the SSD form)
    time_step_min: float = 0.0
    time_step_max: float = float("inf")

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, B and C."""
        return self.inner_size + 2 * self.num_groups * self.state_size


@dataclass(frozen=True)
class ModelArch:
    """Everything the forward pass needs to know about a checkpoint (Llama family, or Bamba's hybrid)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 puts a bias on q/k/v
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Hybrid models: the layers that attend (the others are Mamba-2 mixers of shape `mamba`).
    attention_layers: tuple[int, ...] | None = None
    mamba: MambaShape | None = None
    rotary_dim: int | None = None  # leading head dims RoPE rotates (None: all of them)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers keep a recurrent state instead of KV (`specserve/model/bamba.py`)."""
        return self.mamba is not None

    @property
    def kv_layers(self) -> int:
        """Layers with a KV cache: the attention layers."""
        return self.num_layers if self.attention_layers is None else len(self.attention_layers)

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        """Layers with a recurrent state (none in a plain decoder)."""
        if self.mamba is None:
            return ()
        attends = set(self.attention_layers or ())
        return tuple(i for i in range(self.num_layers) if i not in attends)


# --- HF config.json -------------------------------------------------------------------------------

SUPPORTED_HF_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "BambaForCausalLM",
)
_HF_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "bamba": "BambaForCausalLM",
}


def arch_from_hf_config(cfg: dict, architecture: str | None = None) -> ModelArch:
    """Parse an HF ``config.json`` (transformers 4.x or 5.x layout) of a supported decoder.

    `architecture` overrides the config's own (draft heads name theirs ``LlamaForCausalLMEagle3``
    and the like, but their decoder layers are Llama layers)."""
    name = architecture or _hf_architecture(cfg)
    _refuse_unsupported_features(name, cfg)
    if name == "BambaForCausalLM":
        return _bamba_arch(cfg)
    return _decoder_arch(name, cfg)


def _decoder_arch(name: str, cfg: dict) -> ModelArch:
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    rope_theta, rope_scaling = _hf_rope(cfg)
    return ModelArch(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        rms_norm_eps=cfg.get("rms_norm_eps") or 1e-6,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position=cfg.get("max_position_embeddings") or 4096,
        # Llama/Qwen2/Mistral configs all default to untied when the key is absent.
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2's q/k/v always carry a bias; its config has no key saying so.
        attention_bias=name == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
    )


def _bamba_arch(cfg: dict) -> ModelArch:
    """Bamba (ibm-ai-platform/Bamba-9B and its HF port): Llama attention with half the head dims
    rotated at `attn_layer_indices`, a Mamba-2 mixer at each remaining layer, a SwiGLU MLP after each."""
    name = "BambaForCausalLM"
    if cfg.get("attention_bias"):
        raise ValueError(f"{name}: attention_bias=True is not supported")
    base = _decoder_arch(name, cfg)
    hidden, layers = base.hidden_size, base.num_layers
    attends = tuple(sorted(set(cfg.get("attn_layer_indices") or ())))
    if any(not 0 <= i < layers for i in attends):
        raise ValueError(f"{name}: attn_layer_indices {list(attends)} outside the {layers} layers")
    if not attends:  # the KV pool is sized per attention layer
        raise ValueError(
            f"{name}: attn_layer_indices is empty; models without attention layers are not supported"
        )
    heads = cfg.get("mamba_n_heads") or 128
    inner = (cfg.get("mamba_expand") or 2) * hidden
    head_dim = cfg.get("mamba_d_head")
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    if heads * head_dim != inner:
        raise ValueError(f"{name}: mamba_n_heads * mamba_d_head must equal mamba_expand * hidden_size")
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    mamba = MambaShape(
        num_heads=heads,
        head_dim=head_dim,
        num_groups=cfg.get("mamba_n_groups") or 1,
        state_size=cfg.get("mamba_d_state") or 256,
        conv_kernel=cfg.get("mamba_d_conv") or 4,
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        chunk_size=cfg.get("mamba_chunk_size") or 256,
        time_step_min=_as_float(limit[0]),
        time_step_max=_as_float(limit[1]),
    )
    if heads % mamba.num_groups:
        raise ValueError(f"{name}: mamba_n_heads must be a multiple of mamba_n_groups")
    # Bamba rotates half of each head (transformers hard-codes partial_rotary_factor 0.5; the
    # original checkpoints write `attn_rotary_emb`, the rotated dims).
    params = cfg.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 0.5
    rotary = cfg.get("attn_rotary_emb") or int(base.head_dim * factor)
    return replace(base, attention_layers=attends, mamba=mamba, rotary_dim=rotary)


def _as_float(value) -> float:
    """A float from config.json, where transformers 5 writes infinity as {"__float__": "Infinity"}."""
    if isinstance(value, dict):
        value = value.get("__float__")
    return float(value)


def _hf_architecture(cfg: dict) -> str:
    names = cfg.get("architectures") or [_HF_ARCH_BY_MODEL_TYPE.get(cfg.get("model_type", ""), "")]
    name = names[0] or f"model_type={cfg.get('model_type')!r}"
    if name not in SUPPORTED_HF_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {name!r}; supported: {', '.join(SUPPORTED_HF_ARCHITECTURES)}"
        )
    return name


def _refuse_unsupported_features(name: str, cfg: dict) -> None:
    """Fail loudly on config switches the forward pass would otherwise silently ignore."""
    if (cfg.get("hidden_act") or "silu") != "silu":
        raise ValueError(f"{name}: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{name}: mlp_bias=True is not supported")
    if _uses_sliding_window(name, cfg):
        raise ValueError(f"{name}: sliding-window attention (sliding_window={cfg.get('sliding_window')})")


def _uses_sliding_window(name: str, cfg: dict) -> bool:
    if "sliding_attention" in (cfg.get("layer_types") or ()):
        return True
    window = cfg.get("sliding_window")
    if name == "Qwen2ForCausalLM":
        # Qwen2 configs carry a window size even when use_sliding_window is off.
        return bool(cfg.get("use_sliding_window")) and window is not None
    # Mistral applies its window whenever set; one covering the whole context changes nothing.
    return window is not None and window < (cfg.get("max_position_embeddings") or 4096)


def _hf_rope(cfg: dict) -> tuple[float, RopeScaling]:
    # transformers 5 writes `rope_parameters` (theta included) next to explicit null `rope_theta`
    # and `rope_scaling`; 4.x writes `rope_theta` + `rope_scaling`. Hence `or`, not get defaults.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return theta, RopeScaling()
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
        )
    raise ValueError(f"unsupported rope type {kind!r}; supported: default, linear, llama3")


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


# --- GGUF metadata --------------------------------------------------------------------------------

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")


def arch_from_gguf(reader: gguf.GGUFReader) -> ModelArch:
    """Parse the metadata of a llama.cpp ``llama`` or ``qwen2`` GGUF."""
    meta = _GgufMeta(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    tensors = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ValueError("GGUF stores per-frequency rope factors (rope_freqs.weight); not supported")
    hidden = meta.need(f"{arch}.embedding_length")
    heads = meta.need(f"{arch}.attention.head_count")
    head_dim = meta.get(f"{arch}.attention.key_length") or hidden // heads
    rotary_dim = meta.get(f"{arch}.rope.dimension_count") or head_dim
    if rotary_dim != head_dim:
        raise ValueError(f"partial rotary embeddings ({rotary_dim} of {head_dim} dims) are not supported")
    vocab = meta.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = (meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id"))
    return ModelArch(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=meta.need(f"{arch}.feed_forward_length"),
        num_layers=meta.need(f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=meta.get(f"{arch}.attention.head_count_kv") or heads,
        head_dim=head_dim,
        rms_norm_eps=meta.get(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-5,
        rope_theta=meta.get(f"{arch}.rope.freq_base") or 10000.0,
        rope_scaling=_gguf_rope_scaling(meta, arch),
        max_position=meta.get(f"{arch}.context_length") or 4096,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        # llama.cpp stops on eot too (Llama-3's <|eot_id|>), so treat it as an end token.
        eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
    )


def _gguf_rope_scaling(meta: _GgufMeta, arch: str) -> RopeScaling:
    kind = meta.get(f"{arch}.rope.scaling.type") or "none"
    if kind == "none":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(meta.need(f"{arch}.rope.scaling.factor")))
    raise ValueError(f"unsupported rope type {kind!r} in GGUF; supported: none, linear")


class _GgufMeta:
    """Scalar/string lookups over a GGUFReader's key-value fields."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self._fields = reader.fields

    def get(self, key: str):
        field = self._fields.get(key)
        return None if field is None else field.contents()

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return value
