"""Draft heads from HF-format folders, in the key layouts published EAGLE / EAGLE-3 / MTP
checkpoints use (the table is in docs/speculative.md); seeded random heads in the same layout.

The head's shape is read from its config.json and from which tensors it stores (an fc bias, its own
embedding or lm_head), so a published folder loads as it is. q/k/v and gate/up are stored as separate
projections and stacked at load.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from specserve.model.arch import ModelArch, arch_from_hf_config
from specserve.model.draft_heads import HEAD_METHODS, DraftHead, HeadSpec
from specserve.model.hf_loader import (
    DRAFT_VOCAB_FILE,
    SHARD_INDEX,
    load_safetensors_folder,
    read_hf_config,
    safetensors_files,
)
from specserve.model.layers import RotaryEmbedding, StackedLinear
from specserve.model.llama import LlamaForCausalLM
from specserve.model.weights import load_stacked_weights

_ARCHITECTURES = {
    "eagle": "LlamaForCausalLMEagle",
    "eagle3": "LlamaForCausalLMEagle3",
    "mtp": "LlamaForCausalLM",
}


def head_method(config: dict) -> str:
    """The method of a head folder's config.json: what `specserve train-draft` recorded, else its
    architecture (an MTP layer is a plain Llama layer with `num_nextn_predict_layers`)."""
    recorded = (config.get("specserve") or {}).get("method")
    if recorded in HEAD_METHODS:
        return recorded
    if config.get("num_nextn_predict_layers"):
        return "mtp"
    by_arch = {arch: method for method, arch in _ARCHITECTURES.items() if method != "mtp"}
    for arch in config.get("architectures") or []:
        if arch in by_arch:
            return by_arch[arch]
    raise ValueError(
        f"speculative.draft_model: cannot tell the head's method from {config.get('architectures')}"
    )


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high target layers, as EAGLE-3 training recipes pick them."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4))


def load_head(
    folder: str | Path,
    method: str,
    target: LlamaForCausalLM,
    device: torch.device,
    dtype: torch.dtype,
    vocab: tuple[nn.Module, nn.Module] | None = None,
    draft_vocab: int | None = None,
) -> DraftHead:
    """The head in `folder`, on `device` in `dtype`, bound to `target`'s embedding and lm_head, or to
    `vocab` = (embed_tokens, lm_head) when given (whole copies of a TP-sharded target's). With
    `draft_vocab` N it drafts over the N ids its folder's ranking puts first (`draft_vocab_ids`)."""
    folder = Path(folder)
    _check_head_folder(folder, method)
    cfg = read_hf_config(folder)
    stored = dequantize_rows(load_safetensors_folder(folder))
    spec = head_spec(method, cfg, set(stored), target.arch)
    tensors, d2t = _param_tensors(spec, cfg, stored)
    embed_tokens, lm_head = vocab or (target.model.embed_tokens, target.lm_head)
    if draft_vocab is not None:
        spec, d2t = _cut_vocabulary(spec, tensors, draft_vocab_ids(folder, method, draft_vocab), lm_head)
    with torch.device("meta"):
        head = DraftHead(spec, target.arch.hidden_size)
    head = head.to_empty(device=device).to(dtype)
    try:
        load_stacked_weights(head, tensors)
    except ValueError as err:
        raise ValueError(f"speculative.draft_model: {folder}: {err}") from None
    head.rope = RotaryEmbedding(spec.arch).to(device)
    if d2t is not None:
        head.draft_to_target = (d2t.long() + torch.arange(d2t.shape[0])).to(device)
    head.bind(embed_tokens, lm_head)
    return head.eval()


def _check_head_folder(folder: Path, method: str) -> None:
    if method not in HEAD_METHODS:
        raise ValueError(f"speculative.method: {method!r} has no draft head (one of {list(HEAD_METHODS)})")
    if not folder.is_dir():
        raise ValueError(f"speculative.draft_model: {method} needs an HF folder with its head, not {folder}")


def head_spec(method: str, cfg: dict, names: set[str], target: ModelArch) -> HeadSpec:
    """Read the head's shape from its config and which tensors it stores; check it fits the target."""
    arch = arch_from_hf_config({**cfg, "vocab_size": target.vocab_size}, architecture="LlamaForCausalLM")
    plain = {n.removeprefix("model.") for n in names}
    if method == "eagle":
        spec = HeadSpec(
            method,
            arch,
            layers_per_module=arch.num_layers,
            fc_bias="fc.bias" in plain,
            own_embedding="embed_tokens.weight" in plain,
            own_lm_head="lm_head.weight" in plain,
        )
    elif method == "eagle3":
        spec = _eagle3_spec(cfg, plain, arch, target)
    else:
        spec = _mtp_spec(cfg, names, arch)
    _check_fits(spec, cfg, target)
    num_layers = spec.num_attention_layers
    max_position = max(arch.max_position, target.max_position)
    return _replace_arch(spec, num_layers=num_layers, max_position=max_position)


def _eagle3_spec(cfg: dict, plain: set[str], arch: ModelArch, target: ModelArch) -> HeadSpec:
    deeper = {int(n.split(".")[1]) for n in plain if re.match(r"layers\.\d+\.", n)}
    if deeper != set(range(1, arch.num_layers)):
        raise ValueError(
            f"speculative.draft_model: an EAGLE-3 head of num_hidden_layers {arch.num_layers} stores "
            f"midlayer.* and layers.1.* to layers.{arch.num_layers - 1}.*, not layers {sorted(deeper)}"
        )
    eagle_cfg = cfg.get("eagle_config") or {}
    aux = eagle_cfg.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(target.num_layers)
    if any(not 0 <= i < target.num_layers for i in aux):
        raise ValueError(f"speculative.draft_model: aux layer ids {list(aux)} outside the target's layers")
    draft_vocab = cfg.get("draft_vocab_size") or target.vocab_size
    own_head = "lm_head.weight" in plain
    if draft_vocab != target.vocab_size and not (own_head and "d2t" in plain):
        raise ValueError("speculative.draft_model: a reduced draft vocabulary needs lm_head.weight and d2t")
    return HeadSpec(
        "eagle3",
        arch,
        layers_per_module=arch.num_layers,
        draft_vocab_size=draft_vocab if draft_vocab != target.vocab_size else None,
        aux_layers=tuple(int(i) for i in aux),
        fc_bias="fc.bias" in plain,
        own_embedding="embed_tokens.weight" in plain,
        own_lm_head=own_head,
    )


def _mtp_spec(cfg: dict, names: set[str], arch: ModelArch) -> HeadSpec:
    k = cfg.get("num_nextn_predict_layers")
    if not isinstance(k, int) or k < 1:
        raise ValueError("speculative.draft_model: an MTP config needs num_nextn_predict_layers >= 1")
    first = arch.num_layers
    heads = [f"model.layers.{first + i}.shared_head.head.weight" in names for i in range(k)]
    embeds = f"model.layers.{first}.embed_tokens.weight" in names
    return HeadSpec("mtp", arch, num_modules=k, own_embedding=embeds, own_lm_head=all(heads))


def _check_fits(spec: HeadSpec, cfg: dict, target: ModelArch) -> None:
    if spec.arch.hidden_size != target.hidden_size:
        raise ValueError(
            f"speculative.draft_model: the head's hidden size ({spec.arch.hidden_size}) differs from the "
            f"target's ({target.hidden_size})"
        )
    if cfg.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise ValueError(
            f"speculative.draft_model: the head's vocabulary ({cfg['vocab_size']}) differs from the "
            f"target's ({target.vocab_size})"
        )


def _replace_arch(spec: HeadSpec, **changes) -> HeadSpec:
    return replace(spec, arch=replace(spec.arch, **changes))


def _param_tensors(
    spec: HeadSpec, cfg: dict, stored: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Checkpoint names -> DraftHead parameter names (and EAGLE-3's d2t offsets)."""
    tensors: dict[str, torch.Tensor] = {}
    d2t = None
    for name, tensor in stored.items():
        if spec.method == "mtp":
            param = _mtp_param_name(name, cfg["num_hidden_layers"], spec.num_modules)
        else:
            plain = name.removeprefix("model.")
            if plain == "d2t":
                d2t = tensor
                continue
            param = None if plain == "t2d" else _plain_param_name(plain, spec.method)
        if param is not None:
            tensors[param] = tensor
    return tensors, d2t


def _plain_param_name(name: str, method: str) -> str:
    if name.startswith(("embed_tokens.", "lm_head.")):
        return name
    return f"step_modules.0.{_shift_eagle3_layer(name, -1) if method == 'eagle3' else name}"


def _shift_eagle3_layer(name: str, by: int) -> str:
    """An EAGLE-3 head's further layers are `layers.1.*` on in a checkpoint (its `midlayer` is layer 0,
    as deeper EAGLE-3 checkpoints number them) and `layers.0.*` on in the module."""
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    return name if match is None else f"layers.{int(match[1]) + by}.{match[2]}"


def _mtp_param_name(name: str, first: int, k: int) -> str | None:
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if match is None or not first <= int(match[1]) < first + k:
        return None  # the target's own tensors, when the folder is the whole model
    i, rest = int(match[1]) - first, match[2]
    if rest.startswith("embed_tokens."):
        return rest if i == 0 else None  # every MTP layer stores the same embedding
    return f"step_modules.{i}.{rest}"


# ---- a draft vocabulary cut from the target's lm_head at load -----------------------------------


def draft_vocab_ids(folder: str | Path, method: str, size: int) -> torch.Tensor:
    """The draft vocabulary `speculative.draft_vocab` = `size` gives the head in `folder`: the `size`
    ids its token ranking (`DRAFT_VOCAB_FILE`) puts first, ascending as trained reduced heads store
    them. A ValueError naming the setting where the head cannot take one: not EAGLE-3, no ranking,
    or an lm_head of its own (trained over its own vocabulary, not the target's rows)."""
    name = "speculative.draft_vocab"
    if method != "eagle3":
        raise ValueError(f"{name}: only EAGLE-3 heads draft over a cut vocabulary, not {method!r}")
    folder = Path(folder)
    _check_head_folder(folder, method)
    cfg = read_hf_config(folder)
    reduced = cfg.get("draft_vocab_size", cfg.get("vocab_size")) != cfg.get("vocab_size")
    if reduced or "lm_head.weight" in _stored_names(folder):
        raise ValueError(f"{name}: {folder} has an lm_head of its own; the cut is of the target's lm_head")
    ranked = read_ranking(folder)
    if ranked is None:
        raise ValueError(
            f"{name}: {folder} has no token ranking ({DRAFT_VOCAB_FILE}: scripts/rank_draft_vocab.py)"
        )
    ranking, _ = ranked
    if not 1 <= size <= len(ranking):
        raise ValueError(f"{name}: must be in [1, {len(ranking)}] (the ids {folder.name}'s ranking holds)")
    return ranking[:size].sort().values


def _cut_vocabulary(
    spec: HeadSpec, tensors: dict[str, torch.Tensor], ids: torch.Tensor, lm_head: nn.Module
) -> tuple[HeadSpec, torch.Tensor]:
    """A spec with its own lm_head over `ids`, whose weight (the target's rows) joins `tensors`, and
    the d2t offsets of those ids: from there on the head is a trained reduced one to every path."""
    weight = lm_head.weight.detach()
    tensors["lm_head.weight"] = weight[ids.to(weight.device)]
    spec = replace(spec, draft_vocab_size=len(ids), own_lm_head=True)
    return spec, ids - torch.arange(len(ids))


def save_ranking(path: str | Path, ranking: torch.Tensor, metadata: dict[str, str]) -> Path:
    """A token ranking file: target ids, most frequent first, and where they were counted."""
    path = Path(path)
    save_file({"ranking": ranking.to(torch.int32).contiguous()}, path, metadata=metadata)
    return path


def read_ranking(folder: str | Path) -> tuple[torch.Tensor, dict[str, str]] | None:
    """(the ranking as int64 ids, its metadata) of a head folder, None when it has none."""
    file = Path(folder) / DRAFT_VOCAB_FILE
    if not file.is_file():
        return None
    with safe_open(file, "pt") as f:
        return f.get_tensor("ranking").long(), f.metadata() or {}


def _stored_names(folder: Path) -> set[str]:
    """The head's tensor names without the `model.` prefix, from the files' headers alone."""
    names: set[str] = set()
    for file in safetensors_files(folder):
        with safe_open(file, "pt") as f:
            keys = f.keys()  # a safe_open handle is not iterable itself
        names.update(k.removeprefix("model.") for k in keys if not k.endswith(ROW_SCALE))
    return names


# ---- new heads: seeded random ones (tests) and the trainer's starting point ---------------------


def new_head_spec(
    method: str,
    target: ModelArch,
    *,
    num_modules: int = 1,
    layers_per_module: int = 1,
    draft_vocab_size: int | None = None,
    intermediate_size: int | None = None,
    aux_layers: tuple[int, ...] | None = None,
) -> HeadSpec:
    """The shape of a new head that fits `target`: its decoder layers are the target's (MLP width
    `intermediate_size` when given); a `draft_vocab_size` below the target's gives it its own
    reduced lm_head (EAGLE-3), otherwise it shares the target's. An EAGLE-3 head fuses the residual
    streams of `aux_layers` (default: EAGLE-3's low, middle and high layers)."""
    if method not in HEAD_METHODS:
        raise ValueError(f"method: {method!r} is not a draft head (one of {list(HEAD_METHODS)})")
    reduced = draft_vocab_size is not None and draft_vocab_size < target.vocab_size
    if reduced and method != "eagle3":
        raise ValueError("draft_vocab_size: only EAGLE-3 heads have a reduced vocabulary")
    arch = _head_arch(method, target, layers_per_module, num_modules)
    if intermediate_size is not None:
        arch = replace(arch, intermediate_size=intermediate_size)
    return HeadSpec(
        method,
        arch,
        num_modules=num_modules if method == "mtp" else 1,
        layers_per_module=layers_per_module if method in ("eagle", "eagle3") else 1,
        draft_vocab_size=draft_vocab_size if reduced else None,
        aux_layers=_aux_layers(method, target, aux_layers),
        fc_bias=method == "eagle",
        own_lm_head=reduced,
    )


def _aux_layers(method: str, target: ModelArch, chosen: tuple[int, ...] | None) -> tuple[int, ...]:
    if method != "eagle3":
        if chosen:
            raise ValueError("aux_layers: only EAGLE-3 heads fuse target layers")
        return ()
    if chosen is None:
        return default_aux_layers(target.num_layers)
    if not chosen or not all(0 <= i < target.num_layers for i in chosen):
        raise ValueError(f"aux_layers: {chosen} must be layer ids in 0..{target.num_layers - 1}")
    return tuple(chosen)


def random_head(
    method: str,
    target: ModelArch,
    *,
    seed: int = 0,
    num_modules: int = 1,
    layers_per_module: int = 1,
    draft_vocab_size: int | None = None,
    init_std: float = 0.1,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, tensors in checkpoint names) of a head with seeded random weights that fits
    `target`. Norm weights are randomised around 1 too, so a mixed-up norm cannot hide."""
    gen = torch.Generator().manual_seed(seed)
    spec = new_head_spec(
        method,
        target,
        num_modules=num_modules,
        layers_per_module=layers_per_module,
        draft_vocab_size=draft_vocab_size,
    )
    head = DraftHead(spec, target.hidden_size)
    with torch.no_grad():
        for name, param in head.named_parameters():
            noise = torch.randn(param.shape, generator=gen) * init_std
            param.copy_(1.0 + noise if "norm" in name else noise)
    ids = None
    if spec.draft_vocab_size is not None:
        ids = torch.randperm(target.vocab_size, generator=gen)[: spec.draft_vocab_size].sort().values
    return head_checkpoint(head, target, ids)


def head_checkpoint(
    head: DraftHead,
    target: ModelArch,
    draft_ids: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, tensors in checkpoint names) of `head`, on the CPU, floating-point tensors in
    `dtype` when given. A reduced vocabulary needs `draft_ids`, the target id of each draft id
    (ascending), stored as EAGLE-3's d2t offsets and t2d mask."""
    tensors = _checkpoint_tensors(head, target.num_layers)
    if dtype is not None:
        tensors = {n: t.to(dtype) if t.is_floating_point() else t for n, t in tensors.items()}
    tensors = {n: t.cpu() for n, t in tensors.items()}
    size = head.spec.draft_vocab_size
    if size is not None:
        if draft_ids is None or draft_ids.shape != (size,):
            raise ValueError(f"draft_ids: a reduced vocabulary of {size} needs {size} target ids")
        ids = draft_ids.cpu().long()
        tensors["d2t"] = ids - torch.arange(size)
        tensors["t2d"] = torch.zeros(target.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    return _head_config(head.spec, target, head.spec.num_modules), tensors


# A matrix stored as int8 rows carries its per-row scales under this suffix (`quantize_rows`).
ROW_SCALE = "_row_scale"


def quantize_rows(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every floating-point matrix as int8 rows (symmetric, one fp32 scale a row: its largest
    magnitude / 127) plus `NAME_row_scale`: half the bytes of bf16; vectors (norms) stay as they are.
    A shipped head must fit 12 MB; this is how a wider one does. The error (a row's step is 1/254 of
    its range) only moves drafts, never what verify emits, which stays the target's."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not t.is_floating_point() or t.dim() != 2:
            out[name] = t
            continue
        rows = t.float()
        scale = rows.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        out[name] = torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8)
        out[name + ROW_SCALE] = scale
    return out


def dequantize_rows(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`quantize_rows` undone (fp32 matrices); tensors stored as floats pass through."""
    out = {n: t for n, t in tensors.items() if not n.endswith(ROW_SCALE)}
    for name, scale in tensors.items():
        if not name.endswith(ROW_SCALE):
            continue
        base = name.removesuffix(ROW_SCALE)
        q = out.get(base)
        if q is None or q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise ValueError(f"{base}: an int8 matrix of {tuple(scale.shape)[0]} rows must go with {name}")
        out[base] = q.float() * scale.float()[:, None]
    return out


def save_head(
    folder: str | Path, config: dict, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None = None
) -> Path:
    """A head folder: config.json and model.safetensors, or, with `max_shard_bytes`, shards of at
    most that size (a tensor bigger than it gets one of its own) and HF's index of them (how a
    head ships inside the package: no file of the repository over 5 MB)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {n: t.contiguous() for n, t in tensors.items()}
    if max_shard_bytes is None:
        save_file(tensors, folder / "model.safetensors")
        return folder
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        if (
            shards[-1]
            and sum(x.numel() * x.element_size() for x in shards[-1].values()) + size > max_shard_bytes
        ):
            shards.append({})
        shards[-1][name] = t
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / file)
        weight_map.update(dict.fromkeys(shard, file))
    (folder / SHARD_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return folder


def _head_arch(method: str, target: ModelArch, layers: int, modules: int) -> ModelArch:
    count = {"eagle": layers, "eagle3": layers, "mtp": modules}[method]
    # A head's layers are Llama layers whatever the target (a hybrid's recurrent layout stays behind).
    plain = dict(attention_layers=None, mamba=None, rotary_dim=None)
    return replace(target, num_layers=count, tie_word_embeddings=False, attention_bias=False, **plain)


def _checkpoint_tensors(head: DraftHead, target_layers: int) -> dict[str, torch.Tensor]:
    """The head's parameters under checkpoint names, stacked projections split back into shards."""
    out: dict[str, torch.Tensor] = {}
    for name, param in head.named_parameters():
        owner_name, leaf = name.rsplit(".", 1)
        owner = head.get_submodule(owner_name)
        if isinstance(owner, StackedLinear):
            for shard in owner.shards:
                shard_name = f"{owner_name.rsplit('.', 1)[0]}.{shard}.{leaf}"
                out[_checkpoint_name(head.spec, shard_name, target_layers)] = param[owner.shard_rows(shard)]
        else:
            out[_checkpoint_name(head.spec, name, target_layers)] = param.detach()
    return {n: t.detach().clone() for n, t in out.items()}


def _checkpoint_name(spec: HeadSpec, param: str, target_layers: int) -> str:
    if spec.method == "eagle3":
        return _shift_eagle3_layer(param.removeprefix("step_modules.0."), 1)
    if spec.method != "mtp":
        return param.removeprefix("step_modules.0.")
    if param.startswith("embed_tokens."):
        return f"model.layers.{target_layers}.{param}"
    i, rest = param.removeprefix("step_modules.").split(".", 1)
    return f"model.layers.{target_layers + int(i)}.{rest}"


def _head_config(spec: HeadSpec, target: ModelArch, num_modules: int) -> dict:
    arch = spec.arch
    config = {
        "architectures": [_ARCHITECTURES[spec.method]],
        "model_type": "llama",
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": _rope_scaling_config(arch),
        "max_position_embeddings": arch.max_position,
        "vocab_size": target.vocab_size,
        "hidden_act": "silu",
        "num_hidden_layers": arch.num_layers,
    }
    if spec.method == "eagle3":
        config["draft_vocab_size"] = spec.vocab_out
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(spec.aux_layers)}
    if spec.method == "mtp":
        config["num_hidden_layers"] = target.num_layers
        config["num_nextn_predict_layers"] = num_modules
    return config


def _rope_scaling_config(arch: ModelArch) -> dict | None:
    s = arch.rope_scaling
    if s.kind == "default":
        return None
    if s.kind == "linear":
        return {"rope_type": "linear", "factor": s.factor}
    return {
        "rope_type": "llama3",
        "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_position,
    }
