"""Hidden-state draft heads (EAGLE, EAGLE-3, MTP chain): loading, exact drafts, chaining, KV hygiene.

The central check compares every chain the engine drafted, mid-generation and under chunked
prefill, paging and batching, with a from-scratch computation of the same head (head_reference.py):
if positions, KV, the extend over accepted tokens or the hidden-state chaining were off by one
anywhere, the drafts would differ. A small-vocabulary target makes random heads' drafts get
accepted often, so extends over several accepted tokens are exercised too.
"""

from __future__ import annotations

import random

import pytest
import torch
from head_reference import reference_step_logits

from specserve import LLM, SamplingParams
from specserve.model.head_checkpoint import load_head, random_head, save_head

CPU = torch.device("cpu")
VOCAB = 96
HEADS = {
    "eagle": ("eagle", {"layers_per_module": 2}),
    "eagle3": ("eagle3", {"draft_vocab_size": 64}),
    "eagle3-deep": ("eagle3", {"layers_per_module": 2}),
    "mtp": ("mtp", {"num_modules": 3}),
}


@pytest.fixture(scope="module")
def target(small_vocab_target):
    return small_vocab_target


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    folders = {}
    for name, (method, kwargs) in HEADS.items():
        config, tensors = random_head(method, target.arch, seed=5, **kwargs)
        folders[name] = save_head(root / name, config, tensors)
    return folders


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 40))] for _ in range(count)]


def _llm(target, method, folder, num_steps, **kwargs) -> LLM:
    spec = {"method": method, "draft_model": str(folder), "num_steps": num_steps}
    return LLM(target, device="cpu", dtype="float32", speculative=spec, **kwargs)


def _record_drafts(llm: LLM) -> list[tuple]:
    """Every chain the engine drafts: (verified tokens, drafts, q rows or None, request)."""
    drafter, records = llm.engine.drafter, []
    original = drafter.draft

    def recording(reqs, budgets):
        original(reqs, budgets)
        for r in reqs:
            if r.draft:
                probs = None if r.draft_probs is None else r.draft_probs.clone()
                records.append((list(r.token_ids), list(r.draft), probs, r))

    drafter.draft = recording
    return records


@pytest.mark.parametrize("name", list(HEADS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_equal_a_from_scratch_computation(target, heads, name, temperature):
    """Every chain is the head's argmax from scratch, for sampling requests too: a head's drafts are
    deterministic (verify takes them as one-hot q). Extends over accepted sampled drafts are checked
    with trained heads (tests/test_head_loop.py: random heads' drafts are rarely accepted)."""
    method = HEADS[name][0]
    llm = _llm(target, method, heads[name], 5, page_size=4, max_batched_tokens=24)
    records = _record_drafts(llm)
    params = SamplingParams(max_new_tokens=24, temperature=temperature, top_k=40, seed=1, ignore_eos=True)
    llm.generate(_prompts(4), params)
    head = llm.engine.drafter.head
    checked = 0
    for verified, drafts, probs, _ in records[::3]:
        assert probs is None, "a head's drafts carry no q"
        ref = reference_step_logits(target.model, head, verified, drafts)
        assert [head.to_target_ids(logits.argmax())[None].item() for logits in ref] == drafts, name
        checked += 1
    assert checked >= 5


def test_mtp_steps_chain_hidden_states(target, heads):
    """Invariant 5: MTP step i consumes module i-1's output, not the target's stale hidden state.
    The engine's drafts match the chained computation, and a computation that reuses the target's
    hidden state proposes different drafts (so this test would catch that bug)."""
    llm = _llm(target, "mtp", heads["mtp"], 3, page_size=1)
    records = _record_drafts(llm)
    llm.generate(_prompts(3, seed=1), SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    head = llm.engine.drafter.head
    differ = 0
    for verified, drafts, _, _ in records:
        if len(drafts) < 2:
            continue
        chained = reference_step_logits(target.model, head, verified, drafts)
        stale = reference_step_logits(target.model, head, verified, drafts, chain_hidden=False)
        assert [int(logits.argmax()) for logits in chained] == drafts
        differ += any(int(logits.argmax()) != d for logits, d in zip(stale[1:], drafts[1:], strict=True))
    assert differ > 0


@pytest.mark.parametrize("name", list(HEADS))
def test_retraction_abort_and_prefix_cache_stay_lossless(target, heads, name):
    method = HEADS[name][0]
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = _prompts(6, seed=2)
    reference = LLM(target, device="cpu", dtype="float32").generate(prompts, params)
    tight = _llm(target, method, heads[name], 4, page_size=4, max_total_tokens=160, enable_prefix_cache=False)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_retracted > 0
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    cached = _llm(target, method, heads[name], 4, page_size=4)
    first = cached.generate(prompts[:2], params)
    again = cached.generate([prompts[0] + first[0].token_ids[:9], prompts[1]], params)
    assert again[1].meta["cached_tokens"] > 0
    assert again[1].token_ids == reference[1].token_ids
    engine = cached.engine
    ids = [engine.add_request(p, params) for p in prompts[2:5]]
    for _ in range(3):
        engine.step()
    assert engine.abort(ids[1])
    while engine.has_unfinished():
        engine.step()


def test_head_folder_round_trip_and_errors(target, heads, tmp_path):
    head = load_head(heads["eagle3"], "eagle3", target.model, torch.device("cpu"), torch.float32)
    assert head.spec.draft_vocab_size == 64 and head.draft_to_target.shape == (64,)
    assert head.spec.aux_layers == (1, 0, 0)  # (1, L/2 - 1, L - 4) clipped to the 3-layer target
    config, tensors = random_head("eagle3", target.arch, seed=5, draft_vocab_size=64)
    stored = load_head(heads["eagle3"], "eagle3", target.model, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(stored.step_modules[0].fc.weight, tensors["fc.weight"])
    q, k, v = (tensors[f"midlayer.self_attn.{n}_proj.weight"] for n in "qkv")
    torch.testing.assert_close(
        stored.step_modules[0].midlayer.self_attn.qkv_proj.weight, torch.cat([q, k, v])
    )
    sharded = save_head(tmp_path / "sharded", config, tensors, max_shard_bytes=20_000)
    assert (
        len(list(sharded.glob("*.safetensors"))) > 1 and (sharded / "model.safetensors.index.json").is_file()
    )
    again = load_head(sharded, "eagle3", target.model, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(again.step_modules[0].fc.weight, tensors["fc.weight"])
    del tensors["norm.weight"]
    broken = save_head(tmp_path / "broken", config, tensors)
    with pytest.raises(ValueError, match="speculative.draft_model.*norm"):
        load_head(broken, "eagle3", target.model, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="speculative.draft_model"):
        _llm(target, "eagle", tmp_path / "missing", 3)
    _deep_eagle3_folder_names(target, tmp_path)
    mtp = load_head(heads["mtp"], "mtp", target.model, torch.device("cpu"), torch.float32)
    assert len(mtp.step_modules) == 3 and mtp.step_modules[2].shared_head.head is None


def _deep_eagle3_folder_names(target, tmp_path) -> None:
    """A deeper EAGLE-3 head stores `midlayer.*` as layer 0 and its further layers as `layers.1.*`
    on, with num_hidden_layers counting all; a layer missing or beyond that count is refused."""
    config, tensors = random_head("eagle3", target.arch, seed=5, layers_per_module=3)
    assert config["num_hidden_layers"] == 3
    assert {n.split(".")[1] for n in tensors if n.startswith("layers.")} == {"1", "2"}
    head = load_head(
        save_head(tmp_path / "deep", config, tensors), "eagle3", target.model, CPU, torch.float32
    )
    assert head.spec.layers_per_module == 3 and head.spec.arch.num_layers == 3
    torch.testing.assert_close(
        head.step_modules[0].layers[1].mlp.down_proj.weight, tensors["layers.2.mlp.down_proj.weight"]
    )
    for wrong in (2, 4):
        broken = save_head(tmp_path / f"deep{wrong}", {**config, "num_hidden_layers": wrong}, tensors)
        with pytest.raises(ValueError, match="speculative.draft_model.*layers.1"):
            load_head(broken, "eagle3", target.model, CPU, torch.float32)
