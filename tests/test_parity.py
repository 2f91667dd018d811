"""Parity with HF transformers in fp32 on CPU: last-position logits and 64 greedy tokens.

SmolLM2 from the same GGUF the engine loads, and tiny random Llama-3 (llama3 rope scaling,
untied) and Qwen2 (qkv bias, tied) folders saved by the test.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from specserve.model.tokenizer import load_tokenizer

from engine_utils import hf_greedy, hf_last_logits, last_logits, max_rel_error
from tiny_models import save_tiny_llama3, save_tiny_qwen2

GREEDY = SamplingParams(max_new_tokens=64, temperature=0.0)


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_gguf):
    llm = LLM(str(smollm2_gguf), device="cpu", dtype="float32", max_total_tokens=8192)
    ref = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return llm, ref.eval()


@pytest.fixture(scope="module")
def chat_prompts(smollm2_pair, mtbench_questions):
    llm, _ = smollm2_pair
    return [llm._chat_ids([{"role": "user", "content": q}]) for q in mtbench_questions[:8]]


def test_smollm2_logits_match_hf(smollm2_pair, chat_prompts):
    llm, ref = smollm2_pair
    ours = last_logits(llm.engine, chat_prompts)
    for i, prompt in enumerate(chat_prompts):
        err = max_rel_error(ours[i], hf_last_logits(ref, prompt))
        assert err <= 1e-4, f"prompt {i}: max relative logit error {err:.2e}"


def test_smollm2_greedy_matches_hf(smollm2_pair, chat_prompts):
    llm, ref = smollm2_pair
    outs = llm.generate(chat_prompts, GREEDY)
    for i, (prompt, out) in enumerate(zip(chat_prompts, outs, strict=True)):
        assert out.token_ids == hf_greedy(ref, prompt, 64), f"prompt {i} diverged"


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    return load_tokenizer(smollm2_gguf)


@pytest.mark.parametrize("make", [save_tiny_llama3, save_tiny_qwen2], ids=["llama3", "qwen2"])
def test_tiny_models_match_hf(make, tokenizer, tmp_path):
    folder = make(tmp_path / "model", tokenizer)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), device="cpu", dtype="float32", max_total_tokens=4096, page_size=4)
    g = torch.Generator().manual_seed(0)
    # Long enough (> 64 tokens) that llama3 rope scaling's low-frequency band matters.
    prompts = [torch.randint(0, ref.config.vocab_size, (n,), generator=g).tolist() for n in (5, 80, 150)]
    ours = last_logits(llm.engine, prompts)
    for i, prompt in enumerate(prompts):
        assert max_rel_error(ours[i], hf_last_logits(ref, prompt)) <= 1e-4
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(ref, prompt, 64)
