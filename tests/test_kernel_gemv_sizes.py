"""The tuned GEMV sizes table: which swept row count serves a step, the file round trip, the
environment switch, and that `blocks_for` takes a table's sizes over the rule."""

from __future__ import annotations

import os
import subprocess
import sys

from specserve_kernels import fused_linear as fused_linear_module
from specserve_kernels.fused_linear import Blocks, blocks_for
from specserve_kernels.gemv_sizes import SHIPPED, read_table, tuned_sizes, write_table

SIX = {"m": 8, "n": 2, "k": 256, "warps": 2, "gemv": True, "all_rows": True}
TWELVE = {"m": 16, "n": 32, "k": 1024, "warps": 4, "gemv": False, "all_rows": False}
TABLE = {(6, 480, 576): SIX, (12, 480, 576): TWELVE}


def test_a_step_takes_the_fewest_swept_rows_that_hold_it_within_its_power_of_two():
    assert tuned_sizes(5, 480, 576, TABLE) == SIX
    assert tuned_sizes(6, 480, 576, TABLE) == SIX
    assert tuned_sizes(7, 480, 576, TABLE) is None  # 6 rows cannot hold 7; 12 is past 8
    assert tuned_sizes(9, 480, 576, TABLE) == TWELVE
    assert tuned_sizes(16, 480, 576, TABLE) is None
    assert tuned_sizes(1, 480, 576, TABLE) is None  # sizes for 6 rows never serve a decode row
    assert tuned_sizes(6, 576, 576, TABLE) is None  # another shape


def test_table_round_trip(tmp_path):
    path = tmp_path / "sizes.json"
    write_table(path, TABLE, {"device": "test"})
    assert read_table(path) == TABLE


def test_blocks_for_prefers_the_table_unless_asked_for_the_rule(monkeypatch):
    monkeypatch.setattr(fused_linear_module, "tuned_sizes", lambda rows, n, k: TABLE.get((rows, n, k)))
    assert blocks_for(6, 480, 576) == Blocks(**SIX)
    assert blocks_for(12, 480, 576) == Blocks(**TWELVE)  # a tile-form entry
    assert blocks_for(6, 576, 576) != Blocks(**SIX)  # not in the table: the rule
    assert blocks_for(6, 480, 576, gemv_rows=4) != Blocks(**SIX)


def test_the_shipped_table_names_valid_sizes():
    if not SHIPPED.is_file():
        return
    for (rows, _, _), blocks in read_table(SHIPPED).items():
        b = Blocks(**blocks)
        assert rows <= b.m <= 16 and b.n >= 1 and b.k >= 16 and 1 <= b.warps <= 8


def test_env_none_turns_the_table_off(tmp_path):
    path = tmp_path / "sizes.json"
    write_table(path, {(6, 480, 576): SIX}, {})
    code = "from specserve_kernels.gemv_sizes import tuned_sizes; print(tuned_sizes(6, 480, 576))"
    for value, expect in ((str(path), str(SIX)), ("none", "None")):
        env = {**os.environ, "SPECSERVE_GEMV_SIZES": value}
        out = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == expect
