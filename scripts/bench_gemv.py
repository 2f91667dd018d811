"""GPU sweep of the fused matmuls' GEMV form (`specserve_kernels.fused_linear`) at SmolLM2-135M's
shapes (bf16, hidden 576, 9 q / 3 kv heads of 64, MLP 1536), model-free: random weights.

Per shape and row count (1, 2, 4, 8) it times, as microseconds per call inside one CUDA graph of
CALLS back-to-back calls (each call reads its own copy of the weights, as the 30 layers of a decode
step do, so the weights come from HBM and not from L2; `--hot` reuses one copy):

    linear   F.linear alone (cuBLAS)
    cublas   what the engine runs without the fused matmuls: F.linear with its separate kernels
             (RMSNorm before, silu_mul / RoPE + KV write / the residual add after)
    tile     the fused kernel's tile form (tl.dot), `blocks_for(..., gemv_rows=0)`
    gemv     the fused kernel's GEMV form at `blocks_for`'s default sizes
    best     the fastest sizes of the sweep (BLOCK_N, BLOCK_K, num_warps; `/all`: the GEMV form's
             every-row-at-once variant; `tile/`: the tile form), from 5 rows up the tile form too

and `layer`: a decoder layer's four matmuls with their neighbours (qkv_rope + o + gate_up + down)
in one graph per variant. The sweep tries every size near the default at one row, the best few at
the other row counts, until `--budget-s` runs out (defaults, tile and cuBLAS always come first).

Run from the repository root (on the GPU machine; the kernels import as `specserve_kernels`):
    python3 -P scripts/bench_gemv.py [--rows 1,2,4,8] [--budget-s 100] [--hot]
Writes $OUT/bench_gemv.json and $OUT/gemv_sizes.json (each shape's fastest sizes per row count, the
table `specserve_kernels.gemv_sizes` reads: ship it as kernels/gemv_sizes.json, or point
SPECSERVE_GEMV_SIZES at it) when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import zip_longest

import torch
import torch.nn.functional as F
import triton

from specserve_kernels.fused_linear import (
    ROW_AT_A_TIME,
    Blocks,
    QKVLayout,
    blocks_for,
    fused_linear,
    gemv_blocks,
    qkv_rope_store,
)
from specserve_kernels.gemv_sizes import SIZES_ENV, write_table
from specserve_kernels.rms_norm import add_rms_norm
from specserve_kernels.rope_store import rope_kv_store
from specserve_kernels.silu_mul import silu_mul

HIDDEN, HEADS, KV_HEADS, DIM, INTER = 576, 9, 3, 64, 1536
Q_SIZE, KV_SIZE = HEADS * DIM, KV_HEADS * DIM
EPS = 1e-5
DTYPE = torch.bfloat16
CALLS = 100
REPLAYS = 20
SLOTS = 4096
DEVICE = "cuda"


@dataclass(frozen=True)
class Shape:
    name: str
    out_features: int  # weight rows
    in_features: int
    gemv_n: int  # what a GEMV block's columns count: output columns, gated columns or rotation pairs


SHAPES = (
    Shape("qkv", Q_SIZE + 2 * KV_SIZE, HIDDEN, Q_SIZE + 2 * KV_SIZE),
    Shape("qkv_rope", Q_SIZE + 2 * KV_SIZE, HIDDEN, (Q_SIZE + 2 * KV_SIZE) // 2),
    Shape("o", HIDDEN, Q_SIZE, HIDDEN),
    Shape("gate_up", 2 * INTER, HIDDEN, INTER),
    Shape("down", HIDDEN, INTER, HIDDEN),
)


def graph_us(calls: list[Callable[[], object]]) -> float:
    """Median microseconds per call over REPLAYS replays of one graph holding `calls` in turn."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles, cuBLAS handles and workspaces before the capture
        for call in calls[:2]:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times) * 1e3 / len(calls)


def random_weights(copies: int, seed: int = 0) -> dict[str, list[torch.Tensor]]:
    """`copies` of every shape's weight (qkv_rope shares qkv's)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w = {
        s.name: [
            torch.randn(s.out_features, s.in_features, device=DEVICE, dtype=DTYPE, generator=g)
            * s.in_features**-0.5
            for _ in range(copies)
        ]
        for s in SHAPES
        if s.name != "qkv_rope"
    }
    w["qkv_rope"] = w["qkv"]
    return w


class Case:
    """One row count's inputs, over the shared weights."""

    def __init__(self, rows: int, weights: dict[str, list[torch.Tensor]], seed: int = 1) -> None:
        g = torch.Generator(device=DEVICE).manual_seed(seed)

        def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return torch.randn(*shape, device=DEVICE, dtype=DTYPE, generator=g) * scale

        self.rows, self.w = rows, weights
        self.ln = (1 + rand(HIDDEN, scale=0.1), EPS)
        self.stream, self.attn, self.act = rand(rows, HIDDEN), rand(rows, Q_SIZE), rand(rows, INTER)
        cache = torch.zeros(2, SLOTS, KV_HEADS, DIM, device=DEVICE, dtype=DTYPE)
        slots = torch.randperm(SLOTS, device=DEVICE)[:rows]
        positions = torch.randint(0, 2048, (rows,), device=DEVICE)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, DIM, 2, device=DEVICE, dtype=torch.float32) / DIM)
        angles = torch.outer(torch.arange(SLOTS, device=DEVICE, dtype=torch.float32), inv_freq)
        self.cos, self.sin = angles.cos().contiguous(), angles.sin().contiguous()
        self.layout = QKVLayout(HEADS, KV_HEADS, cache[0], cache[1], slots, positions, self.cos, self.sin)

    def fused(self, shape: str, w: torch.Tensor, blocks: Blocks) -> Callable[[], object]:
        """One fused call of `shape` at `blocks` (the tile or the GEMV form)."""
        if shape == "qkv":
            return lambda: fused_linear(self.stream, w, norm=self.ln, blocks=blocks)
        if shape == "qkv_rope":
            return lambda: qkv_rope_store(self.stream, w, self.layout, norm=self.ln, blocks=blocks)
        if shape == "o":
            return lambda: fused_linear(self.attn, w, residual=self.stream, blocks=blocks)
        if shape == "gate_up":
            return lambda: fused_linear(self.stream, w, norm=self.ln, gated=True, blocks=blocks)
        return lambda: fused_linear(self.act, w, residual=self.stream, blocks=blocks)

    def linear(self, shape: str, w: torch.Tensor) -> Callable[[], object]:
        x = {"o": self.attn, "down": self.act}.get(shape, self.stream)
        return lambda: F.linear(x, w)

    def cublas(self, shape: str, w: torch.Tensor) -> Callable[[], object]:
        """The unfused path's kernels for `shape`; a residual add stands for the one the engine fuses
        into the next norm."""
        rows = self.rows
        if shape == "qkv":
            return lambda: F.linear(add_rms_norm(self.stream, None, self.ln[0], EPS)[0], w)
        if shape == "qkv_rope":

            def call() -> object:
                h = add_rms_norm(self.stream, None, self.ln[0], EPS)[0]
                q, k, v = F.linear(h, w).split([Q_SIZE, KV_SIZE, KV_SIZE], -1)
                lay = self.layout
                return rope_kv_store(
                    q.view(rows, HEADS, DIM),
                    k.view(rows, KV_HEADS, DIM),
                    v.view(rows, KV_HEADS, DIM),
                    lay.k_cache,
                    lay.v_cache,
                    lay.slot_mapping,
                    lay.positions,
                    self.cos,
                    self.sin,
                )

            return call
        if shape == "o":
            return lambda: F.linear(self.attn, w) + self.stream
        if shape == "gate_up":
            return lambda: silu_mul(F.linear(add_rms_norm(self.stream, None, self.ln[0], EPS)[0], w))
        return lambda: F.linear(self.act, w) + self.stream


def tile_blocks(shape: Shape, rows: int) -> Blocks:
    return blocks_for(rows, shape.gemv_n, shape.in_features, gemv_rows=0)


def sweep_configs(shape: Shape, rows: int) -> list[Blocks]:
    """GEMV sizes around the default, nearest first: a row at a time (column blocks 1-16, K chunks
    from 512 to the whole K, warps for 16-64 weights a thread) and, past `ROW_AT_A_TIME` rows, every
    row at once (column blocks 1-8, K chunks from 128, warps for 16-128 products a thread)."""
    default = gemv_blocks(rows, shape.gemv_n, shape.in_features)
    k_max = min(triton.next_power_of_2(shape.in_features), 2048)
    m = min(triton.next_power_of_2(rows), 16)
    one_row_m = min(triton.next_power_of_2(rows), 8)
    found = []
    for n in (1, 2, 4, 8, 16):
        for k in sorted({min(512, k_max), min(1024, k_max), k_max}):
            for warps in (1, 2, 4, 8):
                if 16 <= n * k // (32 * warps) <= 64:
                    found.append(Blocks(one_row_m, n, k, warps, gemv=True))
    if rows > ROW_AT_A_TIME:
        for n in (1, 2, 4, 8):
            for k in sorted({min(c, k_max) for c in (128, 256, 512, 1024, 2048)}):
                for warps in (1, 2, 4, 8):
                    if 16 <= m * n * k // (32 * warps) <= 128:
                        found.append(Blocks(m, n, k, warps, gemv=True, all_rows=True))
        # The tile form (tl.dot over 16 rows) with long K chunks: one or two trips to memory.
        for n in (16, 32, 64):
            for k in sorted({min(c, k_max) for c in (256, 512, 1024, 2048)}):
                for warps in (2, 4, 8):
                    if (16 + n) * k <= 65536:
                        found.append(Blocks(max(16, m), n, k, warps))

    def distance(b: Blocks) -> float:
        return (
            (b.all_rows != default.all_rows)
            + 2 * (b.gemv != default.gemv)
            + sum(
                abs(math.log2(a / d))
                for a, d in ((b.n, default.n), (b.k, default.k), (b.warps, default.warps))
            )
        )

    return sorted((b for b in found if b != default), key=distance)


def cfg(b: Blocks) -> str:
    return ("" if b.gemv else "tile/") + f"n{b.n}/k{b.k}/w{b.warps}" + ("/all" if b.all_rows else "")


def parse_cfg(name: str, rows: int) -> Blocks:
    tile = name.startswith("tile/")
    parts = name.removeprefix("tile/").split("/")
    n, k, warps = (int(part[1:]) for part in parts[:3])
    all_rows = parts[-1] == "all"
    m = min(triton.next_power_of_2(rows), 16 if all_rows else 8)
    if tile:
        return Blocks(max(16, triton.next_power_of_2(rows)), n, k, warps)
    return Blocks(m, n, k, warps, gemv=True, all_rows=all_rows)


def timed_fused(case: Case, shape: Shape, blocks: Blocks) -> float:
    try:
        return graph_us([case.fused(shape.name, w, blocks) for w in cycled(case.w[shape.name])])
    except Exception as err:  # a size that does not compile or launch: reported, skipped
        print(f"  {shape.name} rows={case.rows} {cfg(blocks)}: failed ({type(err).__name__}: {err})"[:200])
        return math.nan


def cycled(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    return [weights[i % len(weights)] for i in range(CALLS)]


def layer_us(case: Case, variant: str) -> float:
    """A layer's four matmuls with their neighbours, `variant` cublas / tile / gemv."""
    calls: list[Callable[[], object]] = []
    for i in range(CALLS // 4):
        for shape in SHAPES[1:]:
            w = case.w[shape.name][i % len(case.w[shape.name])]
            if variant == "cublas":
                calls.append(case.cublas(shape.name, w))
            else:
                rows = case.rows
                blocks = (
                    tile_blocks(shape, rows)
                    if variant == "tile"
                    else gemv_blocks(rows, shape.gemv_n, shape.in_features)
                )
                calls.append(case.fused(shape.name, w, blocks))
    return graph_us(calls) * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument(
        "--budget-s", type=float, default=100.0, help="seconds for the sweep beyond the defaults"
    )
    parser.add_argument("--top", type=int, default=3, help="sizes of the 1-row sweep retried at more rows")
    parser.add_argument("--hot", action="store_true", help="one weight copy: weights stay in L2")
    parser.add_argument("--sweep-shapes", default=",".join(s.name for s in SHAPES), help="shapes to sweep")
    args = parser.parse_args()
    os.environ.setdefault(SIZES_ENV, "none")  # the rule's sizes are the defaults a sweep starts from
    began = time.perf_counter()
    row_counts = [int(r) for r in args.rows.split(",")]
    print(
        f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; "
        f"{CALLS} calls a graph, weights {'hot (one copy)' if args.hot else 'cold (a copy a call)'}"
    )
    weights = random_weights(1 if args.hot else CALLS)
    cases = {rows: Case(rows, weights) for rows in row_counts}
    results: dict[int, dict[str, dict]] = {rows: {} for rows in row_counts}

    for rows, case in cases.items():  # everything but the sweep: always measured
        for shape in SHAPES:
            w = cycled(case.w[shape.name])
            default = gemv_blocks(rows, shape.gemv_n, shape.in_features)
            gemv = timed_fused(case, shape, default)
            results[rows][shape.name] = {
                "linear": graph_us([case.linear(shape.name, x) for x in w]),
                "cublas": graph_us([case.cublas(shape.name, x) for x in w]),
                "tile": timed_fused(case, shape, tile_blocks(shape, rows)),
                "gemv": gemv,
                "gemv_blocks": asdict(default),
                "sweep": {cfg(default): gemv},
            }
        results[rows]["layer"] = {v: layer_us(case, v) for v in ("cublas", "tile", "gemv")}
    print(f"defaults measured in {time.perf_counter() - began:.0f} s")

    # Most of the budget to the first row count's full sweep, the rest to its best sizes at the others.
    sweep_start = time.perf_counter()
    deadline = sweep_start + args.budget_s * (0.7 if len(row_counts) > 1 else 1.0)
    skipped = 0
    first = row_counts[0]
    swept = [s for s in SHAPES if s.name in args.sweep_shapes.split(",")]
    per_shape = [[(s, b) for b in sweep_configs(s, first)] for s in swept]
    nearest_first = (job for rank in zip_longest(*per_shape) for job in rank if job)  # every shape's
    for shape, blocks in nearest_first:
        if time.perf_counter() > deadline:
            skipped += 1
            continue
        results[first][shape.name]["sweep"][cfg(blocks)] = timed_fused(cases[first], shape, blocks)
    deadline = sweep_start + args.budget_s
    for rows in row_counts[1:]:
        for shape in swept:
            ranked = sorted(results[first][shape.name]["sweep"].items(), key=lambda kv: _key(kv[1]))
            sweep = results[rows][shape.name]["sweep"]
            for name, _ in ranked[: args.top]:
                if time.perf_counter() > deadline:
                    skipped += 1
                    continue
                blocks = parse_cfg(name, rows)
                if (blocks.all_rows or not blocks.gemv) and rows <= ROW_AT_A_TIME:
                    continue
                if cfg(blocks) not in sweep:
                    sweep[cfg(blocks)] = timed_fused(cases[rows], shape, blocks)
    if skipped:
        print(f"sweep budget spent: {skipped} sizes not timed (raise --budget-s)")

    print("\nus per call (graph of back-to-back calls); best = the sweep's fastest GEMV sizes")
    header = f"{'rows':>4} {'shape':9} {'linear':>7} {'cublas':>7} {'tile':>7} {'gemv':>7} {'best':>7}  best sizes    default"
    print(header)
    for rows in row_counts:
        for shape in SHAPES:
            r = results[rows][shape.name]
            name, best = min(r["sweep"].items(), key=lambda kv: _key(kv[1]))
            r["best"], r["best_blocks"] = best, name
            d = Blocks(**r["gemv_blocks"])
            print(
                f"{rows:>4} {shape.name:9} {r['linear']:7.2f} {r['cublas']:7.2f} {r['tile']:7.2f} "
                f"{r['gemv']:7.2f} {best:7.2f}  {name:13} {cfg(d)} ({len(r['sweep'])} tried)"
            )
        lay = results[rows]["layer"]
        best_sum = sum(results[rows][s.name]["best"] for s in SHAPES[1:])
        print(
            f"{rows:>4} {'layer':9} {'':7} {lay['cublas']:7.2f} {lay['tile']:7.2f} {lay['gemv']:7.2f} "
            f"{best_sum:7.2f}  (best: the sum of qkv_rope, o, gate_up, down)"
        )
    print("\nbest GEMV sizes per shape (BLOCK_N / BLOCK_K / num_warps):")
    for shape in SHAPES:
        bests = {rows: results[rows][shape.name]["best_blocks"] for rows in row_counts}
        print(
            f"  {shape.name:9} N={shape.gemv_n} K={shape.in_features}: "
            + ", ".join(f"rows {r}: {b}" for r, b in bests.items())
        )
    print(f"total {time.perf_counter() - began:.0f} s")
    out = os.environ.get("OUT")
    if out:
        table = {
            (rows, shape.gemv_n, shape.in_features): _fields(
                parse_cfg(results[rows][shape.name]["best_blocks"], rows)
            )
            for rows in row_counts
            for shape in SHAPES
        }
        write_table(os.path.join(out, "gemv_sizes.json"), table, {"device": torch.cuda.get_device_name()})
        report = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "calls_per_graph": CALLS,
            "hot": args.hot,
            "results": {str(rows): r for rows, r in results.items()},
        }
        with open(os.path.join(out, "bench_gemv.json"), "w") as f:
            json.dump(report, f, indent=1)


def _fields(b: Blocks) -> dict:
    """A table entry: `Blocks`' fields."""
    return asdict(b)


def _key(us: float) -> float:
    return math.inf if us != us else us


if __name__ == "__main__":
    main()
