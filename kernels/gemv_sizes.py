"""Tuned GEMV sizes: the fastest block sizes a GPU sweep (`scripts/bench_gemv.py`) found per shape.

`fused_linear.gemv_blocks` picks sizes by rule; where a sweep timed the shape at this many rows (or
the fewest swept rows above it), the sweep's fastest sizes win. The table ships beside the kernels
(`gemv_sizes.json`, measured on an H100 at SmolLM2-135M's shapes); `SPECSERVE_GEMV_SIZES` names
another file (a sweep's `$OUT/gemv_sizes.json`) or `none` to use the rule alone. Sizes only change
speed: every size computes the same result (the tests hold each form to the reference).
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

SIZES_ENV = "SPECSERVE_GEMV_SIZES"
SHIPPED = Path(__file__).with_name("gemv_sizes.json")

# (rows, out_features, in_features) -> block sizes as `Blocks` fields (m, n, k, warps, all_rows)
Table = dict[tuple[int, int, int], dict]


def read_table(path: str | Path) -> Table:
    """A sizes file: {"sizes": [{"rows", "out_features", "in_features", "blocks": {...}}, ...]}."""
    entries = json.loads(Path(path).read_text())["sizes"]
    return {(e["rows"], e["out_features"], e["in_features"]): dict(e["blocks"]) for e in entries}


def write_table(path: str | Path, table: Table, about: dict) -> None:
    sizes = [
        {"rows": r, "out_features": n, "in_features": k, "blocks": blocks}
        for (r, n, k), blocks in sorted(table.items())
    ]
    Path(path).write_text(json.dumps({**about, "sizes": sizes}, indent=1) + "\n")


@cache
def tuned_table() -> Table:
    chosen = os.environ.get(SIZES_ENV, "")
    if chosen == "none":
        return {}
    path = Path(chosen) if chosen else SHIPPED
    return read_table(path) if path.is_file() else {}


def tuned_sizes(rows: int, out_features: int, in_features: int, table: Table | None = None) -> dict | None:
    """The swept sizes for this shape at the fewest swept rows from `rows` up to its next power of
    two (a row block that holds `rows`, swept at a like count), or None."""
    table = tuned_table() if table is None else table
    top = 1 << max(rows - 1, 0).bit_length()
    swept = sorted(r for r, n, k in table if (n, k) == (out_features, in_features) and rows <= r <= top)
    return table[(swept[0], out_features, in_features)] if swept else None
