"""What every `specserve bench` report carries besides its figures, and how it is written and printed.

A figure without the exact command, the commit and the software it ran on cannot be reproduced or
compared, so each JSON report starts with `run_info`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def run_info(argv: Sequence[str]) -> dict[str, Any]:
    """The command line (as `specserve ...`), commit, time and versions of this run."""
    import torch

    return {
        "command": shlex.join(["specserve", *argv]),
        "commit": commit(),
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def commit() -> str | None:
    """`$SPECSERVE_COMMIT` (for installed copies without git), else the checkout's `git describe`
    (with `-dirty` when it has uncommitted changes), else None."""
    if env := os.environ.get("SPECSERVE_COMMIT"):
        return env
    try:
        done = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=12"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def write_json(path: str | Path, report: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned, two spaces apart."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        first, *rest = (str(c) for c in cells)
        parts = [first.ljust(widths[0])] + [c.rjust(w) for c, w in zip(rest, widths[1:], strict=True)]
        return "  ".join(parts).rstrip()

    return "\n".join([line(header), *(line(r) for r in rows)])
