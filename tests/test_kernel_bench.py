"""GPU micro-benchmarks of the fast-path kernels against what the torch path runs, at SmolLM2-135M
shapes (bf16, 9 query / 3 KV heads of 64, hidden 576), batch 1 and 64, context 512 and 2048.

Prints microseconds per call, never asserts them. Two figures per row: `eager`, a plain call as the
engine makes it today (for launch-bound calls this is mostly CPU launch time), and `graph`, the same
call replayed from a CUDA graph (the GPU time left once item 2's graphs remove the launches).
Run: `pytest -m gpu -s tests/test_kernel_bench.py`.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_kernel_paged_attention import make_case

from specserve import SamplingParams
from specserve.attention.flash_backend import FlashAttentionBackend, flash_available
from specserve.attention.torch_backend import TorchAttentionBackend
from specserve.attention.triton_backend import TritonAttentionBackend
from specserve.config import CacheConfig, EngineConfig
from specserve.engine.engine import Engine
from specserve.engine.kv_cache import KVCache
from specserve.engine.request import Request
from specserve.engine.scheduler import ScheduledItem
from specserve.engine.step_input import build_step_input
from specserve.model.arch import ModelArch
from specserve.model.layers import RotaryEmbedding
from specserve.model.loader import load_model
from specserve_kernels.paged_attention import num_splits, paged_attention
from specserve_kernels.rms_norm import add_rms_norm, add_rms_norm_ref
from specserve_kernels.rope_store import rope_kv_store, rope_kv_store_ref

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, DIM, HIDDEN = 9, 3, 64, 576
DTYPE = torch.bfloat16
SHAPES = [(1, 512), (1, 2048), (64, 512), (64, 2048)]  # (batch, context)


def _us(fn) -> tuple[float, float]:
    import triton.testing

    eager = triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3
    try:
        graph = triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3
    except Exception:  # a call that cannot be captured (a host sync)
        graph = math.nan
    return eager, graph


def _row(name: str, ours: tuple[float, float], torch_path: tuple[float, float]) -> None:
    speedup = torch_path[1] / ours[1] if ours[1] == ours[1] and torch_path[1] == torch_path[1] else math.nan
    print(
        f"{name:44s} triton eager {ours[0]:8.1f} graph {ours[1]:8.1f} | torch eager {torch_path[0]:8.1f} "
        f"graph {torch_path[1]:8.1f} us | graph speedup x{speedup:.2f}"
    )


def _arch() -> ModelArch:
    return ModelArch(
        vocab_size=8,
        hidden_size=HIDDEN,
        intermediate_size=8,
        num_layers=1,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        max_position=8192,
    )


def _layer_timings(backends, batch: int, context: int, query_len: int, page_size: int) -> dict:
    """Microseconds (eager, graph) of one layer's `attend_rotary` (RoPE + KV write + paged attention)
    per backend name, over the same cache and inputs."""
    case = make_case(
        [context - query_len] * batch, [query_len] * batch, HEADS, KV_HEADS, DIM, page_size, DTYPE
    )
    kv = KVCache(case.k_cache[None], case.v_cache[None], page_size)
    rope = RotaryEmbedding(_arch()).cuda()
    tokens = batch * query_len
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, device="cuda", dtype=DTYPE, generator=g)
    q, k, v = (x.view(tokens, -1, DIM) for x in qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], -1))
    positions = (case.batch.seq_lens - query_len).repeat_interleave(query_len) + torch.arange(
        query_len, device="cuda"
    ).repeat(batch)
    figures = {}
    for backend in backends:
        ctx = backend.prepare(case.batch, kv)
        figures[backend.name] = _us(lambda ctx=ctx: ctx.attend_rotary(0, q, k, v, positions, rope))
    return figures


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("query_len", [1, 5], ids=["decode", "verify5"])
@pytest.mark.parametrize(("batch", "context"), SHAPES)
def test_bench_attention_layer(batch, context, query_len, page_size):
    """One layer's attention as each backend runs it: RoPE + KV write + paged attention."""
    figures = _layer_timings(
        (TritonAttentionBackend(), TorchAttentionBackend()), batch, context, query_len, page_size
    )
    splits = num_splits(batch, query_len, context, KV_HEADS, HEADS // KV_HEADS, torch.device("cuda"))
    name = f"attention B={batch} ctx={context} q={query_len} page={page_size} splits={splits}"
    _row(name, figures["triton"], figures["torch"])


@pytest.mark.parametrize("query_len", [1, 5], ids=["decode", "verify5"])
@pytest.mark.parametrize(("batch", "context"), SHAPES)
def test_bench_flash_attention_layer(batch, context, query_len):
    """The same layer through the optional vllm-flash-attn backend against ours (page 16); skipped with
    the reason when the library does not import against this torch."""
    ok, why = flash_available()
    if not ok:
        pytest.skip(why)
    figures = _layer_timings(
        (FlashAttentionBackend(), TritonAttentionBackend()), batch, context, query_len, 16
    )
    flash, ours = figures["flash"], figures["triton"]
    print(
        f"attention B={batch} ctx={context} q={query_len} page=16: flash ({why}) eager {flash[0]:8.1f} "
        f"graph {flash[1]:8.1f} | triton eager {ours[0]:8.1f} graph {ours[1]:8.1f} us"
    )


@pytest.mark.parametrize(("batch", "context"), SHAPES)
def test_bench_attention_kernel_alone(batch, context):
    """Decode attention only (the cache already written), with and without split-K."""
    case = make_case([context - 1] * batch, [1] * batch, HEADS, KV_HEADS, DIM, 16, DTYPE)
    chosen = num_splits(batch, 1, context, KV_HEADS, HEADS // KV_HEADS, case.q.device)
    one = _us(lambda: paged_attention(*case.args(), splits=1))
    split = _us(lambda: paged_attention(*case.args(), splits=chosen))
    print(
        f"paged_attention decode B={batch} ctx={context}: 1 slice eager {one[0]:.1f} graph {one[1]:.1f} us; "
        f"{chosen} slices eager {split[0]:.1f} graph {split[1]:.1f} us"
    )


@pytest.mark.parametrize("tokens", [512, 2048])
def test_bench_prefill_attention(tokens):
    """A whole prompt in one step (causal), batch 1."""
    case = make_case([0], [tokens], HEADS, KV_HEADS, DIM, 16, DTYPE)
    kv = KVCache(case.k_cache[None], case.v_cache[None], 16)
    k_new, v_new = kv.k[0, case.batch.slot_mapping].clone(), kv.v[0, case.batch.slot_mapping].clone()
    results = []
    for backend in (TritonAttentionBackend(), TorchAttentionBackend()):
        ctx = backend.prepare(case.batch, kv)
        results.append(_us(lambda ctx=ctx: ctx.attend(0, case.q, k_new, v_new)))
    _row(f"prefill attention B=1 tokens={tokens}", *results)


@pytest.mark.parametrize("tokens", [1, 64, 320])
def test_bench_rope_kv_store(tokens):
    g = torch.Generator(device="cuda").manual_seed(1)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, device="cuda", dtype=DTYPE, generator=g)
    q, k, v = (x.view(tokens, -1, DIM) for x in qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], -1))
    cache = torch.zeros(2, 4096, KV_HEADS, DIM, device="cuda", dtype=DTYPE)
    slots = torch.randperm(4096, device="cuda")[:tokens]
    positions = torch.randint(0, 2048, (tokens,), device="cuda")
    rope = RotaryEmbedding(_arch()).cuda()
    args = (q, k, v, cache[0], cache[1], slots, positions, rope.cos, rope.sin)
    _row(
        f"rope + kv write T={tokens}",
        _us(lambda: rope_kv_store(*args)),
        _us(lambda: rope_kv_store_ref(*args)),
    )


@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_bench_add_rms_norm(tokens):
    g = torch.Generator(device="cuda").manual_seed(2)
    x, residual = (torch.randn(tokens, HIDDEN, device="cuda", dtype=DTYPE, generator=g) for _ in range(2))
    weight = torch.randn(HIDDEN, device="cuda", dtype=DTYPE, generator=g)
    ours = _us(lambda: add_rms_norm(x, residual, weight, 1e-5))
    _row(f"residual add + rmsnorm T={tokens}", ours, _us(lambda: add_rms_norm_ref(x, residual, weight, 1e-5)))


@pytest.mark.parametrize(("batch", "context"), SHAPES[:1] + SHAPES[3:])
def test_bench_prepare(batch, context):
    """Per-step planning: the torch backend builds gather indices and masks, the Triton one nothing."""
    case = make_case([context - 1] * batch, [1] * batch, HEADS, KV_HEADS, DIM, 16, DTYPE)
    kv = KVCache(case.k_cache[None], case.v_cache[None], 16)
    ours = _us(lambda: TritonAttentionBackend().prepare(case.batch, kv))
    _row(
        f"prepare B={batch} ctx={context}", ours, _us(lambda: TorchAttentionBackend().prepare(case.batch, kv))
    )


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_gguf):
    return load_model(str(smollm2_gguf), torch.device("cuda"), DTYPE)


@pytest.mark.parametrize(("batch", "context"), SHAPES)
def test_bench_decode_step(smollm2_bf16, batch, context):
    """A whole decode step of SmolLM2-135M (30 layers, logits included) with each backend: the
    per-step figure the kernels add up to. `graph` replays the step from one CUDA graph."""
    figures = {}
    for backend in ("triton", "torch"):
        config = EngineConfig(
            model=str(smollm2_bf16.location.path),
            device="cuda",
            dtype="bfloat16",
            attention_backend=backend,
            cache=CacheConfig(page_size=16, max_total_tokens=batch * (context + 16)),
        )
        engine = Engine(config, smollm2_bf16)
        engine.kv_cache.k.zero_()
        engine.kv_cache.v.zero_()
        g = torch.Generator().manual_seed(batch)
        reqs = [
            Request(
                f"r{i}", torch.randint(0, 1000, (context,), generator=g).tolist(), SamplingParams(), seed=0
            )
            for i in range(batch)
        ]
        try:
            for req in reqs:
                assert engine.kv.reserve(req, context)
                req.num_computed = context - 1  # as if the prompt's KV were there
            inp = build_step_input([ScheduledItem.of(r, 1) for r in reqs], 16, engine.device)
            figures[backend] = _us(lambda engine=engine, inp=inp: engine.runner.execute(inp))
        finally:
            for req in reqs:
                engine.kv.free(req)
    _row(f"decode step (30 layers) B={batch} ctx={context}", figures["triton"], figures["torch"])


@pytest.mark.parametrize("tokens", [1, 2, 4, 8, 64])
def test_bench_fused_linear_layer(tokens):
    """A decoder layer's four matmuls with their norms, activation, residual adds, RoPE and KV write:
    fused (`qkv_rope_store` + three `fused_linear`, four launches) against the (x, residual) path
    (fused norms, cuBLAS, rope_kv_store, silu_mul: eight). The fused kernels as `blocks_for` picks
    them (the GEMV form up to SPECSERVE_GEMV_ROWS tokens), and in the tile form beside them."""
    import torch.nn.functional as F

    from specserve_kernels.fused_linear import GEMV_ROWS, QKVLayout, blocks_for, fused_linear, qkv_rope_store
    from specserve_kernels.silu_mul import silu_mul

    g = torch.Generator(device="cuda").manual_seed(3)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=DTYPE, generator=g) * scale

    inter, q_size, kv_size = 1536, HEADS * DIM, KV_HEADS * DIM
    w_qkv, w_o = rand(q_size + 2 * kv_size, HIDDEN, scale=0.04), rand(HIDDEN, q_size, scale=0.04)
    w_gu, w_d = rand(2 * inter, HIDDEN, scale=0.04), rand(HIDDEN, inter, scale=0.03)
    ln1, ln2 = rand(HIDDEN), rand(HIDDEN)
    stream, attn = rand(tokens, HIDDEN), rand(tokens, q_size)
    cache = torch.zeros(2, 4096, KV_HEADS, DIM, device="cuda", dtype=DTYPE)
    slots = torch.randperm(4096, device="cuda")[:tokens]
    positions = torch.randint(0, 2048, (tokens,), device="cuda")
    rope = RotaryEmbedding(_arch()).cuda()
    layout = QKVLayout(HEADS, KV_HEADS, cache[0], cache[1], slots, positions, rope.cos, rope.sin)

    def fused(gemv_rows=None):
        def blocks(n, k):
            return blocks_for(tokens, n, k, gemv_rows=gemv_rows)

        qkv_rope_store(
            stream, w_qkv, layout, norm=(ln1, 1e-5), blocks=blocks((q_size + 2 * kv_size) // 2, HIDDEN)
        )
        s = fused_linear(attn, w_o, residual=stream, blocks=blocks(HIDDEN, q_size))
        act = fused_linear(s, w_gu, norm=(ln2, 1e-5), gated=True, blocks=blocks(inter, HIDDEN))
        return fused_linear(act, w_d, residual=s, blocks=blocks(HIDDEN, inter))

    def unfused():
        h, r = add_rms_norm(stream, None, ln1, 1e-5)
        q, k, v = F.linear(h, w_qkv).split([q_size, kv_size, kv_size], -1)
        rope_kv_store(
            q.view(tokens, HEADS, DIM),
            k.view(tokens, KV_HEADS, DIM),
            v.view(tokens, KV_HEADS, DIM),
            cache[0],
            cache[1],
            slots,
            positions,
            rope.cos,
            rope.sin,
        )
        h, r = add_rms_norm(F.linear(attn, w_o), r, ln2, 1e-5)
        return F.linear(silu_mul(F.linear(h, w_gu)), w_d), r

    form = "gemv" if tokens <= GEMV_ROWS else "tile"
    torch_path = _us(unfused)
    _row(f"layer matmuls + norms + rope/kv T={tokens} ({form})", _us(fused), torch_path)
    if form == "gemv":
        _row(
            f"layer matmuls + norms + rope/kv T={tokens} (tile)", _us(lambda: fused(gemv_rows=0)), torch_path
        )
