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
    figures = _speculative_figures(bf16_plain, mtbench_questions, spec)
    _report(f"bf16_{method}_vs_plain", figures)
    assert figures["first_tokens_agree"]


def _speculative_figures(plain: LLM, questions, spec: dict) -> dict:
    """Greedy agreement of a speculative engine with plain decoding over 64 tokens, and its accept length."""
    llm = LLM(plain.engine.loaded, device="cuda", dtype="bfloat16", max_total_tokens=16384, speculative=spec)
    prompts = _prompts(plain, questions)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    a, b = plain.generate(prompts, params), llm.generate(prompts, params)
    identical = sum(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True))
    prefix = [_common_prefix(x.token_ids, y.token_ids) for x, y in zip(a, b, strict=True)]
    return {
        "prompts": len(prompts),
        "identical": identical,
        "match_rate": identical / len(prompts),
        "mean_matching_prefix_tokens": sum(prefix) / len(prefix),
        "accept_length": sum(o.meta["completion_tokens"] for o in b)
        / sum(o.meta["spec_verify_ct"] for o in b),
        "first_tokens_agree": all(x.token_ids[0] == y.token_ids[0] for x, y in zip(a, b, strict=True)),
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize(
    ("method", "shape"), [("ngram", (4, 4, 16)), ("ngram", (6, 8, 64)), ("standalone", (4, 4, 16))]
)
def test_bf16_tree_speculation_figures(bf16_plain, mtbench_questions, method, shape):
    """Draft trees in bf16 on the GPU (the Triton tree-masked attention, verify_tree and kv_move
    kernels natively): report the accept length and how often greedy outputs match plain decoding
    (the standalone self-draft accepts its argmax path every step)."""
    loaded = bf16_plain.engine.loaded
    num_steps, topk, nodes = shape
    spec = {"method": method, "num_steps": num_steps, "topk": topk, "num_draft_tokens": nodes}
    if method == "standalone":
        spec["draft_model"] = str(loaded.location.path)
    figures = _speculative_figures(bf16_plain, mtbench_questions, spec)
    _report(f"bf16_{method}_{num_steps}x{topk}x{nodes}_vs_plain", figures)
    assert figures["first_tokens_agree"] and figures["accept_length"] > 1.0


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_bf16_adaptive_speculation(bf16_plain, mtbench_questions, method, tmp_path):
    """Adaptive speculation on the GPU: a CUDA-graph bucket for every tier's query length, each
    profiled at start-up (graph replays at every batch bucket); greedy outputs against plain decoding
    as for static speculation; report the steps each tier ran, the cost table and the match rate."""
    loaded = bf16_plain.engine.loaded
    spec = {"method": method, "num_steps": 8, "adaptive": True}
    if method == "eagle":
        config, tensors = random_head(method, loaded.arch, seed=3, init_std=0.02)
        spec["draft_model"] = str(save_head(tmp_path / method, config, tensors))
    llm = LLM(loaded, device="cuda", dtype="bfloat16", max_total_tokens=16384, speculative=spec)
    engine, adaptive = llm.engine, llm.engine.adaptive
    buckets = engine.runner.graph_buckets
    assert buckets is not None and {t.query_len for t in adaptive.tiers} <= set(buckets.query_lens)
    measured = adaptive.costs.measured()
    assert {("verify", b, t.query_len) for b in buckets.batch_sizes for t in adaptive.tiers} <= set(measured)
    prompts = _prompts(bf16_plain, mtbench_questions)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    a, b = bf16_plain.generate(prompts, params), llm.generate(prompts, params)
    figures = {
        "identical": sum(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True)),
        "prompts": len(prompts),
        "tier_steps": {t.name: n for t, n in sorted(adaptive.tier_steps.items())},
        "switches": adaptive.policy.switches,
        "verify_ms_batch_8": {
            q: round(adaptive.costs.estimate("verify", 8, q) * 1e3, 3) for q in sorted(buckets.query_lens)
        },
        "draft_ms_batch_8": round(adaptive.costs.estimate("draft", 8, 1) * 1e3, 3),
        "measured_goodput": adaptive.policy.measured_goodput,
    }
    _report(f"bf16_adaptive_{method}", figures)
    assert all(x.token_ids[0] == y.token_ids[0] for x, y in zip(a, b, strict=True))
