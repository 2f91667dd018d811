"""Issue 9's targets over `specserve bench offline` reports (scripts/adaptive_gpu.sh writes them):
per batch size, adaptive speculation against the best static configuration (target >= 0.97x) and
against plain decoding (at batch 64, target >= 0.95x); on the mixed workload, adaptive against every
static configuration at each batch size (target: above all of them). Prints a table per report and
exits 1 when a target is missed. On the mixed workload it also prints the looser reading of "beats
every static configuration": one static configuration run over every batch size against adaptive
over the same (the geometric mean of the per-batch ratios), which the exit status does not use.

    python scripts/adaptive_targets.py OUT/adaptive-mt-bench.json OUT/adaptive-mixed.json
"""

import json
import math
import sys
from pathlib import Path

PLAIN = "specserve"


def is_adaptive(system: str) -> bool:
    """A bench system of adaptive speculation (`-adaptive`, or `-adaptive-SETTINGS` for a variant)."""
    return system.endswith("-adaptive") or "-adaptive-" in system


def check(report: dict) -> tuple[list[str], bool]:
    rows: dict[str, dict[int, float]] = {}
    repeats: dict[tuple[str, int], list[float]] = {}
    for row in report["rows"]:
        rows.setdefault(row["system"], {})[row["batch_size"]] = row["tokens_per_s"]
        repeats[row["system"], row["batch_size"]] = row.get("repeat_seconds") or []
    adaptive = [s for s in rows if is_adaptive(s)]
    static = [s for s in rows if s.startswith(PLAIN) and s not in adaptive]  # plain included
    mixed = "mixed" in str(report.get("dataset", ""))
    lines, ok = [], True
    for name in adaptive:
        for batch, tps in sorted(rows[name].items()):
            best = max(static, key=lambda s: rows[s].get(batch, 0.0))
            ratio, plain = tps / rows[best][batch], tps / rows[PLAIN][batch]
            passed = ratio >= 0.97 and (batch != 64 or plain >= 0.95) and (not mixed or ratio > 1.0)
            ok &= passed
            rounds = " ".join(f"{r:.3f}" for r in per_round(repeats, name, static, batch))
            lines.append(
                f"{name} batch {batch}: {tps:,.0f} tok/s = {ratio:.3f}x best static ({best}), "
                f"{plain:.3f}x plain  {'ok' if passed else 'MISSED'}"
                + (f"  (by round: {rounds})" if rounds else "")
            )
        if mixed:
            lines.append(_over_the_workload(name, rows[name], {s: rows[s] for s in static}))
    return lines, ok


def per_round(
    repeats: dict[tuple[str, int], list[float]], name: str, static: list[str], batch: int
) -> list[float]:
    """Adaptive against the fastest static configuration of each round (the bench times every system
    once a round, so the systems of one round share the machine's spell): how far the rows' ratio
    is from noise. Empty where a system has no repeats of its own."""
    own = repeats.get((name, batch), [])
    others = [repeats.get((s, batch), []) for s in static]
    if not own or any(len(times) != len(own) for times in others):
        return []
    return [min(times[i] for times in others) / seconds for i, seconds in enumerate(own)]


def _over_the_workload(name: str, adaptive: dict[int, float], static: dict[str, dict[int, float]]) -> str:
    """Adaptive against each static configuration over the batch sizes both ran: the geometric mean
    of the per-batch ratios; the least of them, and against which."""
    means = {}
    for system, by_batch in static.items():
        ratios = [tps / by_batch[b] for b, tps in adaptive.items() if by_batch.get(b)]
        if ratios:
            means[system] = math.prod(ratios) ** (1 / len(ratios))
    if not means:
        return f"{name} over the workload: no static configuration ran its batch sizes"
    worst = min(means, key=means.get)
    return (
        f"{name} over the workload (geometric mean over batch sizes): {means[worst]:.3f}x the closest "
        f"static configuration ({worst}); {'beats' if means[worst] > 1 else 'does not beat'} every one"
    )


def _plain_spread(report: dict) -> str:
    """How far plain decoding's repeats lie apart at each batch size (`repeat_seconds`): a ratio past
    a few percent says a slow spell of the machine caught one repeat (the rows keep the faster)."""
    cells = []
    for row in report["rows"]:
        times = row.get("repeat_seconds") or []
        if row["system"] == PLAIN and len(times) > 1:
            cells.append(f"b{row['batch_size']} {max(times) / min(times):.3f}")
    return " ".join(cells)


def main(paths: list[str]) -> int:
    ok = True
    for path in paths:
        report = json.loads(Path(path).read_text())
        lines, passed = check(report)
        ok &= passed
        print(f"{path} ({report.get('dataset')}, {report.get('gpu') or report.get('device')}):")
        print("\n".join(f"  {line}" for line in lines) or "  no adaptive system in this report")
        spread = _plain_spread(report)
        if spread:
            print(f"  plain decoding's repeats, slowest over fastest, by batch: {spread}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
