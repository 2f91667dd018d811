"""The optional vllm-flash-attn backend: availability reporting, the settings it refuses, and its
plumbing end to end.

The library itself needs CUDA and a torch it was built for, so on the CPU a fake `vllm_flash_attn`
stands in: plain torch behind the exact signature of vllm-flash-attn 2.6.2's `flash_attn_varlen_func`,
following its documented semantics (paged k/v [blocks, block_size, kv_heads, D] through an int32
`block_table`, int32 `cu_seqlens_q/k`, causal mask aligned to the bottom right, GQA by head groups,
`softmax_scale` default 1/sqrt(D)) and the argument checks its binary makes. With it the backend's
cu_seqlens, block-table view, maxima, scale and GQA run against the torch backend on the tiny model in
fp32. The GPU test compares the real library with the Triton backend on SmolLM2, or skips with the
reason `flash_available()` gives.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.attention import flash_backend
from specserve.attention.backend import AttentionBatch
from specserve.attention.flash_backend import (
    FlashAttentionBackend,
    FlashAttentionContext,
    check_flash_device,
    flash_available,
)
from specserve.attention.triton_backend import TritonAttentionContext
from specserve.cli import main
from specserve.config import CacheConfig, EngineConfig
from specserve.engine.engine import attention_backend
from specserve.engine.kv_cache import KVCache
from specserve.model.loader import load_model

from engine_utils import agreement, assert_same_outputs, last_logits, max_rel_error

PROMPTS = [
    [1000 + (i % 5) for i in range(37)],
    [2000 + (i % 3) for i in range(9)] + [3000 + i for i in range(12)] + [2000, 2001],
    [4000 + i for i in range(5)],
]


# ---- the fake library --------------------------------------------------------------------------


def _fake_varlen(calls: list[dict]):
    def flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
        *,
        out=None,
    ):
        """vllm-flash-attn 2.6.2's signature; the paged, inference-only case in plain torch. One
        relaxation: fp32 is accepted (the real kernels take fp16/bf16 only) so the CPU test is exact."""
        if dropout_p or window_size != (-1, -1) or softcap or alibi_slopes is not None:
            raise NotImplementedError("fake: no dropout, window, softcap or ALiBi")
        if return_attn_probs or out is not None or block_table is None:
            raise NotImplementedError("fake: the paged KV case only, returning `out`")
        # The library's own checks (its messages), which a wrong argument would trip on the GPU.
        for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            assert t.dtype == torch.int32, f"{name} must have dtype int32"
            assert t.is_contiguous(), f"{name} must be contiguous"
        batch = cu_seqlens_q.numel() - 1
        assert cu_seqlens_q.shape == cu_seqlens_k.shape == (batch + 1,), (
            "cu_seqlens must have shape (batch_size + 1)"
        )
        assert block_table.dtype == torch.int32, "block_table must have dtype torch.int32"
        assert block_table.stride(-1) == 1, "block_table must have contiguous last dimension"
        assert block_table.dim() == 2 and block_table.shape[0] == batch, (
            "block_table must have shape (batch_size, max_num_blocks_per_seq)"
        )
        assert k.dim() == 4 and v.shape == k.shape, (
            "k must have shape (num_blocks, page_block_size, num_heads_k, head_size_og)"
        )
        _, page, kv_heads, dim = k.shape
        assert page % 16 == 0, "Paged KV cache block size must be divisible by 16"
        assert q.dim() == 3 and q.shape[2] == dim, "q must have shape (total_q, num_heads, head_size_og)"
        assert q.shape[1] % kv_heads == 0, "Number of heads in key/value must divide number of heads in query"
        assert q.dtype == k.dtype == v.dtype, "Key must have the same dtype as query"
        assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), "fp16 and bf16 (fake: fp32 too)"
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        if max_seqlen_q == 1 and q.shape[1] > kv_heads:
            # Its GQA decode path reshapes q to (batch_size, heads, D): one query row per request.
            assert q.shape[0] == batch, "a max_seqlen_q 1 step needs exactly one query row per request"
        scale = softmax_scale if softmax_scale is not None else dim**-0.5
        calls.append({"scale": softmax_scale, "causal": causal, "page": page, "batch": batch})
        starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        assert starts_q[0] == 0 and starts_q[-1] == q.shape[0], "cu_seqlens_q must cover q's rows"
        result = torch.zeros_like(q)
        group = q.shape[1] // kv_heads  # query heads [g*group, (g+1)*group) read KV head g
        for b in range(batch):
            sq, sk = starts_q[b + 1] - starts_q[b], starts_k[b + 1] - starts_k[b]
            # The kernel sizes its grid from the maxima: rows past them would be left unwritten.
            assert 0 <= sq <= max_seqlen_q and 0 <= sk <= max_seqlen_k, "lengths past max_seqlen_q/k"
            assert -(-sk // page) <= block_table.shape[1], "more blocks than the block table holds"
            if sq == 0:
                continue
            j = torch.arange(sk, device=q.device)
            blocks = block_table[b, j // page].long()
            keys = k[blocks, j % page].float().repeat_interleave(group, dim=1)  # [sk, H, D]
            values = v[blocks, j % page].float().repeat_interleave(group, dim=1)
            rows = q[starts_q[b] : starts_q[b + 1]].float()
            scores = torch.einsum("qhd,khd->hqk", rows, keys) * scale
            allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
            if causal:  # bottom-right aligned: row i sees keys j <= i + sk - sq
                allowed = j[None, :] <= torch.arange(sq, device=q.device)[:, None] + sk - sq
            probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
            probs = torch.nan_to_num(probs)  # a row with every key masked outputs zero
            result[starts_q[b] : starts_q[b + 1]] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
        return result

    return flash_attn_varlen_func


@pytest.fixture
def fake_flash(monkeypatch):
    """A fake `vllm_flash_attn` in sys.modules; the device check relaxed, as the fake runs on the CPU
    in fp32 (everything else is the engine's real path: factory, config, backend)."""
    module = types.ModuleType("vllm_flash_attn")
    module.__version__ = "2.6.2-fake"
    module.calls = []
    module.flash_attn_varlen_func = _fake_varlen(module.calls)
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", module)
    monkeypatch.setattr(flash_backend, "check_flash_device", lambda device, dtype: None)
    return module


@pytest.fixture
def no_flash(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", None)  # `import` then raises ImportError


# ---- availability and settings -----------------------------------------------------------------


def test_missing_library_is_reported_and_refused(no_flash, tiny_llama):
    ok, why = flash_available()
    assert not ok and why.startswith("vllm_flash_attn does not import: ModuleNotFoundError")
    config = EngineConfig(device="cpu", attention_backend="flash", cache=CacheConfig(page_size=16))
    with pytest.raises(
        ValueError, match=r"^attention_backend: 'flash' needs vllm-flash-attn .*ModuleNotFoundError"
    ):
        attention_backend(config)
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(
            tiny_llama,
            device="cpu",
            dtype="float32",
            page_size=16,
            max_total_tokens=64,
            attention_backend="flash",
        )


def test_broken_library_is_reported(tmp_path, monkeypatch):
    """A wheel built for another torch fails inside its import (an undefined symbol); one without the
    function is no use either."""
    package = tmp_path / "vllm_flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError('vllm_flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n"
    )
    monkeypatch.delitem(sys.modules, "vllm_flash_attn", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    ok, why = flash_available()
    assert not ok and "undefined symbol" in why
    monkeypatch.setitem(sys.modules, "vllm_flash_attn", types.ModuleType("vllm_flash_attn"))
    assert flash_available() == (False, "vllm_flash_attn (unknown version) has no flash_attn_varlen_func")


def test_available_with_the_library(fake_flash):
    assert flash_available() == (True, "vllm_flash_attn 2.6.2-fake")


def test_config_validation():
    assert (
        EngineConfig(attention_backend="flash", cache=CacheConfig(page_size=32)).attention_backend == "flash"
    )
    with pytest.raises(
        ValueError, match=r"^page_size: must be a multiple of 16 with attention_backend 'flash'"
    ):
        EngineConfig(attention_backend="flash", cache=CacheConfig(page_size=8))
    with pytest.raises(ValueError, match="^cuda_graphs: needs the triton attention backend"):
        EngineConfig(attention_backend="flash", cuda_graphs=True, cache=CacheConfig(page_size=16))
    # Graphs stay off with flash by default, even on CUDA: capturing the library's calls is unverified.
    assert not EngineConfig(
        device="cuda", attention_backend="flash", cache=CacheConfig(page_size=16)
    ).use_cuda_graphs()
    with pytest.raises(ValueError, match="^attention_backend: must be one of"):
        EngineConfig(attention_backend="flashinfer")


def test_device_and_dtype_checks(monkeypatch):
    with pytest.raises(ValueError, match="^device: attention_backend 'flash' runs on CUDA only"):
        check_flash_device(torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="^dtype: attention_backend 'flash' supports float16 and bfloat16"):
        check_flash_device(torch.device("cuda"), torch.float32)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (7, 5))
    with pytest.raises(ValueError, match="^device: .* compute capability 8.0 or newer"):
        check_flash_device(torch.device("cuda"), torch.float16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    check_flash_device(torch.device("cuda"), torch.bfloat16)


def _batch(page_size: int, custom_mask: torch.Tensor | None = None) -> AttentionBatch:
    return AttentionBatch(
        query_start=torch.tensor([0, 2]),
        seq_lens=torch.tensor([2]),
        slot_mapping=torch.tensor([page_size, page_size + 1]),
        page_table=torch.tensor([[1]]),
        page_size=page_size,
        max_query_len=2,
        max_seq_len=2,
        custom_mask=custom_mask,
    )


def _cache(page_size: int, head_dim: int = 8) -> KVCache:
    k = torch.zeros(1, 2 * page_size, 2, head_dim)
    return KVCache(k, torch.zeros_like(k), page_size)


def test_prepare_checks_the_cache_and_sends_tree_steps_to_triton(fake_flash):
    backend = FlashAttentionBackend()
    with pytest.raises(
        ValueError, match="^page_size: attention_backend 'flash' needs a multiple of 16, got 8"
    ):
        backend.prepare(_batch(8), _cache(8))
    with pytest.raises(ValueError, match="head_dim up to 256, got 512"):
        backend.prepare(_batch(16), _cache(16, head_dim=512))
    assert type(backend.prepare(_batch(16), _cache(16))) is FlashAttentionContext
    tree = backend.prepare(_batch(16, torch.ones(1, 2, 2, dtype=torch.bool)), _cache(16))
    assert type(tree) is TritonAttentionContext  # the library has no custom masks; our kernel does


def test_fake_rejects_what_the_library_rejects(fake_flash):
    """The fake's checks are what make the engine test below catch a wrong argument."""
    ctx = FlashAttentionBackend().prepare(_batch(16), _cache(16))
    q = torch.randn(2, 4, 8)
    good = (q, ctx.paged[0][0], ctx.paged[1][0], ctx.cu_seqlens_q, ctx.cu_seqlens_k, 2, 2)
    fake_flash.flash_attn_varlen_func(*good, causal=True, block_table=ctx.block_table)
    with pytest.raises(AssertionError, match="cu_seqlens_k must have dtype int32"):
        fake_flash.flash_attn_varlen_func(
            *good[:4], ctx.cu_seqlens_k.long(), 2, 2, block_table=ctx.block_table
        )
    with pytest.raises(AssertionError, match="block_table must have dtype torch.int32"):
        fake_flash.flash_attn_varlen_func(*good, block_table=ctx.block_table.long())
    with pytest.raises(AssertionError, match="lengths past max_seqlen_q/k"):
        fake_flash.flash_attn_varlen_func(*good[:5], 2, 1, block_table=ctx.block_table)
    flat = _cache(16).k[0]  # the flat slot layout instead of the paged view
    with pytest.raises(AssertionError, match="num_blocks, page_block_size"):
        fake_flash.flash_attn_varlen_func(q, flat, flat, *good[3:], block_table=ctx.block_table)


# ---- the engine over the fake ------------------------------------------------------------------


def _llm(loaded, backend: str, page_size: int, **kwargs) -> LLM:
    return LLM(
        loaded,
        device="cpu",
        dtype="float32",
        page_size=page_size,
        max_total_tokens=1024,
        attention_backend=backend,
        **kwargs,
    )


def _params(new_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True, return_logprob=True)


@pytest.mark.parametrize("page_size", [16, 32])
def test_engine_over_the_fake_matches_torch_backend(tiny_llama, fake_flash, page_size):
    """Chunked prefill, prefix-cached pages, decode, and n-gram verify (several causal query rows per
    request): the same greedy tokens and logprobs as the torch backend, GQA 4 query / 2 KV heads."""
    reference_llm = _llm(tiny_llama, "torch", page_size)
    llm = _llm(tiny_llama, "flash", page_size, max_batched_tokens=16)
    assert llm.engine.backend.name == "flash" and llm.engine.runner.graphs is None
    rel = max_rel_error(last_logits(llm.engine, PROMPTS), last_logits(reference_llm.engine, PROMPTS))
    assert rel <= 1e-4
    reference = reference_llm.generate(PROMPTS, _params())
    assert_same_outputs(llm.generate(PROMPTS, _params()), reference)
    again = llm.generate(PROMPTS, _params())
    assert sum(o.meta["cached_tokens"] for o in again) > 0
    assert_same_outputs(again, reference)
    spec = _llm(tiny_llama, "flash", page_size, speculative={"method": "ngram", "num_steps": 3})
    outs = spec.generate(PROMPTS, _params(12))
    assert_same_outputs(outs, reference_llm.generate(PROMPTS, _params(12)))
    assert sum(o.meta["spec_draft_tokens"] for o in outs) > 0
    calls = fake_flash.calls
    assert calls and all(c["causal"] and c["page"] == page_size for c in calls)
    assert {c["scale"] for c in calls} == {16**-0.5}  # the tiny model's head_dim, passed explicitly


def test_bench_with_flash(tiny_llama, fake_flash, tmp_path, capsys):
    """`specserve bench --attention-backend flash` runs where the library imports (the fake here)."""
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(tiny_llama.location.path), "--device", "cpu", "--batch-sizes", "2"]
    argv += ["--max-new-tokens", "3", "--attention-backend", "flash", "--page-size", "16", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["attention_backend"] == "flash" and fake_flash.calls
    assert [r["system"] for r in report["rows"]] == ["specserve"]


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--page-size", "16"], "attention_backend: 'flash' needs vllm-flash-attn"),
        (["--page-size", "1"], "page_size: must be a multiple of 16"),
    ],
)
def test_bench_refuses_flash_before_loading(no_flash, tmp_path, capsys, flags, error):
    argv = ["bench", "--model", str(tmp_path / "never-loaded"), "--device", "cpu"]
    assert main([*argv, "--attention-backend", "flash", *flags, "--out", str(tmp_path / "b.json")]) == 2
    assert error in capsys.readouterr().err


# ---- the real library on the GPU ---------------------------------------------------------------


@pytest.mark.gpu
def test_smollm2_flash_vs_triton_backend_on_gpu(smollm2_gguf, mtbench_questions):
    """SmolLM2 in bf16: greedy outputs and last logits of the flash backend against the Triton one
    (rounding differs between the kernels, so near-ties may flip; figures printed)."""
    ok, why = flash_available()
    if not ok:
        pytest.skip(why)
    loaded = load_model(str(smollm2_gguf), torch.device("cuda"), torch.bfloat16)
    llms = {
        backend: LLM(
            loaded,
            device="cuda",
            dtype="bfloat16",
            page_size=16,
            max_total_tokens=16384,
            attention_backend=backend,
            cuda_graphs=False,
        )
        for backend in ("triton", "flash")
    }
    prompts = [llms["triton"]._chat_ids([{"role": "user", "content": q}]) for q in mtbench_questions[:8]]
    agree = agreement(llms["flash"], llms["triton"], prompts)
    print(f"\nSmolLM2 bf16 flash ({why}) vs triton backend: {agree}")
    assert agree.first >= agree.total - 1 and agree.identical >= agree.total // 2 and agree.max_rel < 0.05
