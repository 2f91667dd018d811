"""Adaptive speculation against the H100's measured step costs, on the CPU: what the policy picks, and why.

The real control code (`AdaptiveSpeculation`: policy, acceptance estimates, cost tables) decides
every step; the engine around it is a model whose clock is an issue 9 H100 run (`scripts/adaptive_gpu.sh`,
docs/benchmarks.md, fifth and sixth sessions): per batch size, the wall ms of a plain
(overlapped) step and of each static n-gram chain's step by phase (draft, target, postprocess), from
the bench rows' `step_ms`, interpolated in batch. A step of adaptive runs the chain whose CUDA-graph
bucket fits its widest draft. The start-up profile sees only a device pass (`PROFILE_SHARE` of a
live target phase: verify and compaction are host work it misses) and a lookup, as
`engine/cost_profile.py` does. As in `specserve bench offline`: one engine per system for every batch
size in turn, warmed up first (the policy keeps what it learnt), each request makes `--tokens` tokens
and leaves, so the batch thins in the tail; of `--repeats` runs the faster counts.

Acceptance is n-gram-like, bimodal (a short or a long match, or none), per request (`TEXT`: classes
fitted to the H100's accept lengths, `ACCEPT`), each position drawn on its own. `--replay N` takes
it from real text instead: the default model's greedy answers to the workload's first N prompts
(MT-Bench, or `mixed`'s), generated on the CPU once (cached), and what an n-gram lookup gets right
at each of their positions. Real text comes in
stretches, which the drawn models lack; the engine counts n-gram acceptance per token for that
(`AcceptanceTracker.per_token`), and so does the policy here (`--per-verify`: as before). While off
the policy scores shadow drafts as the engine's does (`Shadows`; `--no-shadows`: as before).
`--run` picks the H100 run that clocks the steps
(`sixth`, the default: the sixth session's run, whose cost tables were 1.5-3x off; `latest`: the
fifth session's run after its cost-model fix; `first`: the one before, whose plain rows ran steadier;
`twelfth`, issue 9's twelfth H100 run (the eleventh session's first, docs/benchmarks.md): chain tiers
in the device loop, `LOOP_PROFILE`, as the engine runs n-gram chains since the
eighth session: a run of `LOOP_RUN` verifies an engine step, its step time fed back as
`Engine._observe_loop` does; `h200`: the same on the H200's loop-iteration ms of the thirty-third
session, `H200_LOOP`, with `--flat-context 0`, its static rows beside; with `--replay 64` it has
`drain_thinning` at least level with the default in five of six cells, batch 4 / 16 / 64:
MT-Bench 1.01 / 1.00 / 1.02x the best static against 1.02 / 1.00 / 1.00, mixed 1.00 / 0.95 / 1.02
against 0.94 / 0.95 / 0.99; its default speculates at batch 16 where the H200's stayed off).
`--off-loop` runs plain decoding in a device loop too (static, and adaptive's off tier), as the
engine has run n-gram drafting's off since the twenty-sixth session: its loop steps price off, and
its start-up profile is a loop step as the chains' are (`cost_profile.time_pass`). With it (thirty-
fourth session, `--run h200 --flat-context 0 --replay 64`), batch 4 / 16 / 64 over the best static:
MT-Bench 0.98 / 0.99 / 1.01, mixed 0.99 / 0.98 / 1.01, with the engine's shadow lookups per plain
step (a run's worth an engine step off); at 2 an engine step, as before, 0.97 / 0.95 / 0.97 and
0.98 / 0.98 / 1.01. Profiling plain at a decode pass's share
(`PROFILE_SHARE`) while its loop priced it, the sim's chains came out 30% dear at batch 16 and
adaptive stayed off at every batch (0.81-0.96): plain's gap over its profile, which the chains' did
not share, interpolated in width, priced the narrow chains. The engine profiles plain as its loop's
step, so that was the sim's error, not the engine's.
A resumed loop run is observed one step late, as the engine reads it once the next run is queued
(`LoopSample`, `observe_sample`; thirty-fifth session: MT-Bench 0.98 / 1.00 / 1.01, mixed 0.97 /
0.98 / 1.00 at seed 0). `--switch-walls F` models the H200's walls at a switch of looped tier (the
step settling the old tier's last run also waits F of the new tier's first, the next step's wall
lacks it); `--setting switch_runs_priced=false`, the engine's opt-in that prices nothing from those
two runs. `--context-gap REF` prices a loop step beyond its profile as the H200's traces show it,
per request and whatever the chain (`GAP_FIXED_MS`, `CONTEXT_MS`), its rows taken as measured over
contexts of REF tokens.
The engine's pipeline is modelled (`run`): an overlapped plain step's wall is the wait for the step
before (a prefill's, after the run's first step), and a speculative step after plain steps settles
the one in flight and pays `--transition` of its step more; an engine's first verify of a shape
pays `--first-ms` more (one-off costs): the effects that mispriced the sixth run's tables (its
batch-1 miss, 0.66x, comes out at 0.66x; docs/benchmarks.md). With `--run twelfth` a loop run goes
on over finished requests' rows as the engine's does (`device_loop.carries`, priced at the rows it
carries), a switch between chain tiers queues the new tier's run there too (the loops share the
requests' state; `--switch-settles`: a fresh run, as before that), and a fresh one costs its setup
(`FRESH_MS`, `SETUP_MS` a request), which the policy hears (`observe_setup`) as a switch's cost. Prints, per batch, tokens/s of plain
and each static chain and their accept lengths (beside the H100's), of adaptive, issue 9's
verdict, the steps per tier, the policy's predicted step ms beside the clock's steady ones, and the
mean ms of the steady and the transition steps the control code saw.

    PYTHONPATH=... python -P scripts/adaptive_sim.py [--workload mixed|mt-bench] [--batches 1,4,16,64]
        [--run sixth|latest|first|twelfth] [--prefill-us 1.5] [--transition 0.5] [--first-ms 5] [--jitter 0.15]
        [--mix copy:0.125] [--bursty 0.005:0.035] [--setting NAME=VALUE ...]

`--mix` swaps the text model for a heterogeneous one (`MIX`): every chat class above shares its
conditional rates past the first position, where on the H100 a few copying requests reach the deep
positions and set the pooled rates that a chat request, which seldom tests them, is scored by
(`AcceptanceTracker.rates_of` shrinks its own counts to the pool's): issue 9's large-batch bias. With
`--run twelfth --mix copy:0.125` (MT-Bench; copy:0.25 mixed) the policy holds chains of 1-4 at batch
16 and 64 (0.96-0.99x the best static), not the deep ones: the bias alone does not make the miss here.

`--bursty IN:OUT` gives every request stretches of copying inside chat instead (a two-state chain over
its output positions: a chat position turns to copying with probability IN, a copying one back with
OUT; the rates are `MIX`'s two classes'), as text copies a passage and then goes on in its own words.
Deep positions are then tested mostly while a request copies: a candidate for the selection that,
on the H100, left the pooled rates at positions 2-3 far above what the static rows imply (twelfth
session: 0.65 and 0.84 at batch 16, against about 0.44 and 0.6). It does not reproduce it: with
0.005:0.035 and 0.002:0.014 on MT-Bench the pooled rates stay within 0.08 of the implied ones at
batch 16 and 64 (stretches of one request average out over a batch). Each batch prints the static
rows' implied conditional rates beside the pooled ones.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from specserve.config import SpeculativeConfig
from specserve.engine.adaptive_control import AdaptiveSpeculation
from specserve.engine.device_loop import CARRY_SHARE
from specserve.engine.stats import StepStats
from specserve.spec.adaptive import OFF, Tier
from specserve.spec.draft_depths import VerifyShapes
from specserve.spec.step_costs import DRAFT, VERIFY

MS = 1e-3
CHAINS = (1, 2, 4, 8)
GRAPH_BATCHES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
PROFILE_SHARE = 0.7  # of a live target phase, the device pass a start-up profile times
WARMUP_TOKENS = 8  # specserve.bench's warm-up run (two prompts)
LAUNCH_MS = 0.15  # an overlapped plain step with nothing in flight before it: its launch, no wait
PROMPT_TOKENS = {"mt-bench": 110, "mixed": 314}  # the bench's mean prompt (its JSON's mean_prompt_tokens)

# fmt: off
# H100 step ms by batch: plain = wall step; chain k = (draft, target, rest of the step); tok/s and accept
# lengths of the static rows and adaptive, for comparison.
H100 = {
    # The sixth session's run (docs/benchmarks.md, "Adaptive speculation, sixth session"; logs of
    # `REPEATS=2 scripts/adaptive_gpu.sh` on 7a92aab): the run whose cost tables were 1.5-3x off.
    "sixth": {
        "mt-bench": {
            "plain": {1: 0.740, 4: 1.012, 16: 1.194, 64: 3.024},
            1: {1: (0.031, 1.076, 0.044), 4: (0.067, 1.480, 0.102), 16: (0.164, 1.607, 0.283), 64: (0.576, 2.452, 1.206)},
            2: {1: (0.039, 1.294, 0.065), 4: (0.048, 1.344, 0.088), 16: (0.129, 1.587, 0.284), 64: (0.536, 2.456, 1.157)},
            4: {1: (0.053, 1.558, 0.093), 4: (0.048, 1.380, 0.097), 16: (0.139, 1.647, 0.339), 64: (0.498, 2.509, 1.360)},
            8: {1: (0.026, 1.262, 0.053), 4: (0.049, 1.402, 0.099), 16: (0.113, 1.647, 0.291), 64: (0.468, 2.714, 1.260)},
            "tok/s": {
                "off": {1: 1322, 4: 3867, 16: 13173, 64: 20865},
                "1": {1: 1301, 4: 2914, 16: 8696, 64: 16096},
                "2": {1: 1265, 4: 3412, 16: 9088, 64: 16429},
                "4": {1: 1325, 4: 3484, 16: 8717, 64: 16159},
                "8": {1: 1971, 4: 3226, 16: 9075, 64: 15688},
                "adaptive": {1: 1296, 4: 3979, 16: 8200, 64: 18164},
            },
        },
        "mixed": {
            "plain": {1: 0.827, 4: 1.041, 16: 1.557, 64: 3.894},
            1: {1: (0.041, 1.277, 0.064), 4: (0.093, 1.598, 0.157), 16: (0.261, 1.990, 0.463), 64: (0.803, 3.585, 1.727)},
            2: {1: (0.053, 1.443, 0.092), 4: (0.077, 1.544, 0.146), 16: (0.207, 1.912, 0.468), 64: (0.667, 3.431, 1.683)},
            4: {1: (0.041, 1.855, 0.097), 4: (0.082, 1.617, 0.174), 16: (0.179, 1.874, 0.433), 64: (0.538, 3.249, 1.489)},
            8: {1: (0.052, 1.747, 0.123), 4: (0.083, 1.680, 0.188), 16: (0.167, 1.985, 0.484), 64: (0.476, 3.504, 1.505)},
            "tok/s": {
                "off": {1: 1181, 4: 3752, 16: 10053, 64: 16067},
                "1": {1: 1129, 4: 2511, 16: 6814, 64: 11184},
                "2": {1: 1254, 4: 2938, 16: 7458, 64: 11922},
                "4": {1: 1513, 4: 2712, 16: 8110, 64: 13069},
                "8": {1: 1992, 4: 2659, 16: 7644, 64: 13635},
                "adaptive": {1: 1211, 4: 3595, 16: 9653, 64: 17954},
            },
        },
    },
    # The fifth session's adaptive run after the cost-model fix (docs/benchmarks.md, "Measured again after
    # that fix"): this process's plain rows ran slow at batch 1 and 4 (mixed), as the doc says.
    "latest": {
        "mt-bench": {
            "plain": {1: 1.284, 4: 0.990, 16: 1.291, 64: 3.459},
            1: {1: (0.049, 1.411, 0.080), 4: (0.071, 1.581, 0.126), 16: (0.151, 1.694, 0.287), 64: (0.551, 2.567, 1.210)},
            2: {1: (0.050, 1.547, 0.089), 4: (0.076, 1.674, 0.152), 16: (0.148, 1.736, 0.315), 64: (0.443, 2.351, 1.007)},
            4: {1: (0.036, 1.672, 0.069), 4: (0.049, 1.487, 0.103), 16: (0.152, 1.801, 0.367), 64: (0.419, 2.428, 1.073)},
            8: {1: (0.024, 1.309, 0.053), 4: (0.053, 1.550, 0.114), 16: (0.114, 1.723, 0.286), 64: (0.439, 2.891, 1.244)},
            "tok/s": {
                "off": {1: 764, 4: 3969, 16: 12166, 64: 18117},
                "1": {1: 971, 4: 2702, 16: 8379, 64: 15746},
                "2": {1: 1049, 4: 2650, 16: 8268, 64: 17950},
                "4": {1: 1273, 4: 3240, 16: 7986, 64: 18005},
                "8": {1: 1905, 4: 2909, 16: 8767, 64: 15220},
                "adaptive": {1: 1599, 4: 4668, 16: 8566, 64: 21345},
            },
        },
        "mixed": {
            "plain": {1: 1.495, 4: 1.732, 16: 1.366, 64: 3.634},
            1: {1: (0.056, 1.517, 0.089), 4: (0.066, 1.531, 0.115), 16: (0.179, 1.870, 0.347), 64: (0.651, 3.298, 1.464)},
            2: {1: (0.046, 1.530, 0.089), 4: (0.058, 1.578, 0.127), 16: (0.208, 2.088, 0.445), 64: (0.524, 3.328, 1.267)},
            4: {1: (0.052, 1.844, 0.130), 4: (0.076, 1.713, 0.155), 16: (0.137, 1.850, 0.344), 64: (0.566, 3.297, 1.719)},
            8: {1: (0.034, 1.522, 0.085), 4: (0.062, 1.572, 0.134), 16: (0.121, 1.834, 0.313), 64: (0.539, 3.686, 1.698)},
            "tok/s": {
                "off": {1: 656, 4: 2267, 16: 11508, 64: 17130},
                "1": {1: 938, 4: 2715, 16: 7716, 64: 12633},
                "2": {1: 1195, 4: 2948, 16: 7041, 64: 13498},
                "4": {1: 1486, 4: 2616, 16: 8648, 64: 12346},
                "8": {1: 2340, 4: 2940, 16: 8899, 64: 12620},
                "adaptive": {1: 1934, 4: 2999, 16: 10339, 64: 14598},
            },
        },
    },
    # The fifth session's first adaptive run (before the cost-model fix): steadier plain rows.
    "first": {
        "mt-bench": {
            "plain": {1: 0.741, 4: 1.156, 16: 1.194, 64: 2.213},
            1: {1: (0.024, 1.056, 0.040), 4: (0.056, 1.482, 0.094), 16: (0.119, 1.546, 0.227), 64: (0.424, 2.253, 0.846)},
            2: {1: (0.023, 1.141, 0.043), 4: (0.054, 1.475, 0.106), 16: (0.110, 1.552, 0.237), 64: (0.400, 2.259, 0.918)},
            4: {1: (0.023, 1.289, 0.047), 4: (0.046, 1.456, 0.098), 16: (0.110, 1.645, 0.264), 64: (0.362, 2.366, 0.959)},
            8: {1: (0.024, 1.304, 0.054), 4: (0.049, 1.486, 0.105), 16: (0.105, 1.675, 0.274), 64: (0.309, 2.448, 0.876)},
            "tok/s": {
                "off": {1: 1324, 4: 3397, 16: 13166, 64: 28451},
                "1": {1: 1338, 4: 2946, 16: 9443, 64: 19368},
                "2": {1: 1468, 4: 3086, 16: 9582, 64: 19063},
                "4": {1: 1665, 4: 3321, 16: 9177, 64: 19140},
                "8": {1: 1910, 4: 3048, 16: 9063, 64: 19180},
                "adaptive": {1: 2210, 4: 4358, 16: 8515, 64: 17494},
            },
        },
        "mixed": {
            "plain": {1: 0.751, 4: 0.965, 16: 1.336, 64: 2.518},
            1: {1: (0.027, 1.090, 0.046), 4: (0.048, 1.342, 0.085), 16: (0.138, 1.707, 0.257), 64: (0.555, 3.063, 1.194)},
            2: {1: (0.025, 1.203, 0.050), 4: (0.046, 1.385, 0.094), 16: (0.120, 1.706, 0.274), 64: (0.411, 2.806, 1.040)},
            4: {1: (0.025, 1.378, 0.058), 4: (0.039, 1.338, 0.087), 16: (0.119, 1.750, 0.299), 64: (0.509, 3.060, 1.481)},
            8: {1: (0.026, 1.417, 0.066), 4: (0.044, 1.430, 0.103), 16: (0.107, 1.774, 0.284), 64: (0.488, 3.318, 1.603)},
            "tok/s": {
                "off": {1: 1306, 4: 4079, 16: 11790, 64: 24816},
                "1": {1: 1345, 4: 3156, 16: 8817, 64: 14210},
                "2": {1: 1561, 4: 3414, 16: 9202, 64: 16192},
                "4": {1: 2066, 4: 3482, 16: 9313, 64: 13653},
                "8": {1: 2545, 4: 3302, 16: 9326, 64: 13806},
                "adaptive": {1: 2170, 4: 3748, 16: 9171, 64: 12233},
            },
        },
    },
}

# The device loop (`specserve/engine/device_loop.py`), which runs every n-gram chain tier since the
# eighth session: a loop step of chain k over `batch` requests costs its profile, LOOP_PROFILE[batch][k]
# ms (the start-up profile's back-to-back steps over rows of length 1: no context), plus the attention
# over the requests' real contexts, CONTEXT_MS per request, query row and context token. The
# profile figures are the policy's loop prices of the twelfth run (83e83ba, REPEATS=1, MT-Bench:
# b16 1.05 / 1.10 / 1.13 / 1.27, b64 2.46 / 2.48 / 2.60 / 2.70 for chains 1 / 2 / 4 / 8) and the
# loop steps profiled at batch 1 (tenth session: ~0.91 ms for chain 8); CONTEXT_MS fits the static
# loop rows' cost per verify at batch 64 rising ~0.12 ms a query row (tenth session: chain 4 2.48,
# chain 12 3.46 ms a verify; twelfth: chain 2 3.16, chain 8 4.39), none of which the profile sees.
# Plain steps: the tenth session's plain rows (REPEATS=2; the twelfth run's were broken by warm-up).
LOOP_PROFILE = {
    1: {1: 0.80, 2: 0.82, 4: 0.86, 8: 0.91},
    4: {1: 0.88, 2: 0.90, 4: 0.95, 8: 1.02},
    16: {1: 0.92, 2: 0.96, 4: 0.99, 8: 1.11},
    64: {1: 1.50, 2: 1.52, 4: 1.60, 8: 1.66},
}
CONTEXT_MS = 8e-6
# `--context-gap`: a loop iteration's cost beyond its profile per request, a fixed part and one per
# context token (`CONTEXT_MS`), whatever the chain (the H200's traces, thirty-fifth session: plain, the
# 1- and 2-chain within 10% at batch 64 over contexts of 350-570, plain's gap 0.31 ms at ~350 and
# 0.40 at ~550 tokens)
GAP_FIXED_MS = 0.0023
LOOP_PLAIN = {1: 0.72, 4: 0.85, 16: 1.08, 64: 1.75}
LOOP_RUN = 8  # verifies a loop run queues (`device_loop.DEVICE_STEPS`)
SYNC_HOST_MS = 0.3  # a synchronous speculative step's host work beyond the loop step (a probe)
# For comparison: the twelfth run's static rows at batch 16 and 64 (REPEATS=1; 0: not measured), its
# plain row replaced by the tenth session's (REPEATS=2; the twelfth's was broken by warm-up)
LOOP_TOK_S = {
    "mt-bench": {
        "off": {1: 1392, 4: 0, 16: 14773, 64: 36539},
        "1": {1: 0, 4: 0, 16: 13142, 64: 23496},
        "2": {1: 0, 4: 0, 16: 13836, 64: 30210},
        "4": {1: 0, 4: 0, 16: 11597, 64: 25029},
        "8": {1: 0, 4: 0, 16: 12817, 64: 25085},
        "adaptive": {1: 0, 4: 0, 16: 12544, 64: 21622},
    },
}

_NO_ROW = {k: dict.fromkeys((1, 4, 16, 64), 0) for k in ("off", "1", "2", "4", "8", "adaptive")}
H100["twelfth"] = {  # the device loop's costs above (`Clock.loop`)
    "mt-bench": {"plain": LOOP_PLAIN, "tok/s": LOOP_TOK_S["mt-bench"]},
    "mixed": {"plain": LOOP_PLAIN, "tok/s": _NO_ROW},
}

# The H200's device loop (thirty-third session, f703a4e, `adaptive_gpu.sh REPEATS=3`): the adaptive
# engines' own loop-iteration ms by batch and chain (their steady steps where they ran, else the
# policy's price), with the requests' contexts in them already (run it with `--flat-context 0`);
# batch 1 from the thirty-first session's plain row (1,550 tok/s) and the chains a guess (not run).
H200_LOOP = {
    1: {1: 0.75, 2: 0.76, 4: 0.78, 8: 0.80},
    4: {1: 0.88, 2: 0.90, 4: 1.02, 8: 1.05},
    16: {1: 1.00, 2: 1.06, 4: 1.10, 8: 1.14},
    64: {1: 1.29, 2: 1.30, 4: 1.50, 8: 1.73},
}
H200_PLAIN = {1: 0.645, 4: 0.76, 16: 0.97, 64: 1.25}
H200_TOK_S = {  # that call's medians (batch 1 not run)
    "mt-bench": {
        "off": {1: 0, 4: 4954, 16: 15016, 64: 45463},
        "1": {1: 0, 4: 5196, 16: 16207, 64: 51968},
        "2": {1: 0, 4: 5127, 16: 16244, 64: 50474},
        "4": {1: 0, 4: 4860, 16: 16087, 64: 48522},
        "8": {1: 0, 4: 4771, 16: 15722, 64: 42016},
        "adaptive": {1: 0, 4: 5074, 16: 15551, 64: 51181},
    },
    "mixed": {
        "off": {1: 0, 4: 4571, 16: 13040, 64: 33292},
        "1": {1: 0, 4: 5158, 16: 14425, 64: 36348},
        "2": {1: 0, 4: 5212, 16: 14764, 64: 36419},
        "4": {1: 0, 4: 4869, 16: 14654, 64: 39092},
        "8": {1: 0, 4: 4784, 16: 14060, 64: 35065},
        "adaptive": {1: 0, 4: 5005, 16: 13486, 64: 39712},
    },
}
H100["h200"] = {workload: {"plain": H200_PLAIN, "tok/s": rows} for workload, rows in H200_TOK_S.items()}
LOOPS = {"twelfth": (LOOP_PROFILE, LOOP_PLAIN), "h200": (H200_LOOP, H200_PLAIN)}  # runs clocked as loops

# The static chains' accept lengths on the H100 (accepted drafts + 1 per verify; greedy, so both runs'),
# what the text model below is fitted to.
ACCEPT = {
    "mt-bench": {
        "1": {1: 1.52, 4: 1.33, 16: 1.38, 64: 1.34},
        "2": {1: 1.80, 4: 1.47, 16: 1.52, 64: 1.50},
        "4": {1: 2.31, 4: 1.64, 16: 1.67, 64: 1.64},
        "8": {1: 2.69, 4: 1.62, 16: 1.75, 64: 1.72},
    },
    "mixed": {
        "1": {1: 1.59, 4: 1.49, 16: 1.45, 64: 1.43},
        "2": {1: 2.03, 4: 1.69, 16: 1.69, 64: 1.66},
        "4": {1: 3.08, 4: 2.02, 16: 1.95, 64: 1.87},
        "8": {1: 3.94, 4: 2.02, 16: 2.13, 64: 2.05},
    },
}

# Per workload, request i's text is class i % 8: a lookup there gets its first k drafts right with
# probability reach(k) = short * short_follow**(k-1) + long * long_follow**(k-1) (a short match or a long
# one, else none: n-gram acceptance is bimodal and rises with depth). Fitted to ACCEPT and to the static
# rows' tok/s: class 0 to batch 1 (one prompt); the others are chat (on the mixed workload two of them
# code edits or summaries, which copy more), their match chances scaled from 0.12x to 2.28x (requests
# differ: the slowest one sets a static row's tail), so that the mean over 8 gives batch 4-64.
CHAT = (0.114, 0.137, 0.219, 0.525)  # (short, short_follow, long, long_follow)
COPY = (0.1, 0.5, 0.4, 0.8)
SCALES = (2.28, 0.12, 0.84, 1.56, 1.92, 0.48, 1.2)  # of classes 1-7: 1.2 x (0.1 ... 1.9)
# fmt: on


def _classes(first: tuple, others: list[tuple]) -> list[tuple]:
    return [first] + [
        (s * short, sf, s * long, lf) for (short, sf, long, lf), s in zip(others, SCALES, strict=True)
    ]


TEXT = {
    "mt-bench": _classes((0.099, 0.055, 0.409, 0.778), [CHAT] * 7),
    "mixed": _classes((0.238, 0.861, 0.353, 0.869), [COPY, CHAT, CHAT, CHAT, CHAT, COPY, CHAT]),
}


# `--mix`: heterogeneous text, as the H100's requests differ (issue 9's large-batch miss). Each request is
# of one class, which fixes its conditional acceptance per draft position (past the list: its last
# rate): a lookup gets its first drafts right one after another at those rates, and half the lookups
# that get none right find nothing. "copy" (code edits, summaries: a match runs on) is shared; "chat"
# is per workload. Fitted, with copy:0.125 on MT-Bench and copy:0.25 on mixed, to the next H100
# run's static accept lengths at batch 64 (commit bff99f6, docs/benchmarks.md eleventh session: MT-Bench 1.34 / 1.49 / 1.63 / 1.72, mixed
# 1.43 / 1.65 / 1.86 / 2.04 for chains 1 / 2 / 4 / 8; the sim's: 1.33 / 1.49 / 1.64 / 1.70 and
# 1.43 / 1.65 / 1.87 / 2.00): a chat request's deep rates (0.45-0.5) lie below the copying ones' (0.9),
# which reach the deep positions and so set the pool's there.
COPY_RATES = (0.55, 0.9)
MIX = {
    "mt-bench": {"copy": COPY_RATES, "chat": (0.3, 0.45, 0.5)},
    "mixed": {"copy": COPY_RATES, "chat": (0.4, 0.4, 0.5)},
}


def parse_mix(text: str, workload: str) -> dict[str, float]:
    """`--mix`'s "class:share,...": each class's share of the requests, the rest chat."""
    shares: dict[str, float] = {}
    for part in text.split(","):
        name, _, share = part.partition(":")
        if name not in MIX[workload]:
            raise SystemExit(f"--mix: no class {name!r} (classes: {', '.join(MIX[workload])})")
        shares[name] = float(share) if share else 1.0
    rest = 1.0 - sum(shares.values())
    if rest < -1e-9:
        raise SystemExit(f"--mix: shares add up to {1.0 - rest:g}, over 1")
    shares["chat"] = shares.get("chat", 0.0) + max(rest, 0.0)
    return {k: v for k, v in shares.items() if v > 0}


def deal(shares: dict[str, float], count: int) -> list[str]:
    """The classes of requests 0..count-1: each goes to the class furthest behind its share so far
    (ties: the first listed), so every batch holds the mix as near as its size allows (copy:0.125:
    requests 3, 11, 19, ... copy)."""
    dealt = dict.fromkeys(shares, 0)
    out = []
    for i in range(count):
        name = max(shares, key=lambda k: shares[k] * (i + 1) - dealt[k])
        dealt[name] += 1
        out.append(name)
    return out


def _lookup(rng: random.Random, rates: tuple) -> int | None:
    """The drafts a lookup gets right one after another at `rates` (past the tuple: its last), None
    for half of those that get none right (no match found)."""
    n = 0
    while n < 16 and rng.random() < rates[min(n, len(rates) - 1)]:
        n += 1
    return None if n == 0 and rng.random() < 0.5 else n


def parse_bursty(text: str) -> tuple[float, float]:
    into, _, out_of = text.partition(":")
    try:
        pair = float(into), float(out_of)
    except ValueError:
        raise SystemExit(f"--bursty: {text!r} is not IN:OUT") from None
    if not all(0 < p < 1 for p in pair):
        raise SystemExit("--bursty: both probabilities must lie in (0, 1)")
    return pair


def implied_rates(accepts: dict[str, float]) -> list[float]:
    """Conditional acceptance per position as the static chains' accept lengths imply it (positions
    between two chains share one rate: the geometric fit of their gain)."""
    out, reach, before = [], 1.0, 1.0
    chains = [c for c in CHAINS if str(c) in accepts]
    low = 0
    for c in chains:
        gain, span = accepts[str(c)] - before, c - low  # sum over positions low+1..c of reach there
        rate = _fit_rate(reach, gain, span)
        for _ in range(span):
            reach *= rate
            out.append(rate)
        before, low = accepts[str(c)], c
    return out


def _fit_rate(reach: float, gain: float, span: int) -> float:
    """The r in [0, 1] with reach * (r + r^2 + ... + r^span) = gain (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        r = (lo + hi) / 2
        lo, hi = (r, hi) if reach * sum(r**k for k in range(1, span + 1)) < gain else (lo, r)
    return (lo + hi) / 2


def _request(run: int, i: int, matches: list[int | None], **more) -> SimpleNamespace:
    """Request i of a run: its answer as long as `matches`, the drafts a lookup gets right at each
    output position."""
    tokens = len(matches)
    params = SimpleNamespace(max_new_tokens=tokens)
    return SimpleNamespace(request_id=f"run{run}-r{i}", matches=matches, left=tokens, params=params, **more)


def by_batch(row: dict[int, float], batch: int) -> float:
    """`row` linear in batch between its measured sizes (past the last: along its last segment)."""
    sizes = sorted(row)
    i = min(max(bisect.bisect_left(sizes, batch), 1), len(sizes) - 1)
    lo, hi = sizes[i - 1], sizes[i]
    return max(row[lo] + (row[hi] - row[lo]) * (batch - lo) / (hi - lo), min(row.values()))


class Clock:
    """The H100's step ms for `workload`, and its requests' text."""

    def __init__(
        self,
        workload: str,
        seed: int,
        run: str = "sixth",
        jitter: float = 0.0,
        prefill_us: float = 1.5,
        transition: float = 0.5,
        first_ms: float = 5.0,
        mix: dict[str, float] | None = None,
        bursty: tuple[float, float] | None = None,
        flat_context: float | None = None,
        switch_settles: bool = False,
        replay: list[list[int | None]] | None = None,
        per_verify: bool = False,
        no_shadows: bool = False,
        off_loop: bool = False,
        switch_walls: float = 0.0,
        context_gap: float | None = None,
    ) -> None:
        # `--context-gap REF`: the loop's rows measured over contexts of REF tokens, its cost beyond
        # the profile per request (`GAP_FIXED_MS`, `CONTEXT_MS`) at the requests' own contexts
        self.context_gap = context_gap
        # `--switch-walls F`: at a switch of looped tier the step settling the old tier's last run
        # waits for F of the new tier's first run too, and the next step's wall lacks it (the H200,
        # mixed prompts, batch 64, 2-chain to plain: 18.8 and 7.7 ms where runs took ~11.5: F ~0.6)
        self.switch_walls = switch_walls
        self.no_shadows = no_shadows  # `--no-shadows`: the policy learns nothing while off but from probes
        # `--replay`: per request, the match lengths of real answers (`replay_matches`)
        self.replay = replay
        # `--per-verify`: acceptance counted per verify, as before the engine counted n-gram's per token
        self.per_verify = per_verify
        # `--flat-context`: the loop's attention priced as if every context had this many tokens
        self.flat_context = flat_context
        self.table, self.text, self.seed, self.jitter = H100[run][workload], TEXT[workload], seed, jitter
        self.mix, self.classes = mix, MIX[workload]  # `--mix`: the heterogeneous text model
        self.bursty = bursty  # `--bursty`: (chat -> copy, copy -> chat) per output position
        self.prompt, self.prefill_us, self.transition = PROMPT_TOKENS[workload], prefill_us, transition
        self.first_ms = first_ms
        self._seen: set[tuple[int, int, int]] = set()  # (engine, chain, batch) verified before
        self.loop = run in LOOPS  # chain tiers run in the device loop (`LOOPS`)
        self.loop_profile, self.loop_plain = LOOPS.get(run, (LOOP_PROFILE, LOOP_PLAIN))
        self.switch_settles = switch_settles  # a switch of chain tier starts a fresh run (the old loops)
        # `--off-loop`: plain decoding (static, and adaptive's off) runs in a device loop as well, as the
        # engine's n-gram off tier has since the twenty-sixth session
        self.off_loop = off_loop and self.loop

    def first_time(self, engine: object, drafts: int, batch: int) -> float:
        """Extra ms of an engine's first verify of this bucket at this batch (`first_ms`: a model of
        the one-off costs a process pays on a new shape; the bench keeps the faster of its repeats,
        so a static row hides them, and an adaptive engine meets them while it learns)."""
        chain = next((c for c in CHAINS if c >= drafts), CHAINS[-1])
        key = (id(engine), chain, batch)
        if key in self._seen:
            return 0.0
        self._seen.add(key)
        return self.first_ms

    def prefill_ms(self, batch: int) -> float:
        """The device time of one step prefilling `batch` prompts (a model: 0.5 ms and `prefill_us`
        a prompt token; the bench rows do not time it apart)."""
        return 0.5 + self.prefill_us * 1e-3 * self.prompt * batch

    def plain_ms(self, batch: int) -> float:
        return by_batch(self.loop_plain if self.loop else self.table["plain"], batch)

    def loop_ms(self, drafts: int, batch: int, context: float, profiled: bool = False) -> float:
        """A device-loop step of the chain whose bucket fits `drafts` over `batch` requests of
        `context` tokens on average (`profiled`: as the start-up profile times it, no context); no
        drafts: plain decoding's loop step."""
        chain = next((c for c in CHAINS if c >= drafts), CHAINS[-1]) if drafts else 0
        base = (
            by_batch({b: row[chain] for b, row in self.loop_profile.items()}, batch)
            if chain
            else self.plain_ms(batch)
        )
        if self.context_gap is not None:  # `base` measured over contexts of `context_gap` tokens

            def gap(tokens: float) -> float:
                return batch * (GAP_FIXED_MS + CONTEXT_MS * tokens)

            if profiled:
                return max(base - gap(self.context_gap), 0.5 * base)
            return base + gap(context) - gap(self.context_gap)
        if profiled:
            return base
        context = context if self.flat_context is None else self.flat_context
        return base + CONTEXT_MS * batch * (chain + 1) * context

    def chain_ms(self, drafts: int, batch: int, context: float = 0.0) -> tuple[float, float, float]:
        """(draft, target, postprocess) ms of a step whose widest draft is `drafts` deep (its bucket's
        chain); with the loop, a synchronous step (a probe): its loop step and the host's work."""
        if self.loop:
            return 0.0, self.loop_ms(drafts, batch, context) + SYNC_HOST_MS, 0.0
        chain = next((c for c in CHAINS if c >= drafts), CHAINS[-1])
        rows = self.table[chain]
        return tuple(by_batch({b: rows[b][i] for b in rows}, batch) for i in range(3))  # type: ignore[return-value]

    def profile_pass_ms(self, batch: int, query_len: int) -> float:
        if self.loop:  # a loop's step, as `cost_profile.time_loop_step`; plain without a loop: a decode pass
            if query_len == 1 and not self.off_loop:
                return PROFILE_SHARE * self.plain_ms(batch)
            return self.loop_ms(query_len - 1, batch, 0.0, profiled=True)
        return PROFILE_SHARE * self.chain_ms(max(query_len - 1, 1), batch)[1]

    def requests(self, batch: int, tokens: int, run: int) -> list[SimpleNamespace]:
        """Request i's text is the same in every run (common random numbers: every system, static or
        adaptive, meets the same matches): per output position, the drafts a lookup there would get
        right, None where it finds nothing (half the lookups without a right draft)."""
        if self.replay:
            return [
                _request(
                    run, i, self.replay[(self.seed + i) % len(self.replay)][:tokens], prompt_len=self.prompt
                )
                for i in range(batch)
            ]
        if self.bursty:
            return self._bursty_requests(batch, tokens, run)
        if self.mix:
            return self._mixed_requests(batch, tokens, run)
        reqs = []
        for i in range(batch):
            rng = random.Random(f"{self.seed}-{i}")
            short, short_follow, long, long_follow = self.text[i % len(self.text)]
            matches: list[int | None] = []
            for _ in range(tokens):
                draw = rng.random()
                follow = short_follow if draw < short else long_follow if draw < short + long else None
                n: int | None = None if follow is None and rng.random() < 0.5 else 0
                if follow is not None:
                    n = 1
                    while n < 16 and rng.random() < follow:
                        n += 1
                matches.append(n)
            reqs.append(_request(run, i, matches, prompt_len=self.prompt))
        return reqs

    def _mixed_requests(self, batch: int, tokens: int, run: int) -> list[SimpleNamespace]:
        """`requests` under `--mix`: request i of the class `deal` gives it (`text`: its name)."""
        assert self.mix is not None
        reqs = []
        for i, name in enumerate(deal(self.mix, batch)):
            rng = random.Random(f"{self.seed}-mix-{i}")
            rates = self.classes[name]
            matches: list[int | None] = []
            for _ in range(tokens):
                matches.append(_lookup(rng, rates))
            reqs.append(_request(run, i, matches, text=name, prompt_len=self.prompt))
        return reqs

    def _bursty_requests(self, batch: int, tokens: int, run: int) -> list[SimpleNamespace]:
        """`requests` under `--bursty`: each output position's drafts at the rates of the state the
        request is in there (chat or copy), the state a two-state chain along the answer."""
        assert self.bursty is not None
        into, out_of = self.bursty
        reqs = []
        for i in range(batch):
            rng = random.Random(f"{self.seed}-bursty-{i}")
            copying = rng.random() < into / (into + out_of)  # the chain's stationary share
            matches: list[int | None] = []
            for _ in range(tokens):
                copying = rng.random() >= out_of if copying else rng.random() < into
                matches.append(_lookup(rng, self.classes["copy" if copying else "chat"]))
            reqs.append(_request(run, i, matches, prompt_len=self.prompt))
        return reqs

    @staticmethod
    def accepted(req: SimpleNamespace, budget: int, made: int) -> int | None:
        """Drafts of `budget` that survive; None: the lookup found nothing (no draft at all)."""
        n = req.matches[min(made, len(req.matches) - 1)]
        return None if n is None else min(n, budget)


def profile(adaptive: AdaptiveSpeculation, clock: Clock) -> None:
    """As `cost_profile` does on the GPU: device passes of every tier's width at every graph batch
    (no host work) and the deepest tier's lookup (once per draft, whatever its depth)."""
    lens = sorted({t.query_len for t in adaptive.tiers})
    shapes = [(b, q) for b in GRAPH_BATCHES for q in lens]
    adaptive.costs.profile(VERIFY, shapes, lambda b, q: clock.profile_pass_ms(b, q) * MS)
    if clock.loop:  # the loop drafts on the device, in its step (`cost_profile.LOOP_DRAFT_SECONDS`)
        adaptive.costs.profile(DRAFT, [(b, 1) for b in GRAPH_BATCHES], lambda b, w: 1e-6)
        return
    adaptive.costs.profile(DRAFT, [(b, 1) for b in GRAPH_BATCHES], lambda b, w: clock.chain_ms(8, b)[0] * MS)


def run(
    adaptive: AdaptiveSpeculation, clock: Clock, batch: int, tokens: int, static: Tier | None, tag: int
) -> tuple[float, float]:
    """One bench run: `batch` requests of `tokens` tokens each; tokens/s and the accept length
    (accepted drafts + 1 per verify, as the bench counts it).

    The engine's pipeline, as `Engine.step` runs it: a plain step is launched, then the one before it
    settled, so its wall is the wait for the step in flight (a whole plain step in a row of them, a
    prefill's device time after one, its launch alone after a synchronous step); a speculative step
    first settles the plain step in flight (its `settle` phase) and, after plain steps, pays
    `clock.transition` of its own step more (the sixth run's probes cost 1.5x its static steps). The
    run starts with the prefill of every prompt, overlapped where the standing tier is off, and ends
    with a step that settles the last plain step."""
    reqs = clock.requests(batch, tokens, tag)
    made = {r.request_id: 0 for r in reqs}
    for req in reqs:
        req.num_output = 0
    verifies = accepted_drafts = 0
    noise = random.Random(f"{clock.seed}-jitter-{tag}")
    # the prefill: every prompt in one step, which samples each request's first token
    if static is None:
        adaptive.decide([])  # nobody decodes yet: the standing tier stays
    overlapped = (static or adaptive.tier).off
    prefill = clock.prefill_ms(batch)
    ms, inflight = (LAUNCH_MS, prefill) if overlapped else (prefill, 0.0)
    if static is None:
        stats = StepStats()
        stats.phases = {"step": ms * MS}
        items = [
            SimpleNamespace(num_known=clock.prompt, completes=True, num_tokens=clock.prompt) for _ in reqs
        ]
        adaptive.observe_step(items, stats)
    for req in reqs:
        req.left -= 1
        made[req.request_id] = req.num_output = 1
    total, seconds = batch, ms * MS
    looped: tuple[Tier, int] | None = None  # the loop run before: its tier and rows (a run resumes it)
    pending: tuple[Tier, LoopSample] | None = None  # a resumed run not yet observed (`observe_sample`)
    shadows = Shadows(adaptive, clock) if static is None else None
    while reqs:
        # step-to-step noise of the wall clock (host jitter), the same sequence for every system
        jitter = math.exp(clock.jitter * noise.gauss(0.0, 1.0) - clock.jitter**2 / 2)
        if static is None:
            shadows.score(reqs, made)
            settings = adaptive.decide(reqs)
            tier = adaptive.tier
            shadows.start(reqs, made, tier.off)
        else:
            tier = static
            adaptive.tier, adaptive._steps = tier, dict.fromkeys((r.request_id for r in reqs), tier.num_steps)
            settings = SimpleNamespace(num_steps=tier.num_steps)
        n, stats, emitted_of = len(reqs), StepStats(), {}
        if clock.loop and (clock.off_loop or not tier.off) and (static is not None or not adaptive.probing):
            # a run goes on over the rows of the one before while more than 1/CARRY_SHARE of them run
            # (`device_loop.carries`: finished requests' rows run idle), else a fresh one over these
            # (`DeviceLoop.follows`: a switch of chain tier too, unless `switch_settles`)
            same = looped is not None and (looped[0] == tier or not clock.switch_settles)
            resumed = same and CARRY_SHARE * n > looped[1]
            rows = looped[1] if resumed else n
            ms, got, acc, sample = loop_run(
                adaptive, clock, reqs, made, tier, rows, resumed and static is None, jitter
            )
            # the step settling the run before this one, launched behind it: at a switch of chain
            # length the walls split `--switch-walls` of this run's time wrongly between the two
            switched = pending is not None and pending[0] != tier
            if pending is not None:
                extra = clock.switch_walls * ms / LOOP_RUN if switched and sample is not None else 0.0
                pending[1].step += extra
                observe_sample(adaptive, pending[1], switched)
            pending = None
            if sample is not None:
                if switched:
                    sample.step *= 1.0 - clock.switch_walls
                    sample.after_switch = True
                pending = (tier, sample)
            if not resumed:
                setup = FRESH_MS + SETUP_MS * n
                ms += setup
                if static is None:  # the engine times every fresh run's setup (`Engine._loop_step`)
                    adaptive.observe_setup(n, setup * MS)
            ms += inflight  # the plain step in flight settles first
            verifies, accepted_drafts = verifies + got, accepted_drafts + acc
            inflight, looped = 0.0, (tier, rows)
            total += sum(r.num_output - made[r.request_id] for r in reqs)
            seconds += ms * MS
            for req in reqs:
                made[req.request_id] = req.num_output
                req.left = req.params.max_new_tokens - req.num_output
            for req in [r for r in reqs if r.left <= 0]:
                adaptive.forget(req.request_id)
            reqs = [r for r in reqs if r.left > 0]
            continue
        looped = None
        if pending is not None:
            observe_sample(adaptive, pending[1], False)
            pending = None
        if settings.num_steps == 0:
            ms = max(inflight, LAUNCH_MS)  # launched, then the wait for the step in flight
            inflight = clock.plain_ms(n) * jitter
            stats.phases = {"step": ms * MS, "draft": 0.0}
            emitted_of = dict.fromkeys((r.request_id for r in reqs), 1)
            items = [SimpleNamespace(num_known=1, completes=True, num_tokens=1) for _ in reqs]
        else:
            settle, inflight, deepest, items = inflight, 0.0, 0, []
            for req in reqs:
                budget = min(adaptive.steps_for(req), req.left - 1)
                accepted, proposed = 0, 0
                if budget > 0:
                    adaptive.drafting(req, budget)
                    found = clock.accepted(req, budget, made[req.request_id])
                    proposed = budget if found is not None else 0
                    accepted = found or 0
                    adaptive.observe_verify(req, accepted)
                verifies, accepted_drafts = verifies + 1, accepted_drafts + accepted
                deepest = max(deepest, proposed)
                emitted_of[req.request_id] = accepted + 1
                items.append(SimpleNamespace(num_known=1, completes=True, num_tokens=proposed + 1))
            draft, target, post = (jitter * t for t in clock.chain_ms(max(deepest, 1), n))
            if settle:  # leaving the overlapped pipeline
                target += clock.transition * (draft + target + post)
            target += clock.first_time(adaptive, max(deepest, 1), n)
            ms = settle + draft + target + post
            stats.phases = {
                "step": ms * MS,
                "draft": draft * MS,
                "settle": settle * MS,
                "target": target * MS,
                "postprocess": post * MS,
            }
            if not settle:
                del stats.phases["settle"]
        for req in reqs:
            got = min(emitted_of[req.request_id], req.left)
            req.left -= got
            made[req.request_id] += got
            req.num_output = made[req.request_id]
            total += got
        stats.generation_tokens = sum(emitted_of.values())
        if static is None:
            adaptive.observe_step(items, stats, any(r.left <= 0 for r in reqs))
        seconds += ms * MS
        for req in [r for r in reqs if r.left <= 0]:
            adaptive.forget(req.request_id)
        reqs = [r for r in reqs if r.left > 0]
    if pending is not None:
        observe_sample(adaptive, pending[1], False)
    seconds += inflight * MS  # the last step: it settles the plain step still in flight
    if static is None and hasattr(adaptive, "idle"):
        adaptive.idle()
    return total / seconds, (accepted_drafts + verifies) / verifies if verifies else 0.0


class Shadows:
    """The engine's shadow drafts while off (`specserve/spec/shadow.py`): each step up to
    `shadow_lookups` requests without one (round-robin) get a lookup of the deepest chain anchored
    at their known tokens, scored once the tokens that decide it are known (a miss, or every draft
    right). Without them the simulated policy learnt nothing while off but from probes."""

    def __init__(self, adaptive: AdaptiveSpeculation, clock: Clock) -> None:
        self.adaptive, self.clock = adaptive, clock
        self.depth = max(t.num_steps for t in adaptive.tiers if not t.off)
        # per plain step, as the engine's (`AdaptiveSpeculation.use_shadow`): a run's worth a loop step off
        per_step = LOOP_RUN if clock.off_loop else 1
        self.lookups = adaptive._shadow_lookups * per_step if not clock.no_shadows else 0
        self.open: dict[str, tuple[int, int]] = {}  # request id -> (decided at output, accepted)
        self.turn = 0

    def score(self, reqs: list[SimpleNamespace], made: dict[str, int]) -> None:
        for req in reqs:
            decided = self.open.get(req.request_id)
            if decided is not None and made[req.request_id] >= decided[0]:
                del self.open[req.request_id]
                self.adaptive.acceptance.observe(
                    req.request_id, 1, self.depth, decided[1], len(reqs), shadow=True
                )

    def start(self, reqs: list[SimpleNamespace], made: dict[str, int], off: bool) -> None:
        if not off or self.adaptive.policy.hopeless or not self.lookups:
            self.open.clear()
            return
        idle = [r for r in reqs if r.request_id not in self.open]
        if not idle:
            return
        first = self.turn % len(idle)
        self.turn += 1
        for req in (idle[first:] + idle[:first])[: self.lookups]:
            at = made[req.request_id]
            accepted = self.clock.accepted(req, self.depth, at) or 0
            self.open[req.request_id] = (at + min(accepted + 1, self.depth), accepted)


SETTINGS: dict = {}  # adaptive settings beyond the defaults (`--setting`)
# A loop run not queued behind one: the host's turn between runs (launch, settle) and the run's setup
# per request (histories, page tables: the H200's fresh runs took ~1.3 ms at batch 16, ~4.5 at 64).
FRESH_MS = 0.3
SETUP_MS = 0.065


def loop_run(
    adaptive: AdaptiveSpeculation,
    clock: Clock,
    reqs: list[SimpleNamespace],
    made: dict[str, int],
    tier: Tier,
    rows: int,
    resumed: bool,
    jitter: float,
) -> tuple[float, int, int]:
    """A device-loop run of `tier` over `reqs`, as `Engine._loop_step` settles it: `LOOP_RUN` verifies
    (a request that reached its end stays in the run, appending nothing), each fed to the estimates
    (`observe_chain`), the run's step ms to the cost tables and its tokens to its tier's correction
    when it was queued behind one of its own (`observe_loop`, `observe_run`), priced at its `rows`
    (finished requests' rows carried idle). Its ms, verifies and accepted drafts; each request's
    `num_output` moves on."""
    n, k = len(reqs), tier.num_steps
    verifies = accepted_drafts = 0
    before = sum(r.num_output for r in reqs)
    for _ in range(LOOP_RUN):
        for req in reqs:
            left = req.params.max_new_tokens - req.num_output
            if left <= 0:
                continue
            depth = min(k, left - 1)
            found = clock.accepted(req, depth, req.num_output) if depth > 0 else 0
            accepted = found or 0
            if depth > 0:
                adaptive.observe_chain(req, depth, accepted, n)
            if k:  # plain decoding's loop verifies nothing
                verifies, accepted_drafts = verifies + 1, accepted_drafts + accepted
            req.num_output += accepted + 1
    context = clock.prompt + sum(min(r.num_output, r.params.max_new_tokens) for r in reqs) / n
    step = clock.loop_ms(k, rows, context) * jitter
    for req in reqs:
        req.num_output = min(req.num_output, req.params.max_new_tokens)
    observed = None
    if resumed:
        ended = any(r.num_output >= r.params.max_new_tokens for r in reqs)
        observed = LoopSample(rows, k, step, context, sum(r.num_output for r in reqs) - before, ended)
    adaptive.idle()
    return LOOP_RUN * step, verifies, accepted_drafts, observed


@dataclass
class LoopSample:
    """A resumed loop run as the engine observes it, once the step after it has launched the next
    run (`Engine._observe_loop`): its rows, chain, ms an iteration (what the step's wall will show),
    context, tokens and whether it ended a request; `after_switch`: it followed another tier's run."""

    rows: int
    k: int
    step: float
    context: float
    emitted: int
    ended: bool
    after_switch: bool = False


def observe_sample(adaptive: AdaptiveSpeculation, sample: LoopSample, before_switch: bool) -> None:
    """`sample` into the cost tables and corrections, as `Engine._observe_loop` does (a run next to a
    switch of chain length not steady unless `switch_runs_priced`)."""
    steady = adaptive.steady_run(sample.after_switch, before_switch)
    adaptive.observe_loop(sample.rows, sample.k, sample.step * MS, sample.context, steady=steady)
    seconds = LOOP_RUN * sample.step * MS
    adaptive.observe_run(sample.rows, sample.k, sample.emitted, seconds, sample.ended, steady)


def new_adaptive(clock: Clock) -> AdaptiveSpeculation:
    settings = {"profile": False, **SETTINGS}
    spec = SpeculativeConfig.from_value({"method": "ngram", "num_steps": 8, "adaptive": settings})
    adaptive = AdaptiveSpeculation(spec)
    adaptive.acceptance.per_token = not clock.per_verify  # as the engine counts n-gram drafting's
    adaptive.overlapped_off = not clock.off_loop  # as `Engine` sets it: off's loop steps price it
    adaptive.shapes = VerifyShapes(
        tuple(sorted({t.query_len for t in adaptive.tiers})), GRAPH_BATCHES[-1], GRAPH_BATCHES
    )
    if clock.loop:
        adaptive.looped_chains = frozenset(t.num_steps for t in adaptive.tiers if clock.off_loop or not t.off)
        if clock.switch_settles:
            adaptive.policy.switch_on_device = frozenset()
    profile(adaptive, clock)
    return adaptive


def replay_matches(dataset: str, prompts: int, tokens: int) -> list[list[int | None]]:
    """Per answer to `dataset`'s prompts (greedy SmolLM2-135M-Instruct on the CPU, the first `prompts`,
    `tokens` tokens, EOS ignored), per output position the drafts an n-gram lookup there
    (`NgramDrafter` with the engine's match lengths) gets right, None where it finds nothing. Real
    text comes in stretches: a long match runs on through a repeated passage, none outside one
    (`specserve/spec/acceptance.py`). Cached under ~/.cache/specserve/sim/."""
    import numpy as np

    from specserve import LLM, SamplingParams
    from specserve.bench_data import prompt_texts
    from specserve.spec.ngram import NgramDrafter

    name = "replay" if dataset == "mt-bench" else f"replay-{dataset}"
    cache = Path.home() / ".cache" / "specserve" / "sim" / f"{name}-{prompts}x{tokens}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    config = SpeculativeConfig(method="ngram")
    lookup = NgramDrafter(config.ngram_min_match, config.ngram_max_match)
    llm = LLM("smollm2-135m-instruct", device="cpu", dtype="float32")
    chats = [llm._chat_ids([{"role": "user", "content": t}]) for t in prompt_texts(dataset, seed=0)[:prompts]]
    outs = llm.generate(chats, SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True))
    matches = []
    for prompt, out in zip(chats, outs, strict=True):
        seq = np.array(prompt + out.token_ids, dtype=np.int64)
        row: list[int | None] = []
        for at in range(len(prompt), len(seq)):
            draft = lookup.propose(seq[:at], 16)
            n = 0
            while n < len(draft) and at + n < len(seq) and seq[at + n] == draft[n]:
                n += 1
            row.append(n if draft else None)
        matches.append(row)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(matches))
    return matches


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(TEXT), default="mixed")
    parser.add_argument(
        "--run",
        choices=sorted(H100),
        default="sixth",
        help="which GPU run clocks the steps (h200: the H200's loop)",
    )
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        help="sigma of each step's log-normal noise (0.15: p90 = 1.2 x p50)",
    )
    parser.add_argument(
        "--prefill-us", type=float, default=1.5, help="device us per prompt token of a run's prefill step"
    )
    parser.add_argument(
        "--first-ms", type=float, default=5.0, help="extra ms of an engine's first verify of a shape"
    )
    parser.add_argument(
        "--transition",
        type=float,
        default=0.5,
        help="what a speculative step after plain steps pays beyond its settle, as a share of its step",
    )
    parser.add_argument(
        "--mix",
        help="heterogeneous text (`MIX`): each request's class by these shares, the rest chat "
        "(copy:0.125 fits MT-Bench, copy:0.25 mixed); left out, the default text model (`TEXT`)",
    )
    parser.add_argument(
        "--bursty",
        metavar="IN:OUT",
        help="stretches of copying inside each request: per output position, chat turns to copying "
        "with probability IN and back with OUT (`MIX`'s two classes' rates)",
    )
    parser.add_argument(
        "--flat-context",
        type=float,
        metavar="TOKENS",
        help="a loop step's cost beyond its profile as if every context had TOKENS tokens: no growth "
        "with the context (the H200's loop iterations on MT-Bench, batch 16 and 64: flat from 150 to 330)",
    )
    parser.add_argument(
        "--context-gap",
        type=float,
        metavar="REF",
        help="with --run h200: its loop rows taken as measured over contexts of REF tokens; a loop step's "
        "cost beyond its profile per request, a fixed part and one per context token, whatever the chain "
        "(the H200's traces on mixed prompts at batch 64); the profile is the rows less that at REF",
    )
    parser.add_argument(
        "--replay",
        type=int,
        metavar="PROMPTS",
        help="the text model of real answers: the workload's first PROMPTS prompts (MT-Bench, or mixed: "
        "`specserve.bench_data`) answered on the CPU (cached), their n-gram match lengths position by "
        "position (`replay_matches`)",
    )
    parser.add_argument(
        "--no-shadows",
        action="store_true",
        help="no shadow drafts while off (as this simulator ran before it had them)",
    )
    parser.add_argument(
        "--per-verify",
        action="store_true",
        help="acceptance counted per verify (the engine before it counted n-gram drafting per token)",
    )
    parser.add_argument(
        "--switch-settles",
        action="store_true",
        help="with --run twelfth: a switch between chain tiers settles the run in flight and sets up a "
        "fresh one (the loops before they shared the requests' state), priced so by the policy",
    )
    parser.add_argument(
        "--off-loop",
        action="store_true",
        help="with a loop run (twelfth, h200): plain decoding in a device loop too, static and adaptive's "
        "off tier alike, as the engine runs n-gram drafting's",
    )
    parser.add_argument(
        "--switch-walls",
        type=float,
        default=0.0,
        metavar="F",
        help="at a switch of looped tier, the step settling the old tier's last run also waits F of the "
        "new tier's first run, and the next step's wall lacks it (the H200's mixed batch 64: ~0.6)",
    )
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an adaptive setting (`speculative.adaptive`), its value as JSON, e.g. hysteresis=0.1",
    )
    args = parser.parse_args()
    for item in args.setting:
        name, _, value = item.partition("=")
        SETTINGS[name] = json.loads(value)
    mix = parse_mix(args.mix, args.workload) if args.mix else None
    bursty = parse_bursty(args.bursty) if args.bursty else None
    clock = Clock(
        args.workload,
        args.seed,
        args.run,
        args.jitter,
        args.prefill_us,
        args.transition,
        args.first_ms,
        mix,
        bursty,
        args.flat_context,
        args.switch_settles,
        replay_matches(args.workload, args.replay, args.tokens) if args.replay else None,
        args.per_verify,
        args.no_shadows,
        args.off_loop,
        args.switch_walls,
        args.context_gap,
    )
    gpu, accept = H100[args.run][args.workload]["tok/s"], ACCEPT[args.workload]
    chip = (
        "H200" if args.run == "h200" else "H100"
    )  # whose rows stand beside the figures (accepts: the H100's)
    statics = (OFF, *(Tier.chain(c) for c in CHAINS))
    # one engine per system for every batch size, each warmed up first, as the bench runs them
    adaptive = new_adaptive(clock)
    run(adaptive, clock, 2, WARMUP_TOKENS, None, -1)  # two prompts, a few tokens
    engines = {tier: new_adaptive(clock) for tier in statics}
    for tier, engine in engines.items():
        run(engine, clock, 2, WARMUP_TOKENS, tier, -1)
    missed, tag = 0, 0
    for batch in [int(b) for b in args.batches.split(",")]:
        rates, accepts = {}, {}
        for tier in statics:
            tag += 1
            rates[tier.name], accepts[tier.name] = run(engines[tier], clock, batch, args.tokens, tier, tag)
        before = dict(adaptive.tier_steps)
        runs = []
        for _ in range(args.repeats):
            tag += 1
            runs.append(run(adaptive, clock, batch, args.tokens, None, tag)[0])
        rate = max(runs)
        best = max(rates, key=rates.get)
        ratio, plain = rate / rates[best], rate / rates["off"]
        ok = ratio >= 0.97 and (batch != 64 or plain >= 0.95) and (args.workload != "mixed" or ratio > 1.0)
        missed += not ok
        used = {
            t.name: n - before.get(t, 0)
            for t, n in sorted(adaptive.tier_steps.items())
            if n - before.get(t, 0)
        }
        print(
            f"b{batch}: "
            + " ".join(f"{k} {v:,.0f} ({chip} {gpu[k][batch]:,})" for k, v in rates.items())
            + "\n  accept "
            + " ".join(f"{k} {accepts[k]:.2f} (H100 {accept[k][batch]:.2f})" for k in accept)
            + f"\n  adaptive {rate:,.0f} ({chip} {gpu['adaptive'][batch]:,}) = {ratio:.2f}x best ({best}), "
            + f"{plain:.2f}x plain  {'ok' if ok else 'MISSED'}; steps per tier {used}"
        )
        d = adaptive.diagnostics(batch)
        if clock.loop:  # a loop step halfway through a request (its context: the prompt and half the answer)
            mid = clock.prompt + args.tokens / 2
            real = {"off": clock.plain_ms(batch), **{str(c): clock.loop_ms(c, batch, mid) for c in CHAINS}}
        else:
            real = {"off": clock.plain_ms(batch), **{str(c): sum(clock.chain_ms(c, batch)) for c in CHAINS}}
        print(
            f"  predicted ms/step at b{batch}: {d['step_ms']}; the clock's (steady): "
            + str({k: round(v, 3) for k, v in real.items()})
        )
        if "steady_step_ms" in d:
            print(
                f"  measured at b{batch}: steady {d['steady_step_ms']}, transitions {d['transition_step_ms']}"
            )
        if d.get("calibration"):
            print(f"  corrections (measured / predicted tokens, TIER@BATCH): {d['calibration']}")
        if mix or bursty:  # what the policy reads (the pool: a request's own counts shrink to it)
            pooled, tested = d["pooled_acceptance"][1], d["pooled_tested"][1]
            implied = implied_rates({k: v for k, v in accepts.items() if k != "off"})
            print(f"  implied by the static rows at b{batch}: {' '.join(f'{r:.2f}' for r in implied)}")
            print(
                f"  pooled acceptance at b{batch}: {' '.join(f'{r:.2f}' for r in pooled)} (tested "
                + " ".join(f"{t:.0f}" for t in tested)
                + "); classes: "
                + ", ".join(
                    f"{name} {' '.join(f'{r:.2f}' for r in (*rates, *[rates[-1]] * (8 - len(rates))))}"
                    for name, rates in clock.classes.items()
                    if bursty or name in mix
                )
            )
    print("all targets met" if not missed else f"{missed} target(s) missed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
