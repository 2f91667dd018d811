"""scripts/adaptive_targets.py: issue 9's verdict over bench reports, and each cell's ratio by round."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "adaptive_targets", Path(__file__).parents[1] / "scripts" / "adaptive_targets.py"
)
targets = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(targets)


def _row(system: str, batch: int, repeats: list[float]) -> dict:
    seconds = sorted(repeats)[(len(repeats) - 1) // 2]
    return {"system": system, "batch_size": batch, "tokens_per_s": 1000 / seconds, "repeat_seconds": repeats}


def test_each_round_sets_adaptive_against_that_round_s_fastest_static():
    """Round 1 was slow for the statics (a shape's first run), round 2 for adaptive: the rows' medians
    hide which; by round, adaptive is 1.25x, 0.8x and 1x the fastest static of its round."""
    report = {
        "dataset": "mt-bench",
        "rows": [
            _row("specserve", 64, [2.5, 1.0, 1.1]),
            _row("specserve-ngram-2", 64, [2.0, 0.8, 1.0]),
            _row("specserve-ngram-8-adaptive", 64, [1.6, 1.0, 1.0]),
        ],
    }
    lines, ok = targets.check(report)
    assert "(by round: 1.250 0.800 1.000)" in lines[0]
    assert "1.000x best static" in lines[0] and ok  # the medians: 1.0 s both
    static = ["specserve", "specserve-ngram-2"]
    repeats = {(r["system"], 64): r["repeat_seconds"] for r in report["rows"]}
    repeats["specserve", 64] = [1.0]  # rounds that do not line up: no ratio by round
    assert targets.per_round(repeats, "specserve-ngram-8-adaptive", static, 64) == []
