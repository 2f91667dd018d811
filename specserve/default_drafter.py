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
    num_steps = (config.get("specserve") or {}).get("num_steps", HEAD_NUM_STEPS)
    return {"method": head_method(config), "num_steps": num_steps, "draft_model": str(folder)}
