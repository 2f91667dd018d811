"""On a GPU: parity with HF transformers in fp32 (exact) and bf16 (figures reported), same GGUF.

Figures go to stdout and, when $SPECSERVE_REPORT_DIR is set, to gpu_parity.json there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from specserve.model.head_checkpoint import random_head, save_head

from engine_utils import hf_greedy, hf_last_logits, last_logits, max_rel_error

pytestmark = pytest.mark.gpu
NEW_TOKENS = 64


def _pair(gguf: Path, dtype: torch.dtype):
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    llm = LLM(str(gguf), device="cuda", dtype=name, max_total_tokens=16384)
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype).cuda().eval()
    return llm, ref


def _prompts(llm, questions):
    return [llm._chat_ids([{"role": "user", "content": q}]) for q in questions[:8]]


def _report(name: str, figures: dict) -> None:
    print(f"\n{name}: {json.dumps(figures)}")
    folder = os.environ.get("SPECSERVE_REPORT_DIR")
    if folder:
        path = Path(folder) / "gpu_parity.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        data[name] = figures
        path.write_text(json.dumps(data, indent=2))


def _compare(llm, ref, prompts) -> dict:
    ours = last_logits(llm.engine, prompts)
    refs = [hf_last_logits(ref, p) for p in prompts]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0))
    matches, prefix = 0, []
    for prompt, out in zip(prompts, outs, strict=True):
        theirs = hf_greedy(ref, prompt, NEW_TOKENS)
        matches += out.token_ids == theirs
        prefix.append(_common_prefix(out.token_ids, theirs))
    return {
        "prompts": len(prompts),
        "greedy_identical_prompts": matches,
        "greedy_match_rate": matches / len(prompts),
        "mean_matching_prefix_tokens": sum(prefix) / len(prefix),
        "max_abs_logit_diff": max(
            (o.float().cpu() - r.float().cpu()).abs().max().item() for o, r in zip(ours, refs, strict=True)
        ),
        "max_rel_logit_err": max(
            max_rel_error(o.float().cpu(), r.float().cpu()) for o, r in zip(ours, refs, strict=True)
        ),
        "first_token_agree": sum(
            o.argmax().item() == r.argmax().item() for o, r in zip(ours, refs, strict=True)
        ),
    }


def test_fp32_on_gpu_is_exact(smollm2_gguf, mtbench_questions):
    llm, ref = _pair(smollm2_gguf, torch.float32)
    figures = _compare(llm, ref, _prompts(llm, mtbench_questions))
    _report("fp32", figures)
    assert figures["max_rel_logit_err"] <= 1e-4
    assert figures["greedy_match_rate"] == 1.0


def test_bf16_parity_figures(smollm2_gguf, mtbench_questions):
    llm, ref = _pair(smollm2_gguf, torch.bfloat16)
    figures = _compare(llm, ref, _prompts(llm, mtbench_questions))
    _report("bf16", figures)
    # bf16 rounding differs between implementations; the next token must still agree almost always.
    assert figures["first_token_agree"] >= figures["prompts"] - 1
    assert figures["max_rel_logit_err"] < 0.05


@pytest.fixture(scope="module")
def bf16_plain(smollm2_gguf):
    return LLM(str(smollm2_gguf), device="cuda", dtype="bfloat16", max_total_tokens=16384)


@pytest.mark.parametrize("method", ["ngram", "standalone", "eagle", "eagle3", "mtp"])
def test_bf16_speculative_greedy_match_rate(bf16_plain, mtbench_questions, method, tmp_path):
    """Speculation in bf16: verify runs k+1 query rows where plain decode runs one, so near-ties may
    flip; report how often the 64-token greedy outputs still agree with plain decoding. Standalone is
    a self-draft (every draft accepted); the heads are random (almost every draft rejected)."""
    loaded = bf16_plain.engine.loaded
    spec = {"method": method, "num_steps": 4}
    if method == "standalone":
        spec["draft_model"] = str(loaded.location.path)
    elif method != "ngram":
        kwargs = {"eagle3": {"draft_vocab_size": 8192}, "mtp": {"num_modules": 2}}.get(method, {})
        config, tensors = random_head(method, loaded.arch, seed=3, init_std=0.02, **kwargs)
        spec["draft_model"] = str(save_head(tmp_path / method, config, tensors))
    llm = LLM(loaded, device="cuda", dtype="bfloat16", max_total_tokens=16384, speculative=spec)
    prompts = _prompts(bf16_plain, mtbench_questions)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    a, b = bf16_plain.generate(prompts, params), llm.generate(prompts, params)
    identical = sum(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True))
    prefix = [_common_prefix(x.token_ids, y.token_ids) for x, y in zip(a, b, strict=True)]
    accept = sum(o.meta["completion_tokens"] for o in b) / sum(o.meta["spec_verify_ct"] for o in b)
    _report(
        f"bf16_{method}_vs_plain",
        {
            "prompts": len(prompts),
            "identical": identical,
            "match_rate": identical / len(prompts),
            "mean_matching_prefix_tokens": sum(prefix) / len(prefix),
            "accept_length": accept,
        },
    )
    assert all(x.token_ids[0] == y.token_ids[0] for x, y in zip(a, b, strict=True))


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
