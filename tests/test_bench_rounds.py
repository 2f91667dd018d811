"""scripts/bench_rounds.py: each bench repeat beside the host's figures and the GPU's logged clocks."""

from __future__ import annotations

import calendar
import importlib.util
import sys
import time
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "bench_rounds", Path(__file__).parents[1] / "scripts" / "bench_rounds.py"
)
rounds = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_rounds"] = rounds  # its dataclasses look their module up
_SPEC.loader.exec_module(rounds)

T0 = calendar.timegm(time.strptime("2026/11/30 02:00:00", "%Y/%m/%d %H:%M:%S"))


def _host(start: float, cpu: float, steal: float, **gc: float) -> dict:
    return {"started_at": start, "cpu_seconds": cpu, "idle_seconds": 14.0, "steal_seconds": steal, **gc}


def _clock_log(path: Path) -> None:
    """Samples every half second for 8 s: the clock drops to 1200 MHz (reason 0x4) in [4, 6)."""
    lines = ["timestamp, clocks.sm [MHz], clocks.mem [MHz], power.draw [W], temperature.gpu, utilization.gpu"]
    for i in range(16):
        at = T0 + i / 2
        stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.gmtime(at)) + (".500" if i % 2 else ".000")
        slow = 4 <= i / 2 < 6
        lines.append(
            f"{stamp}, {1200 if slow else 1980}, 3201, {300 if slow else 450}, 40, 90, {'0x4' if slow else '0x0'}"
        )
    lines.append("2026/11/30 02:00:09.000, [N/A], 3201, 450, 40, 90, 0x0")  # unreadable: skipped
    path.write_text("\n".join(lines) + "\n")


def test_a_slow_repeat_is_set_beside_the_clocks_and_the_host_of_its_span(tmp_path):
    log = tmp_path / "gpu_clocks.csv"
    _clock_log(log)
    clocks = rounds.read_clocks(log)
    assert len(clocks) == 16 and clocks[0].at == T0 and clocks[1].at == T0 + 0.5
    report = {
        "rows": [
            {
                "system": "plain",
                "batch_size": 64,
                "repeat_seconds": [1.5, 2.0],  # the second repeat runs while the clock is down
                "repeat_host": [_host(T0 + 1, 1.5, 0.0), _host(T0 + 4, 2.0, 0.0, gc_seconds=0.25, gc_full=1)],
            },
            {
                "system": "chain",
                "batch_size": 64,
                "repeat_seconds": [1.8, 1.2],  # the first one lost its CPU to other guests
                "repeat_host": [_host(T0 + 2.5, 1.2, 0.6), _host(T0 + 6.5, 1.2, 0.0)],
            },
            {"system": "chain", "batch_size": 1, "repeat_seconds": [0.1]},  # no host figures: dashes
        ]
    }
    lines = rounds.round_rows(report, 64, clocks)
    by = {(line[1], line[2]): line for line in lines}
    assert [line[2] for line in lines] == ["plain", "chain", "plain", "chain"]  # round by round
    assert by["2", "plain"][4] == "1.333" and by["2", "plain"][10:] == [
        "1356",
        "1200",
        "330",
        "0x4",
    ]  # 4 samples slow, 1 not
    assert by["1", "plain"][10:] == ["1980", "1980", "450", "0x0"]
    # CPU over wall, stolen ms, idle CPUs; no collector figures in a bench from before them
    assert by["1", "chain"][4:10] == ["1.500", "0.67", "600", "7.8", "-", "-"]
    assert by["2", "plain"][8:10] == ["250.0", "1"]  # ms in the collector, full collections
    everything = rounds.round_rows(report, None, clocks)
    assert everything[0][:3] == ["1", "1", "chain"] and everything[0][5:] == ["-"] * 9


def test_an_adaptive_rows_repeats_show_the_steps_each_tier_ran():
    """A bench with adaptive rows gets a last column: each repeat's engine steps per tier, most first
    (a slow repeat: did the policy hold another tier there?); rows without them get a dash."""
    report = {
        "rows": [
            {"system": "plain", "batch_size": 64, "repeat_seconds": [1.4, 1.4]},
            {
                "system": "adaptive",
                "batch_size": 64,
                "repeat_seconds": [1.25, 1.6],
                "repeat_tier_steps": [{"1": 125, "2": 5}, {"off": 90, "1": 30}],
            },
        ]
    }
    assert rounds.has_tiers(report)
    lines = rounds.round_rows(report, 64, [])
    assert [line[-1] for line in lines] == ["-", "1:125 2:5", "-", "off:90 1:30"]
    assert not rounds.has_tiers({"rows": report["rows"][:1]})
    assert len(rounds.round_rows({"rows": report["rows"][:1]}, 64, [])[0]) == len(rounds.HEADER)
