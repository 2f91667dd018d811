"""The offline bench's PNG: output tokens/s against batch size, one line per system, log-x.

matplotlib is optional (the `bench` extra): without it the bench still writes its JSON and table and
says how to get the plot, rather than failing after minutes of measurement.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

Point = tuple[str, int, float]  # (system, batch size, tokens/s)


def plot_throughput(points: Sequence[Point], path: str | Path, title: str) -> bool:
    """Write the plot to `path`; False (with a note on stderr) when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(
            "specserve bench: matplotlib is not installed, skipping the plot "
            "(pip install 'specserve[bench]' to get it)",
            file=sys.stderr,
        )
        return False
    # A bare Figure (no pyplot): no global figure state and no GUI backend, just the Agg renderer.
    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    ax = fig.add_subplot()
    systems = list(dict.fromkeys(system for system, _, _ in points))  # first-seen order: legend order
    for system in systems:
        mine = sorted((b, tps) for s, b, tps in points if s == system)
        ax.plot([b for b, _ in mine], [t for _, t in mine], marker="o", label=system)
    batches = sorted({b for _, b, _ in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return True
