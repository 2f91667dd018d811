"""The Triton attention backend end to end against the torch backend, on the tiny Llama-3 in fp32.

With SPECSERVE_TRITON_CPU=1 every kernel of the fast path runs under the Triton interpreter: RoPE
fused with the KV write, paged attention (prefill, chunked prefill after cached pages, decode, the
verify of n-gram drafts), and the fused residual-add + RMSNorm in every layer. Without it the same
backend runs each kernel's torch reference. Greedy tokens must be equal and logits within 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.attention.torch_backend import TorchAttentionBackend
from specserve.attention.triton_backend import TritonAttentionBackend
from specserve.config import EngineConfig
from specserve.engine.request import Request
from specserve.engine.scheduler import ScheduledItem
from specserve.engine.step_input import build_step_input
from specserve.model.loader import load_model
from specserve.model.tokenizer import load_tokenizer

from engine_utils import last_logits, max_rel_error
from tiny_models import save_tiny_llama3

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
def small_target(smollm2_gguf, tmp_path_factory):
    folder = save_tiny_llama3(
        tmp_path_factory.mktemp("small") / "t", load_tokenizer(smollm2_gguf), SMALL_VOCAB
    )
    return load_model(str(folder), torch.device("cpu"), torch.float32)


def _llm(tiny_llama, backend: str, page_size: int, **kwargs) -> LLM:
    return LLM(
        tiny_llama,
        device="cpu",
        dtype="float32",
        page_size=page_size,
        max_total_tokens=1024,
        attention_backend=backend,
        **kwargs,
    )


def _params(new_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True, return_logprob=True)


def _logprobs(out) -> list[float]:
    return [entry[0] for entry in out.meta["output_token_logprobs"]]


def _assert_same_outputs(ours, reference) -> None:
    assert [o.token_ids for o in ours] == [r.token_ids for r in reference]
    for o, r in zip(ours, reference, strict=True):
        assert max(abs(a - b) for a, b in zip(_logprobs(o), _logprobs(r), strict=True)) <= 1e-4


@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_matches_torch_backend(tiny_llama, triton_cpu, page_size):
    reference_llm = _llm(tiny_llama, "torch", page_size)
    reference = reference_llm.generate(PROMPTS, _params())
    llm = _llm(tiny_llama, "triton", page_size, max_batched_tokens=16)  # prefills in chunks
    assert isinstance(llm.engine.backend, TritonAttentionBackend)
    rel = max_rel_error(last_logits(llm.engine, PROMPTS), last_logits(reference_llm.engine, PROMPTS))
    assert rel <= 1e-4
    _assert_same_outputs(llm.generate(PROMPTS, _params()), reference)
    # Again: the prompts' full pages now come from the prefix cache, the rest is prefilled after them.
    again = llm.generate(PROMPTS, _params())
    assert all(o.meta["cached_tokens"] > 0 for o in again)
    _assert_same_outputs(again, reference)


@pytest.mark.parametrize("page_size", [1, 16])
def test_speculative_verify_matches_torch_backend(small_target, triton_cpu, page_size):
    """Verify steps attend with k + 1 causal query rows per request (ragged across the batch)."""
    params = _params(12)
    reference = _llm(small_target, "torch", page_size).generate(SMALL_PROMPTS, params)
    spec = {"method": "ngram", "num_steps": 3}
    outs = _llm(small_target, "triton", page_size, speculative=spec).generate(SMALL_PROMPTS, params)
    _assert_same_outputs(outs, reference)
    assert sum(o.meta["spec_draft_tokens"] for o in outs) >= 6
    assert sum(o.meta["spec_accepted_tokens"] for o in outs) > 0


def test_references_serve_without_the_interpreter(tiny_llama, monkeypatch):
    """On the CPU without the opt-in, the backend runs the kernels' torch references (fast)."""
    monkeypatch.delenv("SPECSERVE_TRITON_CPU", raising=False)
    reference = _llm(tiny_llama, "torch", 4).generate(PROMPTS, _params())
    llm = _llm(tiny_llama, "triton", 4, speculative="ngram")
    _assert_same_outputs(llm.generate(PROMPTS, _params()), reference)


def test_fused_forward_keeps_hidden_and_captured_streams(tiny_llama, triton_cpu):
    """forward_features through the fused path (also with split-K attention): final hidden states
    and the EAGLE-3 residual streams."""
    engine = _llm(tiny_llama, "torch", 16).engine
    reqs = [Request(f"r{i}", p, SamplingParams(max_new_tokens=1), seed=0) for i, p in enumerate(PROMPTS)]
    try:
        for req in reqs:
            assert engine.kv.reserve(req, req.prompt_len)
        inp = build_step_input([ScheduledItem.of(r, r.prompt_len) for r in reqs], 16, engine.device)
        results = []
        for backend in (TorchAttentionBackend(), TritonAttentionBackend(), TritonAttentionBackend(splits=3)):
            ctx = backend.prepare(inp.attention, engine.kv_cache)
            results.append(engine.model.forward_features(inp.input_ids, inp.positions, ctx, (0, 2)))
    finally:
        for req in reqs:
            engine.kv.free(req)
    (hidden, aux), *fused = results
    for fused_hidden, fused_aux in fused:
        torch.testing.assert_close(fused_hidden, hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused_aux, aux, rtol=1e-5, atol=1e-5)


def test_auto_backend_is_torch_on_cpu_and_names_are_checked(tiny_llama):
    assert _llm(tiny_llama, "auto", 1).engine.backend.name == "torch"
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")
