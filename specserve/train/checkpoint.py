"""A training run's state on disk: resumable snapshots, and the head folder the drafters load.

`OUT/training/state.pt` holds everything a resumed run needs (head and optimizer state, the data
position, elapsed time, the recipe it was started with, the draft vocabulary); it is written to a
temporary file and renamed, so a run killed mid-write leaves the previous snapshot. `OUT/config.json`
and `OUT/model.safetensors` are the head in the published key layout (`head_checkpoint.py`): the
folder is what `--speculative METHOD --draft-model OUT` loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.model.arch import ModelArch
from specserve.model.draft_heads import DraftHead
from specserve.model.head_checkpoint import head_checkpoint, quantize_rows, save_head

STATE = Path("training") / "state.pt"
LOG = Path("training") / "log.jsonl"


@dataclass(frozen=True)
class Progress:
    """Where a run is: optimizer steps taken, the data position, and time and tokens spent."""

    step: int = 0
    epoch: int = 0
    batch: int = 0  # next batch index within the epoch
    seconds: float = 0.0
    tokens: int = 0


def save_state(
    out: Path,
    head: DraftHead,
    optimizer: torch.optim.Optimizer,
    progress: Progress,
    recipe: dict,
    draft_ids: torch.Tensor | None,
) -> None:
    path = out / STATE
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "head": {n: t.detach().cpu() for n, t in head.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "progress": dataclasses.asdict(progress),
        "recipe": recipe,
        "draft_ids": None if draft_ids is None else draft_ids.cpu(),
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_state(out: Path, device: torch.device) -> dict | None:
    """The last snapshot under `out`, or None when there is none."""
    path = out / STATE
    if not path.is_file():
        return None
    state = torch.load(path, map_location=device, weights_only=True)
    state["progress"] = Progress(**state["progress"])
    return state


def restore(head: DraftHead, optimizer: torch.optim.Optimizer, state: dict) -> Progress:
    head.load_state_dict(state["head"])
    optimizer.load_state_dict(state["optimizer"])
    return state["progress"]


def check_resumable(state: dict, recipe: dict) -> None:
    """A snapshot continues only the run that made it: the head's shape and the data must agree."""
    shape_keys = ("method", "num_modules", "layers_per_module", "intermediate_size", "draft_vocab", "target")
    differ = [k for k in shape_keys if state["recipe"].get(k) != recipe.get(k)]
    if differ:
        raise ValueError(
            f"resume: the snapshot in training/state.pt was made with other {', '.join(differ)}; "
            "use another --out or --no-resume"
        )


def export_head(
    out: Path,
    head: DraftHead,
    target: ModelArch,
    draft_ids: torch.Tensor | None,
    dtype: torch.dtype,
    recipe: dict,
) -> Path:
    """Write the head folder (config.json + model.safetensors, tensors in `dtype`; torch.int8: its
    matrices as int8 rows with their scales, the rest bf16, `quantize_rows`); the recipe goes
    into config.json under `specserve`, which loaders ignore."""
    int8 = dtype == torch.int8
    config, tensors = head_checkpoint(head, target, draft_ids, torch.bfloat16 if int8 else dtype)
    config["torch_dtype"] = "bfloat16" if int8 else str(dtype).removeprefix("torch.")
    config["specserve"] = {"method": head.spec.method, "recipe": recipe}
    if int8:
        tensors = quantize_rows(tensors)
        config["specserve"]["weights"] = "int8 rows (NAME + _row_scale), dequantised at load"
    return save_head(out, config, tensors)


def append_log(out: Path, record: dict) -> None:
    path = out / LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
