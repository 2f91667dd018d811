"""The host figures beside each bench repeat: CPU, idle and stolen seconds over a run."""

from __future__ import annotations

import gc
import os

from specserve.bench_host import HostSample

TICK = os.sysconf("SC_CLK_TCK")


def _stat(path, idle: int, steal: int) -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice, then a CPU's own line
    path.write_text(f"cpu  500 0 200 {idle} 3 0 1 {steal} 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")


def test_a_run_spends_the_machines_idle_and_stolen_time_between_its_samples(tmp_path):
    stat = tmp_path / "stat"
    _stat(stat, idle=1000, steal=40)
    before = HostSample.now(stat)
    sum(range(200_000))  # some CPU time of this process
    _stat(stat, idle=1000 + 3 * TICK, steal=40 + TICK // 2)
    spent = before.until(HostSample.now(stat))
    assert spent["idle_seconds"] == 3.0 and spent["steal_seconds"] == round((TICK // 2) / TICK, 4)
    assert spent["cpu_seconds"] >= 0 and spent["started_at"] == round(before.wall, 3)


def test_no_machine_figures_where_the_stat_file_is_missing_or_foreign(tmp_path):
    missing = HostSample.now(tmp_path / "absent")
    assert missing.idle is None and missing.steal is None
    foreign = tmp_path / "stat"
    foreign.write_text("intr 1 2 3\n")
    spent = HostSample.now(foreign).until(HostSample.now(foreign))
    assert spent["idle_seconds"] is None and spent["steal_seconds"] is None and spent["cpu_seconds"] >= 0


def test_a_full_collection_between_samples_is_counted_and_timed(tmp_path):
    stat = tmp_path / "stat"
    _stat(stat, idle=1000, steal=40)
    before = HostSample.now(stat)
    garbage = [[i] for i in range(50_000)]
    del garbage
    gc.collect()  # a full collection, generation 2
    spent = before.until(HostSample.now(stat))
    assert spent["gc_full"] >= 1 and spent["gc_seconds"] > 0
    quiet = HostSample.now(stat)
    assert quiet.until(HostSample.now(stat))["gc_full"] == 0
