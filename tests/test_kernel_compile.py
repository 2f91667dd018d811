"""The fast-path kernels compile for Hopper (sm_90) on a machine without a GPU.

The interpreter the other kernel tests use skips the GPU compiler entirely, so type errors and
unsupported constructs that only it rejects would first show on the GPU machine. Triton compiles
ahead of time for a named target with the ptxas it bundles, no driver needed; this does so for one
variant of each kernel (the SmolLM2 shapes: decode tile with split-K and a tree mask, prefill tile,
RoPE + KV write, residual add + RMSNorm, the fused linear and q/k/v kernels in
their tile and GEMV forms, the device loop's glue, sampling's race draw), in a subprocess because this process's triton runs in interpreter mode.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specserve_kernels import fused_linear as fl, loop_glue as lg, paged_attention as pa, rms_norm as rn, rope_store as rs
    from specserve_kernels import race_draw as rd

    FLOATS = {"scale_log2", "eps"}

    def compile_(kernel, pointers, constexprs, num_warps=4):
        params = kernel.params
        signature = {}
        for p in params:
            if p.is_constexpr:
                signature[p.name] = "constexpr"
            elif p.name.endswith("_ptr"):
                signature[p.name] = pointers.get(p.name, pointers["default"])
            else:
                signature[p.name] = "fp32" if p.name in FLOATS else "i32"
        names = [p.name for p in params]
        consts = {(names.index(k),): v for k, v in constexprs.items()}
        src = ASTSource(fn=kernel, signature=signature, constexprs=consts)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})

    ints = {n: "*i64" for n in ("query_start_ptr", "seq_lens_ptr", "page_table_ptr", "positions_ptr", "slots_ptr")}
    attn = {"default": "*bf16", "mask_ptr": "*u8", "counter_ptr": "*i32", **{n: "*fp32" for n in ("part_o_ptr", "part_m_ptr", "part_l_ptr")}}
    common = dict(GROUP=3, HEAD_DIM=64, BLOCK_D=64, PRECISION="tf32", UPCAST=False)
    decode = dict(PAGE_SIZE=16, BLOCK_M=16, BLOCK_Q=5, BLOCK_N=64, SPLIT=True, CUSTOM_MASK=True)
    prefill = dict(PAGE_SIZE=1, BLOCK_M=128, BLOCK_Q=42, BLOCK_N=64, SPLIT=False, CUSTOM_MASK=False)
    compile_(pa._paged_attention_kernel, {**attn, **ints}, {**common, **decode})
    compile_(pa._paged_attention_kernel, {**attn, **ints}, {**common, **prefill}, num_warps=8)
    rope = dict(HALF=32, BLOCK_H=16, BLOCK_KH=4, BLOCK_HALF=32, ROPE=True)
    compile_(rs._rope_kv_store_kernel, {"default": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", **ints}, rope, 1)
    compile_(rn._add_rms_norm_kernel, {"default": "*bf16"}, dict(HAS_RESIDUAL=True, BLOCK=1024))
    blocks = dict(PRECISION="tf32", UPCAST=False, BLOCK_M=16, BLOCK_K=128, ONE_CHUNK=False)
    flags = dict(NORM=True, BIAS=False, RESIDUAL=False)
    compile_(fl._fused_linear_kernel, {"default": "*bf16"}, {**blocks, **flags, "GATED": True, "BLOCK_N": 32})
    compile_(fl._fused_linear_kernel, {"default": "*bf16"}, {**blocks, "NORM": False, "BIAS": False, "RESIDUAL": True, "GATED": False, "BLOCK_N": 16})
    qkv = {"default": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", **ints}
    compile_(fl._qkv_rope_store_kernel, qkv, {**blocks, "NORM": True, "BIAS": True, "HALF": 32, "BLOCK_HALF": 32})
    compile_(fl._qkv_rope_store_kernel, qkv, {**blocks, "BLOCK_K": 1024, "ONE_CHUNK": True, "NORM": True, "BIAS": False, "HALF": 32, "BLOCK_HALF": 16})
    compile_(fl._fused_linear_kernel, {"default": "*bf16"}, {**blocks, **flags, "BLOCK_K": 256, "GATED": True, "BLOCK_N": 32})
    gemv = dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024, ONE_CHUNK=True, ALL_ROWS=False)
    compile_(fl._fused_gemv_kernel, {"default": "*bf16"}, {**gemv, **flags, "GATED": True}, 4)
    chunked = dict(BLOCK_M=4, BLOCK_N=2, BLOCK_K=512, ONE_CHUNK=False, ALL_ROWS=False)
    all_rows = dict(BLOCK_M=8, BLOCK_N=2, BLOCK_K=1024, ONE_CHUNK=True, ALL_ROWS=True)
    compile_(fl._fused_gemv_kernel, {"default": "*bf16"}, {**all_rows, **flags, "GATED": True}, 4)
    compile_(fl._qkv_gemv_kernel, qkv, {**all_rows, "NORM": True, "BIAS": False, "HALF": 32}, 4)
    compile_(fl._fused_gemv_kernel, {"default": "*bf16"}, {**chunked, **flags, "RESIDUAL": True, "BIAS": True, "GATED": False}, 2)
    compile_(fl._qkv_gemv_kernel, qkv, {**gemv, "NORM": True, "BIAS": True, "HALF": 32}, 2)
    compile_(fl._qkv_gemv_kernel, qkv, {**chunked, "NORM": True, "BIAS": False, "HALF": 32}, 2)
    glue = {"default": "*i64", "valid_ptr": "*u8"}
    compile_(lg._loop_prepare_kernel, glue, dict(NUM_STEPS=5, MIN_MATCH=1, MAX_MATCH=4, PAGE_SIZE=16, BLOCK=1024, BLOCK_Q=8, LOOKUP=True))
    compile_(lg._loop_prepare_kernel, glue, dict(NUM_STEPS=5, MIN_MATCH=1, MAX_MATCH=4, PAGE_SIZE=16, BLOCK=1024, BLOCK_Q=8, LOOKUP=False))
    compile_(lg._loop_accept_kernel, glue, dict(NUM_STEPS=5, NUM_STOPS=8, BLOCK_Q=8, BLOCK_S=8), 1)
    race = {"default": "*i64", "probs_ptr": "*fp32", "best_ptr": "*fp64"}
    compile_(rd._race_slices_kernel, race, dict(SPLITS=8, BLOCK=1024))
    compile_(rd._race_pick_kernel, race, dict(SPLITS=8, BLOCK_S=8), 1)
    print("compiled")
    """
)


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # this process's view of the packages
    result = subprocess.run(
        [sys.executable, "-P", "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]
