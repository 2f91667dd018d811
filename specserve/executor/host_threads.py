"""The host side of a GPU engine: one thread for torch's CPU operators.

On a GPU, the engine's host thread prepares and launches steps, and its CPU tensors are small
(positions, page tables, a run's tokens). torch's intra-op pool (OpenMP, one thread per core) gains
nothing there, yet its threads spin-wait after every parallel region and contend with the thread that
issues the steps. On the H200 machine (16 cores, `specserve bench offline`, batch 64, 256 tokens), the
bench process burned 8-10 CPUs while its engines ran, and repeats of one system spread 10-15%. With one
thread it used 1.0 CPU, the MT-Bench repeats fell within 0.6% of each other, and plain decoding and the
2-chain of n-gram drafts made 11% and 17% more tokens a second (docs/benchmarks.md, thirty-fourth
session).

A CPU engine computes its model on those threads, so it keeps them. An operator's own choice stands:
`SPECSERVE_HOST_THREADS` (a count), or `OMP_NUM_THREADS` (Ray sets it for its workers).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

ENV = "SPECSERVE_HOST_THREADS"


def settle_host_threads(device: torch.device) -> int:
    """Before a GPU engine's first step: torch's intra-op threads to `SPECSERVE_HOST_THREADS`, else
    to 1 unless `OMP_NUM_THREADS` chose already. Returns the count in force. ValueError naming the
    variable for a value that is not a count >= 1."""
    wanted = host_threads_wanted(os.environ)
    if device.type == "cuda" and wanted is not None:
        torch.set_num_threads(wanted)
    return torch.get_num_threads()


def host_threads_wanted(environ: Mapping[str, str]) -> int | None:
    """The thread count a GPU engine sets from `environ` (None: leave torch's as it is)."""
    raw = environ.get(ENV)
    if raw is None:
        return None if "OMP_NUM_THREADS" in environ else 1
    try:
        count = int(raw)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"{ENV}: {raw!r} is not a thread count (an integer >= 1)")
    return count
