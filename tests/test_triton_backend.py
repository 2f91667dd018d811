"""The Triton attention backend end to end against the torch backend, on the tiny Llama-3 in fp32.

Every kernel of the fast path runs: RoPE fused with the KV write, paged attention (prefill, chunked
prefill after cached pages, decode, the verify of n-gram drafts), and the fused residual-add +
RMSNorm in every layer — on the CPU under the Triton interpreter (SPECSERVE_TRITON_CPU=1; without it
the backend runs each kernel's torch reference), on a GPU natively. Greedy tokens must be equal,
logits and logprobs within 1e-4.

The fused matmuls (`specserve_kernels.fused_linear`, on by default for steps of at most
`FUSED_LINEAR_TOKENS` tokens: decode and small verify steps) cost seconds a step under the
interpreter, against a fraction of a second without them. So a few steps take them: the engine's
decode and verify (`test_fused_matmuls_in_decode_and_verify_steps`), a standalone drafter's tree
steps, and single forward passes (`test_fused_forward_*`, `test_fused_decode_step_*`); their kernels
have their own tests (test_kernel_fused_linear.py). The other engine comparisons turn them off
(`_llm(..., fused=False)`): what those check (attention over pages, chunked and cached prefill,
ragged verify of two requests, head drafters' attention) does not hang on the fused matmuls.
"""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.attention import triton_backend
from specserve.attention.torch_backend import TorchAttentionBackend
from specserve.attention.triton_backend import TritonAttentionBackend
from specserve.config import EngineConfig
from specserve.engine.request import Request
from specserve.engine.scheduler import ScheduledItem
from specserve.engine.step_input import build_step_input
from specserve.model.head_checkpoint import random_head, save_head
from specserve.model.loader import load_model
from specserve.model.tokenizer import load_tokenizer
from specserve.spec.drafter import resolve_drafts

from engine_utils import agreement, assert_same_outputs, last_logits, max_rel_error
from tiny_models import save_tiny_llama3

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEW_TOKENS = 8
# Repetitive prompts: the n-gram drafter finds their last token earlier and proposes what followed.
PROMPTS = [
    [1000 + (i % 5) for i in range(23)],
    [2000 + (i % 3) for i in range(9)] + [3000 + i for i in range(12)] + [2000, 2001],
]


SMALL_VOCAB = 96
# For the small-vocabulary target, whose outputs repeat, so n-gram drafts come often and get accepted.
SMALL_PROMPTS = [
    [10 + (i % 5) for i in range(23)],
    [20 + (i % 3) for i in range(9)] + [30 + i for i in range(12)] + [20, 21],
]


@pytest.fixture
def triton_cpu(monkeypatch):
    monkeypatch.setenv("SPECSERVE_TRITON_CPU", "1")


@pytest.fixture(scope="module")
def target(tiny_llama):
    """The tiny Llama-3 on this machine's device (on the CPU, the shared copy)."""
    if DEVICE == "cpu":
        return tiny_llama
    return load_model(str(tiny_llama.location.path), torch.device(DEVICE), torch.float32)


@pytest.fixture(scope="module")
def small_target(smollm2_gguf, tmp_path_factory):
    folder = save_tiny_llama3(
        tmp_path_factory.mktemp("small") / "t", load_tokenizer(smollm2_gguf), SMALL_VOCAB
    )
    return load_model(str(folder), torch.device(DEVICE), torch.float32)


def _llm(loaded, backend: str, page_size: int, fused: bool = True, **kwargs) -> LLM:
    """`fused=False`, on the CPU: the Triton backends (the target's, a model drafter's) never take
    the fused matmuls, every other kernel still runs. It saves the interpreter's time, so on a GPU
    (fused steps cheap, and captured in CUDA graphs as the engine is built) it changes nothing."""
    llm = LLM(
        loaded,
        device=str(loaded.model.lm_head.weight.device.type),
        dtype="float32",
        page_size=page_size,
        max_total_tokens=1024,
        attention_backend=backend,
        **kwargs,
    )
    if not fused and DEVICE == "cpu":  # read by every `prepare`: set after the engine is built, it holds
        for attention in (llm.engine.backend, getattr(llm.engine.drafter, "backend", None)):
            if isinstance(attention, TritonAttentionBackend):
                attention.fused_linear_tokens = 0
    return llm


def _params(new_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True, return_logprob=True)


@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_matches_torch_backend(target, triton_cpu, page_size):
    """Unfused matmuls (the fused ones: `test_fused_matmuls_in_decode_and_verify_steps`)."""
    reference_llm = _llm(target, "torch", page_size)
    reference = reference_llm.generate(PROMPTS, _params())
    llm = _llm(target, "triton", page_size, fused=False, max_batched_tokens=16)  # prefills in chunks
    assert isinstance(llm.engine.backend, TritonAttentionBackend)
    rel = max_rel_error(last_logits(llm.engine, PROMPTS), last_logits(reference_llm.engine, PROMPTS))
    assert rel <= 1e-4
    assert_same_outputs(llm.generate(PROMPTS, _params()), reference)
    # Again: the prompts' full pages now come from the prefix cache, the rest is prefilled after them.
    again = llm.generate(PROMPTS, _params())
    assert all(o.meta["cached_tokens"] > 0 for o in again)
    assert_same_outputs(again, reference)


@pytest.mark.parametrize("page_size", [1, 16])
def test_speculative_verify_matches_torch_backend(small_target, triton_cpu, page_size):
    """Verify steps attend with k + 1 causal query rows per request (ragged across the batch).
    Unfused matmuls (the fused ones: `test_fused_matmuls_in_decode_and_verify_steps`)."""
    params = _params(12)
    reference = _llm(small_target, "torch", page_size).generate(SMALL_PROMPTS, params)
    spec = {"method": "ngram", "num_steps": 3}
    llm = _llm(small_target, "triton", page_size, fused=False, speculative=spec)
    outs = llm.generate(SMALL_PROMPTS, params)
    assert_same_outputs(outs, reference)
    assert sum(o.meta["spec_draft_tokens"] for o in outs) >= 6
    assert sum(o.meta["spec_accepted_tokens"] for o in outs) > 0


def test_fused_matmuls_in_decode_and_verify_steps(small_target, triton_cpu, monkeypatch):
    """The fused matmuls (a layer in four launches, their GEMV form at up to 4 rows) through whole
    engine steps against the torch backend: plain decode steps of two requests, then n-gram verify
    steps of one request (its token and up to 3 drafts: causal rows over the KV the same launch
    writes, rejected drafts' KV left behind). Few steps: each costs seconds in the interpreter."""
    rows = _fused_qkv_rows(monkeypatch)
    params = _params(3)
    reference = _llm(small_target, "torch", 16).generate(SMALL_PROMPTS, params)
    # Eager steps (on a GPU too): the spy sees each one, where a CUDA graph would replay without Python.
    llm = _llm(small_target, "triton", 16, cuda_graphs=False)
    assert_same_outputs(llm.generate(SMALL_PROMPTS, params), reference)
    # The prefill (46 tokens) keeps the unfused path; both decode steps are fused, each layer's.
    assert rows == [2] * (2 * small_target.arch.num_layers)
    rows.clear()
    # A prompt that runs into its greedy continuation's cycle (29 61 50 55 10 on the seeded model):
    # the drafter proposes at once, so two verify steps make all six tokens after the prefill's.
    lead = _llm(small_target, "torch", 16).generate(SMALL_PROMPTS[1:], _params(7))[0].token_ids
    prompt = [SMALL_PROMPTS[1] + lead]
    params = _params(6)
    reference = _llm(small_target, "torch", 16).generate(prompt, params)
    spec = {"method": "ngram", "num_steps": 3}
    outs = _llm(small_target, "triton", 16, cuda_graphs=False, speculative=spec).generate(prompt, params)
    assert_same_outputs(outs, reference)
    assert max(rows) == 4  # a verify step of 3 drafts went through the fused matmuls
    meta = outs[0].meta
    assert 0 < meta["spec_accepted_tokens"] < meta["spec_draft_tokens"]  # some drafts kept, some rejected


def _fused_qkv_rows(monkeypatch) -> list[int]:
    """The rows of each fused q/k/v launch the Triton contexts make (one a layer in a fused step)."""
    rows: list[int] = []
    inner = triton_backend.qkv_rope_store

    def counting(x, *args, **kwargs):
        rows.append(x.shape[0])
        return inner(x, *args, **kwargs)

    monkeypatch.setattr(triton_backend, "qkv_rope_store", counting)
    return rows


@pytest.mark.parametrize(
    "method,shape,fused",
    [
        ("eagle3", {"num_steps": 3, "topk": 2, "num_draft_tokens": 4}, False),  # forests, a tree mask
        ("mtp", {"num_steps": 3}, False),
        ("mtp", {"num_steps": 3}, True),
        ("standalone", {"num_steps": 3, "topk": 2, "num_draft_tokens": 4}, True),
    ],
)
def test_model_drafters_attend_with_the_triton_kernels(
    small_target, triton_cpu, tmp_path, monkeypatch, method, shape, fused
):
    """Beside a Triton target, model drafters attend over their own KV with the same kernels (on
    CUDA the torch backend's SDPA re-planned for every new length): same drafts as the torch backend.
    A standalone drafter (a whole Llama) takes the fused matmuls: its tree steps (2 requests x topk 2
    = 4 rows under a tree mask) keep them. So does an MTP chain's module (`MTPModule._forward_fused`;
    unfused, its norms still fold into the residual adds). The EAGLE-3 run turns them off to save the
    interpreter's time (the target's few small steps: `test_fused_matmuls_in_decode_and_verify_steps`)."""
    rows = _fused_qkv_rows(monkeypatch)
    if method == "standalone":
        draft = small_target.location.path
    else:
        kw = {"draft_vocab_size": 64} if method == "eagle3" else {"num_modules": 2}
        draft = save_head(tmp_path / method, *random_head(method, small_target.arch, seed=5, **kw))
    # Host steps: on CUDA a chain's device loop drafts inside its graphs, not through `draft`
    spec = {"method": method, "draft_model": str(draft), "device_steps": 0, **shape}
    params = _params(12)
    runs = {}
    for backend in ("torch", "triton"):
        llm = _llm(small_target, backend, 16, fused=fused, speculative=spec)
        drafts = _record_drafts(llm.engine.drafter)
        runs[backend] = llm.generate(SMALL_PROMPTS, params), drafts
    assert isinstance(llm.engine.drafter.backend, TritonAttentionBackend)
    if DEVICE == "cpu":
        assert bool(rows) == fused
    assert_same_outputs(runs["triton"][0], runs["torch"][0])
    assert runs["triton"][1] == runs["torch"][1]
    assert sum(len(d) for d in runs["torch"][1]) >= 6


def _record_drafts(drafter) -> list[list[int]]:
    """Every draft the drafter proposes, in order (its `draft` / `draft_tree` wrapped). A chain its
    CUDA graphs drafted holds placeholders for drafts still on the device: read them where they are."""
    drafts: list[list[int]] = []
    for name in ("draft", "draft_tree"):
        inner = getattr(drafter, name)

        def wrapped(reqs, *args, inner=inner):
            inner(reqs, *args)
            graphs = getattr(drafter, "graphs", None)
            pending = graphs.pending if graphs is not None else None
            chains = [list(r.draft or []) for r in reqs]
            drafts.extend(resolve_drafts(chains, pending.tolist()) if pending is not None else chains)

        setattr(drafter, name, wrapped)
    return drafts


def test_references_serve_without_the_interpreter(tiny_llama, monkeypatch):
    """On the CPU without the opt-in, the backend runs the kernels' torch references (fast; on the
    CPU on a GPU machine too)."""
    monkeypatch.delenv("SPECSERVE_TRITON_CPU", raising=False)
    reference = _llm(tiny_llama, "torch", 4).generate(PROMPTS, _params())
    llm = _llm(tiny_llama, "triton", 4, speculative="ngram")
    assert_same_outputs(llm.generate(PROMPTS, _params()), reference)


def test_fused_forward_keeps_hidden_and_captured_streams(target, triton_cpu):
    """forward_features through the fused paths — the stream through fused matmuls, (x, residual)
    with fused norms, and split-K attention: final hidden states and the EAGLE-3 residual streams."""
    engine = _llm(target, "torch", 16).engine
    reqs = [Request(f"r{i}", p, SamplingParams(max_new_tokens=1), seed=0) for i, p in enumerate(PROMPTS)]
    try:
        for req in reqs:
            assert engine.kv.reserve(req, req.prompt_len)
        inp = build_step_input([ScheduledItem.of(r, r.prompt_len) for r in reqs], 16, engine.device)
        results = []
        backends = (
            TorchAttentionBackend(),
            TritonAttentionBackend(fused_linear_tokens=len(inp.input_ids)),
            TritonAttentionBackend(fused_linear_tokens=0),
            TritonAttentionBackend(splits=3, fused_linear_tokens=0),
        )
        for backend in backends:
            ctx = backend.prepare(inp.attention, engine.kv_cache)
            results.append(engine.model.forward_features(inp.input_ids, inp.positions, ctx, (0, 2)))
    finally:
        for req in reqs:
            engine.kv.free(req)
    (hidden, aux), *fused = results
    assert backends[1].prepare(inp.attention, engine.kv_cache).fused_linear is not None
    assert backends[2].prepare(inp.attention, engine.kv_cache).fused_linear is None
    for fused_hidden, fused_aux in fused:
        torch.testing.assert_close(fused_hidden, hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused_aux, aux, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("requests", [1, 2])
def test_fused_decode_step_in_the_gemv_form(target, triton_cpu, requests):
    """A decode step of 1-2 tokens through the fused matmuls, which take their GEMV form at so few
    rows, against the torch backend over the same cache (the prompts' KV written beforehand)."""
    from specserve_kernels.fused_linear import GEMV_ROWS

    if requests > GEMV_ROWS:
        pytest.skip(f"SPECSERVE_GEMV_ROWS={GEMV_ROWS}: the tile form")
    engine = _llm(target, "torch", 16).engine
    prompts = PROMPTS[:requests]
    reqs = [Request(f"r{i}", p, SamplingParams(max_new_tokens=1), seed=0) for i, p in enumerate(prompts)]
    try:
        for req in reqs:
            assert engine.kv.reserve(req, req.prompt_len)
        prefill = build_step_input([ScheduledItem.of(r, r.prompt_len - 1) for r in reqs], 16, engine.device)
        ctx = TorchAttentionBackend().prepare(prefill.attention, engine.kv_cache)
        engine.model.forward_features(prefill.input_ids, prefill.positions, ctx, ())
        for req in reqs:
            req.num_computed = req.prompt_len - 1
        inp = build_step_input([ScheduledItem.of(r, 1) for r in reqs], 16, engine.device)
        results = []
        for backend in (TorchAttentionBackend(), TritonAttentionBackend(fused_linear_tokens=requests)):
            ctx = backend.prepare(inp.attention, engine.kv_cache)
            results.append(engine.model.forward_features(inp.input_ids, inp.positions, ctx, (0, 1)))
        assert ctx.fused_linear is not None
    finally:
        for req in reqs:
            engine.kv.free(req)
    (hidden, aux), (fused_hidden, fused_aux) = results
    torch.testing.assert_close(fused_hidden, hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_aux, aux, rtol=1e-5, atol=1e-5)


def test_auto_backend_is_torch_on_cpu_and_names_are_checked(tiny_llama):
    assert _llm(tiny_llama, "auto", 1).engine.backend.name == "torch"
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flashinfer")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_smollm2_triton_vs_torch_backend_on_gpu(smollm2_gguf, mtbench_questions, dtype):
    """The real model on the GPU: fp32 must agree (greedy tokens, logits within 1e-4); bf16 figures
    are printed (rounding differs between the paths, so near-ties may flip)."""
    loaded = load_model(str(smollm2_gguf), torch.device("cuda"), dtype)
    name = str(dtype).removeprefix("torch.")
    llms = {
        backend: LLM(loaded, device="cuda", dtype=name, max_total_tokens=16384, attention_backend=backend)
        for backend in ("torch", "triton")
    }
    prompts = [llms["torch"]._chat_ids([{"role": "user", "content": q}]) for q in mtbench_questions[:8]]
    agree = agreement(llms["triton"], llms["torch"], prompts)
    print(f"\nSmolLM2 {name} triton vs torch backend: {agree}")
    if dtype == torch.float32:
        assert agree.max_rel <= 1e-4 and agree.identical == agree.total
    else:
        assert agree.first >= agree.total - 1 and agree.max_rel < 0.05
