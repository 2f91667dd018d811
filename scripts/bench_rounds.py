"""Why a bench repeat was slow: every repeat of every system, round by round, beside what the host
and the GPU did meanwhile.

`specserve bench offline` runs its repeats in rounds over the systems and keeps, per repeat, its
seconds and the host's figures (`repeat_host`: the process's CPU seconds, the machine's idle and
stolen seconds; `specserve/bench_host.py`). With `--clocks`, a log of the GPU's clocks taken
meanwhile (what `scripts/adaptive_gpu.sh` writes to `gpu_clocks.csv`: `nvidia-smi
--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,
clocks_event_reasons.active --format=csv,noheader,nounits -lms 500`, timestamps in UTC), each repeat
also gets the SM clock's mean and least, the power's mean and the clock-event reasons seen (a
bitmask, 0: none) over its span. A repeat `slow` (its time over the system's fastest at that batch
size) that stole CPU, or ran at a lower clock, names its cause; one where nothing moved points at
the engine itself. An adaptive row's repeats also show the engine steps each tier ran (`tiers`): a
slow one, whether the policy held another tier there.

    python scripts/bench_rounds.py BENCH.json [BENCH.json ...] [--clocks gpu_clocks.csv] [--batch 64]
"""

from __future__ import annotations

import argparse
import calendar
import json
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ClockSample:
    at: float  # Unix seconds
    sm_mhz: float
    power_w: float
    reasons: int


def read_clocks(path: Path) -> list[ClockSample]:
    """The log's samples in time order; lines that do not parse (a header, an `[N/A]`) are skipped."""
    samples = []
    for line in path.read_text().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 7:
            continue
        try:
            stamp, fraction = fields[0].split(".") if "." in fields[0] else (fields[0], "0")
            at = calendar.timegm(time.strptime(stamp, "%Y/%m/%d %H:%M:%S")) + float(f"0.{fraction}")
            samples.append(ClockSample(at, float(fields[1]), float(fields[3]), int(fields[6], 16)))
        except ValueError:
            continue
    return sorted(samples, key=lambda s: s.at)


def clock_columns(samples: list[ClockSample], start: float, seconds: float) -> list[str]:
    """SM MHz mean / least, power W mean, reasons seen, over [start, start + seconds]."""
    inside = [s for s in samples if start <= s.at <= start + seconds]
    if not inside:
        return ["-", "-", "-", "-"]
    reasons = 0
    for s in inside:
        reasons |= s.reasons
    mean = sum(s.sm_mhz for s in inside) / len(inside)
    power = sum(s.power_w for s in inside) / len(inside)
    return [f"{mean:.0f}", f"{min(s.sm_mhz for s in inside):.0f}", f"{power:.0f}", f"{reasons:#x}"]


def host_columns(host: dict | None, seconds: float) -> list[str]:
    """CPU seconds over the wall (the process's threads), stolen ms, idle CPUs on average, ms in the
    garbage collector and its full collections (dashes for a bench from before they were kept)."""
    if not host:
        return ["-"] * 5
    steal, idle, gc_seconds = host.get("steal_seconds"), host.get("idle_seconds"), host.get("gc_seconds")
    return [
        f"{host['cpu_seconds'] / seconds:.2f}",
        "-" if steal is None else f"{steal * 1e3:.0f}",
        "-" if idle is None else f"{idle / seconds:.1f}",
        "-" if gc_seconds is None else f"{gc_seconds * 1e3:.1f}",
        str(host.get("gc_full", "-")),
    ]


def round_rows(report: dict, batch: int | None, clocks: list[ClockSample]) -> list[list[str]]:
    """One line per (batch size, round, system), in the order run; with adaptive rows' tier steps
    per repeat, those last."""
    lines = []
    tiered = has_tiers(report)
    rows = [
        r for r in report["rows"] if r.get("repeat_seconds") and (batch is None or r["batch_size"] == batch)
    ]
    for size in sorted({r["batch_size"] for r in rows}):
        at_size = [r for r in rows if r["batch_size"] == size]
        for k in range(max(len(r["repeat_seconds"]) for r in at_size)):
            for row in at_size:
                if k >= len(row["repeat_seconds"]):
                    continue
                seconds = row["repeat_seconds"][k]
                hosts = row.get("repeat_host") or []
                host = hosts[k] if k < len(hosts) else None
                line = [str(size), str(k + 1), row["system"], f"{seconds:.3f}"]
                line.append(f"{seconds / min(row['repeat_seconds']):.3f}")
                line += host_columns(host, seconds)
                if clocks:
                    line += clock_columns(clocks, host["started_at"], seconds) if host else ["-"] * 4
                if tiered:
                    line.append(tier_column(row.get("repeat_tier_steps"), k))
                lines.append(line)
    return lines


def has_tiers(report: dict) -> bool:
    """Whether any row kept its repeats' engine steps per adaptive tier (`repeat_tier_steps`)."""
    return any(r.get("repeat_tier_steps") for r in report["rows"])


def tier_column(repeats: list | None, k: int) -> str:
    """Repeat `k`'s engine steps per tier, most first ("1:125 off:12"), or a dash."""
    steps = repeats[k] if repeats and k < len(repeats) else None
    if not steps:
        return "-"
    return " ".join(f"{name}:{n}" for name, n in sorted(steps.items(), key=lambda kv: -kv[1]))


HEADER = [
    "batch",
    "round",
    "system",
    "s",
    "x fastest",
    "cpu/wall",
    "steal ms",
    "idle cpus",
    "gc ms",
    "gc full",
]
CLOCK_HEADER = ["SM MHz", "SM min", "W", "reasons"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--clocks", type=Path, help="the GPU's clock log taken meanwhile")
    parser.add_argument("--batch", type=int, help="one batch size only")
    args = parser.parse_args()
    clocks = read_clocks(args.clocks) if args.clocks and args.clocks.exists() else []
    header = HEADER + (CLOCK_HEADER if clocks else [])
    for path in args.reports:
        report = json.loads(path.read_text())
        print(f"{path} ({report.get('dataset')}, {report.get('gpu') or report.get('device')}):")
        columns = header + (["tiers"] if has_tiers(report) else [])
        lines = [columns, *round_rows(report, args.batch, clocks)]
        widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
        for line in lines:
            print("  " + "  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)))


if __name__ == "__main__":
    main()
