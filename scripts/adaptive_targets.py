"""Issue 9's targets over `specserve bench offline` reports (scripts/adaptive_gpu.sh writes them):
per batch size, adaptive speculation against the best static configuration (target >= 0.97x) and
against plain decoding (at batch 64, target >= 0.95x); on the mixed workload, adaptive against every
static configuration at each batch size (target: above all of them). Prints a table per report and
exits 1 when a target is missed.

    python scripts/adaptive_targets.py OUT/adaptive-mt-bench.json OUT/adaptive-mixed.json
"""

import json
import sys
from pathlib import Path

PLAIN = "specserve"


def check(report: dict) -> tuple[list[str], bool]:
    rows: dict[str, dict[int, float]] = {}
    for row in report["rows"]:
        rows.setdefault(row["system"], {})[row["batch_size"]] = row["tokens_per_s"]
    adaptive = [s for s in rows if s.endswith("-adaptive")]
    static = [s for s in rows if s.startswith(PLAIN) and s not in adaptive]  # plain included
    mixed = "mixed" in str(report.get("dataset", ""))
    lines, ok = [], True
    for name in adaptive:
        for batch, tps in sorted(rows[name].items()):
            best = max(static, key=lambda s: rows[s].get(batch, 0.0))
            ratio, plain = tps / rows[best][batch], tps / rows[PLAIN][batch]
            passed = ratio >= 0.97 and (batch != 64 or plain >= 0.95) and (not mixed or ratio > 1.0)
            ok &= passed
            lines.append(
                f"{name} batch {batch}: {tps:,.0f} tok/s = {ratio:.3f}x best static ({best}), "
                f"{plain:.3f}x plain  {'ok' if passed else 'MISSED'}"
            )
    return lines, ok


def main(paths: list[str]) -> int:
    ok = True
    for path in paths:
        report = json.loads(Path(path).read_text())
        lines, passed = check(report)
        ok &= passed
        print(f"{path} ({report.get('dataset')}, {report.get('gpu') or report.get('device')}):")
        print("\n".join(f"  {line}" for line in lines) or "  no adaptive system in this report")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
