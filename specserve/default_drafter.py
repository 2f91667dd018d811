"""What `speculative="default"` means for a model: the draft head trained for it and shipped inside
this package when there is one (`specserve/heads/<asset name>/`, made by `specserve train-draft`,
docs/draft-training.md), else n-gram prompt lookup, which needs no weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specserve.assets import ALIASES, ASSETS

HEADS_DIR = Path(__file__).parent / "heads"
NGRAM_DEFAULT: dict[str, Any] = {"method": "ngram", "num_steps": 4}
HEAD_NUM_STEPS = 5  # chain length the shipped heads were measured with (MT-Bench, docs/draft-training.md)


def shipped_head(model: str | None) -> Path | None:
    """The head folder shipped for `model` (an asset name or alias), if its files are present."""
    name = ALIASES.get(model or "", model)
    if name not in ASSETS:  # heads ship for named models only, never for a path
        return None
    folder = HEADS_DIR / name
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    return None


def default_speculative(model: str | None) -> dict[str, Any]:
    """The speculative settings `"default"` stands for with target `model`."""
    from specserve.model.head_checkpoint import head_method

    folder = shipped_head(model)
    if folder is None:
        return dict(NGRAM_DEFAULT)
    config = json.loads((folder / "config.json").read_text())
    shipped = config.get("specserve") or {}
    spec = {"method": head_method(config), "num_steps": shipped.get("num_steps", HEAD_NUM_STEPS)}
    spec["draft_model"] = str(folder)
    # A head sharing the target's lm_head may ship with a cut draft vocabulary as its default
    # (`"specserve": {"draft_vocab": N}`, the N its GPU measurement chose; docs/speculative.md).
    if shipped.get("draft_vocab") is not None:
        spec["draft_vocab"] = shipped["draft_vocab"]
    return spec
