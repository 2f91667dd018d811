"""Tensor parallelism on CPU with gloo: TP=2 (rank 0 in this process, rank 1 spawned) against TP=1.

Invariant 1 across TP sizes: greedy tokens identical and logits within 1e-5 relative in fp32, on an
evenly split Llama-3 (4 query / 2 KV heads) and an unevenly split Qwen2 (6 / 3 heads: rank 0 holds
two KV groups, rank 1 one; intermediate 99 and vocabulary 95 split unevenly too; tied embeddings and
q/k/v biases), for a batch with chunked prefill at page sizes 1 and 16, and with speculative decoding.
Plus the sharding math, the shard layout of loaded weights, and the step packing, in-process.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from specserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from specserve.engine.engine import Engine
from specserve.engine.kv_manager import KVManager
from specserve.engine.request import Request
from specserve.engine.scheduler import ScheduledItem
from specserve.engine.step_input import build_step_input, unpack_step_input
from specserve.executor.local import local_tp_group
from specserve.executor.runner import DriverRunner
from specserve.model.checkpoint import load_checkpoint
from specserve.model.head_checkpoint import random_head, save_head
from specserve.model.loader import build_model
from specserve.model.parallel import (
    TPInfo,
    VocabParallelEmbedding,
    partition_heads,
    partition_rows,
    partition_vocab,
    split_range,
)
from specserve.model.tokenizer import load_tokenizer
from specserve.spec.ngram import NgramDrafter
from specserve.types import SamplingParams

from engine_utils import last_logits, max_rel_error
from tiny_models import save_tiny_llama3, save_tiny_qwen2

VOCAB = 96
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
TIMEOUT_S = 120.0  # every collective and the followers' exit: a hang fails instead of blocking CI


@pytest.fixture(scope="module")
def models(smollm2_gguf, tmp_path_factory) -> dict[str, str]:
    tokenizer = load_tokenizer(smollm2_gguf)
    root = tmp_path_factory.mktemp("tp")
    uneven = dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=48, intermediate_size=99)
    return {
        "llama3-4q2kv": str(save_tiny_llama3(root / "llama3", tokenizer, VOCAB)),
        "qwen2-6q3kv": str(save_tiny_qwen2(root / "qwen2", tokenizer, VOCAB - 1, **uneven)),
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Five prompts of 3 to 35 tokens whose motifs repeat (so n-gram lookups hit)."""
    rng = random.Random(7)
    out = []
    for i in range(5):
        motif = [rng.randrange(3, VOCAB - 1) for _ in range(rng.randrange(2, 5))]
        noise = [rng.randrange(3, VOCAB - 1) for _ in range(rng.randrange(1, 20))]
        out.append(noise + motif * (1 + i % 4))
    return out


def _config(model: str, tp_size: int, page_size: int, speculative=None, overlap=None) -> EngineConfig:
    return EngineConfig(
        model=model,
        device="cpu",
        dtype="float32",
        tp_size=tp_size,
        speculative=speculative,
        overlap_schedule=overlap,
        cache=CacheConfig(page_size=page_size, max_total_tokens=2048),
        # A 16-token budget splits the longer prompts into several prefill chunks.
        scheduler=SchedulerConfig(max_batched_tokens=16),
    )


def _generate(engine: Engine, prompts: list[list[int]]) -> list:
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def _run_tp2(configs: list[EngineConfig], prompts: list[list[int]]) -> list[tuple[list, torch.Tensor]]:
    """Each config's outputs and last-position logits with TP=2; the KV check runs on rank 0 and the
    group must come apart cleanly (local_tp_group raises if a follower fails or hangs)."""
    results = []
    with local_tp_group(configs, timeout_s=TIMEOUT_S, join_timeout_s=TIMEOUT_S) as tp:
        for config in configs:
            engine = Engine(config, tp=tp)
            try:
                assert engine._overlap is config.use_overlap()
                # Rank 0 really holds a shard: fewer KV heads in its cache, a broadcasting runner.
                assert engine.kv_cache.k.shape[2] < engine.arch.num_kv_heads
                assert isinstance(engine.runner, DriverRunner)
                results.append((_generate(engine, prompts), last_logits(engine, prompts)))
                engine.check_kv_accounting()
            finally:
                engine.shutdown()
    return results


@pytest.mark.parametrize("model", ["llama3-4q2kv", "qwen2-6q3kv"])
def test_tp2_equals_tp1(models, prompts, model):
    """Page size 1 steps synchronously; page size 16 with overlap scheduling (the default without
    speculation), where rank 0 resolves each step's future ids before broadcasting it."""
    configs = [_config(models[model], 2, 1, overlap=False), _config(models[model], 2, 16)]
    assert configs[1].use_overlap()
    got = _run_tp2(configs, prompts)
    for config, (outs, logits) in zip(configs, got, strict=True):
        reference = Engine(dataclasses.replace(config, tp_size=1, overlap_schedule=False))
        expected = _generate(reference, prompts)
        assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
        assert max_rel_error(logits, last_logits(reference, prompts)) < 1e-5


def test_tp2_speculative_equals_tp1(models, prompts, tmp_path):
    """ngram, an EAGLE-3 head (bound on rank 0 to whole copies of the vocab-sharded embedding and
    lm_head) and a standalone drafter that is the target checkpoint itself (loaded whole on rank 0,
    so every draft is accepted), as a chain and as a tree: greedy output equals the TP=1 target alone."""
    target = models["llama3-4q2kv"]
    arch = load_checkpoint(target).arch
    head = save_head(tmp_path / "eagle3", *random_head("eagle3", arch, seed=3, draft_vocab_size=48))
    specs = [
        {"method": "ngram", "num_steps": 3},
        {"method": "eagle3", "num_steps": 3, "draft_model": str(head)},
        {"method": "standalone", "num_steps": 3, "draft_model": target},
        # Trees: the tree mask travels in the packed step, the accepted-path KV moves to every rank.
        {"method": "standalone", "num_steps": 3, "topk": 4, "num_draft_tokens": 8, "draft_model": target},
    ]
    configs = [_config(target, 2, 16, SpeculativeConfig.from_value(s)) for s in specs]
    got = _run_tp2(configs, prompts)
    expected = _generate(Engine(_config(target, 1, 16)), prompts)
    for spec, (outs, _) in zip(specs, got, strict=True):
        assert [o.token_ids for o in outs] == [o.token_ids for o in expected], spec["method"]
        assert all(o.meta["spec_verify_ct"] > 0 for o in outs)
    assert sum(o.meta["spec_accepted_tokens"] for o in got[0][0]) > 0  # n-gram drafts got accepted
    standalone = got[2][0]
    assert all(o.meta["spec_accepted_tokens"] == o.meta["spec_draft_tokens"] for o in standalone)
    assert all(o.meta["spec_accepted_tokens"] > 0 for o in got[3][0])  # tree paths accepted (and moved)


# ---- in-process: sharding math, loaded shards, step packing, config --------------------------------


def test_split_range_is_contiguous_and_balanced():
    parts = [split_range(10, 4, r) for r in range(4)]
    assert [len(p) for p in parts] == [3, 3, 2, 2]
    assert [i for p in parts for i in p] == list(range(10))


@pytest.mark.parametrize(
    ("heads", "kv", "tp", "expected"),
    [
        (4, 2, 2, [(range(0, 2), range(0, 1)), (range(2, 4), range(1, 2))]),
        (9, 3, 2, [(range(0, 6), range(0, 2)), (range(6, 9), range(2, 3))]),  # SmolLM2-135M
        (6, 3, 3, [(range(2 * r, 2 * r + 2), range(r, r + 1)) for r in range(3)]),
        # Fewer KV heads than ranks: each KV head on two ranks, its query heads split between them.
        (4, 2, 4, [(range(r, r + 1), range(r // 2, r // 2 + 1)) for r in range(4)]),
        (8, 1, 2, [(range(0, 4), range(0, 1)), (range(4, 8), range(0, 1))]),
    ],
)
def test_partition_heads(heads, kv, tp, expected):
    got = [partition_heads(heads, kv, tp, r) for r in range(tp)]
    assert [(s.q, s.kv) for s in got] == expected


@pytest.mark.parametrize(("heads", "kv", "tp"), [(9, 3, 6), (4, 2, 3), (6, 2, 4), (4, 2, 8)])
def test_partition_heads_refuses_splits_that_break_gqa(heads, kv, tp):
    with pytest.raises(ValueError, match="tp_size"):
        partition_heads(heads, kv, tp, 0)


def test_partition_rows_and_vocab():
    assert [partition_rows(99, 2, r, "intermediate") for r in range(2)] == [range(0, 50), range(50, 99)]
    with pytest.raises(ValueError, match="tp_size"):
        partition_rows(3, 4, 0, "intermediate")
    shards = [partition_vocab(95, 2, r) for r in range(2)]
    assert [(s.start, s.count, s.padded) for s in shards] == [(0, 48, 48), (48, 47, 48)]
    assert partition_vocab(5, 4, 3).count == 0  # ceil(5/4)=2 rows a rank: the last holds padding only
    with pytest.raises(ValueError, match="tp_size"):
        partition_vocab(3, 4, 0)


def test_loaded_shards_reassemble_the_checkpoint(models):
    """Each rank's shard (built without a group: loading runs no collective) is the right slice of
    the full tensors: concatenated over ranks they give back the checkpoint, replicated KV heads
    included (4 query / 2 KV heads over 4 ranks), tied embeddings shared, vocab padding zero."""
    for name, tp_size in (("qwen2-6q3kv", 2), ("llama3-4q2kv", 4)):
        ckpt = load_checkpoint(models[name])
        full = build_model(ckpt.arch, ckpt.tensors, torch.device("cpu"), torch.float32)
        shards = [
            build_model(ckpt.arch, ckpt.tensors, torch.device("cpu"), torch.float32, TPInfo(r, tp_size))
            for r in range(tp_size)
        ]
        _check_reassembly(full, shards, ckpt.arch)


def test_a_shard_of_a_misfit_tensor_is_refused(models):
    """A slice of a tensor with the wrong full size could fit a shard; the loader checks the full size."""
    ckpt = load_checkpoint(models["qwen2-6q3kv"])
    misfits = {  # tensor -> the dimension cut two short (rank 0's slice of it would still fit)
        "model.embed_tokens.weight": 0,
        "model.layers.0.self_attn.q_proj.weight": 0,
        "model.layers.0.mlp.down_proj.weight": 1,
    }
    for name, dim in misfits.items():
        tensors = dict(ckpt.tensors)
        tensors[name] = tensors[name].narrow(dim, 0, tensors[name].shape[dim] - 2)
        with pytest.raises(ValueError, match=name):
            build_model(ckpt.arch, tensors, torch.device("cpu"), torch.float32, TPInfo(0, 2))


def _check_reassembly(full, shards, arch) -> None:
    vocab = arch.vocab_size
    embed = torch.cat([s.model.embed_tokens.weight for s in shards])
    assert torch.equal(embed[:vocab], full.model.embed_tokens.weight) and not embed[vocab:].any()
    for s in shards:
        assert isinstance(s.model.embed_tokens, VocabParallelEmbedding)
        assert (s.lm_head.weight is s.model.embed_tokens.weight) == arch.tie_word_embeddings
    for i, layer in enumerate(full.model.layers):
        parts = [s.model.layers[i] for s in shards]
        attn = [p.self_attn for p in parts]
        q = torch.cat([a.qkv_proj.weight[: a.split[0]] for a in attn])
        assert torch.equal(q, layer.self_attn.qkv_proj.weight[: layer.self_attn.split[0]])
        _check_kv_rows(layer.self_attn, attn, arch)
        o = torch.cat([a.o_proj.weight for a in attn], dim=1)
        assert torch.equal(o, layer.self_attn.o_proj.weight)
        gate_up = torch.cat([p.mlp.gate_up_proj.weight.view(2, -1, arch.hidden_size) for p in parts], dim=1)
        assert torch.equal(gate_up.flatten(0, 1), layer.mlp.gate_up_proj.weight)
        down = torch.cat([p.mlp.down_proj.weight for p in parts], dim=1)
        assert torch.equal(down, layer.mlp.down_proj.weight)
    if not arch.tie_word_embeddings:
        head = torch.cat([s.lm_head.weight for s in shards])
        assert torch.equal(head[:vocab], full.lm_head.weight)


def _check_kv_rows(full, attn, arch) -> None:
    """Each rank's k and v rows are its KV heads' rows of the checkpoint (replicas hold copies)."""
    q_size, kv_size = full.split[0], full.split[1]
    full_k, full_v = full.qkv_proj.weight[q_size : q_size + kv_size], full.qkv_proj.weight[q_size + kv_size :]
    for rank, a in enumerate(attn):
        heads = partition_heads(arch.num_heads, arch.num_kv_heads, len(attn), rank).kv_rows(arch.head_dim)
        k, v = a.qkv_proj.weight[a.split[0] :].chunk(2)
        assert torch.equal(k, full_k[heads.start : heads.stop])
        assert torch.equal(v, full_v[heads.start : heads.stop])
        if arch.attention_bias:
            assert torch.equal(
                a.qkv_proj.bias[a.split[0] :].chunk(2)[0],
                full.qkv_proj.bias[q_size:][heads.start : heads.stop],
            )


def test_step_input_unpacks_to_the_same_tensors():
    kv = KVManager(num_pages=40, page_size=4, enable_prefix_cache=False)
    reqs = [Request(f"r{i}", list(range(3, 3 + n)), GREEDY, seed=0) for i, n in enumerate((5, 11, 2))]
    for req in reqs:
        assert kv.reserve(req, req.prompt_len)
    step = build_step_input([ScheduledItem.of(r, r.prompt_len) for r in reqs], 4, torch.device("cpu"))
    copy = unpack_step_input(step.layout(), step.packed.clone())
    for field in ("input_ids", "positions", "logit_rows", "sample_logit_rows"):
        assert torch.equal(getattr(copy, field), getattr(step, field)), field
    for field in ("query_start", "seq_lens", "slot_mapping", "page_table"):
        assert torch.equal(getattr(copy.attention, field), getattr(step.attention, field)), field
    for field in ("page_size", "max_query_len", "max_seq_len"):
        assert getattr(copy.attention, field) == getattr(step.attention, field), field
    for req in reqs:
        kv.free(req)


def test_a_tree_step_unpacks_to_the_same_mask():
    kv = KVManager(num_pages=40, page_size=4, enable_prefix_cache=False)
    reqs = [
        Request(f"r{i}", [3, 4, 5, 3, 4, 6, 3, 4, 7, 3, 4][: 5 + i * 3], GREEDY, seed=0) for i in range(3)
    ]
    items = []
    for i, req in enumerate(reqs):
        assert kv.reserve(req, req.prompt_len + 8)
        if i == 1:  # a prefill chunk beside two tree verifies
            items.append(ScheduledItem.of(req, req.prompt_len))
            continue
        req.num_computed = req.prompt_len - 1
        req.draft_tree = NgramDrafter(1, 2).propose_tree(req.token_ids, 3, 2, 5)
        req.draft = list(req.draft_tree.tokens)
        items.append(ScheduledItem.of(req, 1 + len(req.draft)))
    step = build_step_input(items, 4, torch.device("cpu"))
    assert step.attention.custom_mask is not None and step.mask_entries > 0
    copy = unpack_step_input(step.layout(), step.packed.clone())
    assert torch.equal(copy.attention.custom_mask, step.attention.custom_mask)
    assert torch.equal(copy.positions, step.positions)
    # Tree tokens sit at root + depth; the prefill chunk stays causal.
    depths = reqs[0].draft_tree.depths.tolist()
    assert step.positions[: len(depths)].tolist() == [reqs[0].num_computed + d for d in depths]
    q = step.attention.max_query_len
    assert torch.equal(step.attention.custom_mask[1], torch.ones(q, q, dtype=torch.bool).tril())
    for req in reqs:
        kv.free(req)


def test_tp_size_is_validated_and_needs_a_group():
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="tp_size"):
            EngineConfig(tp_size=bad)
    config = EngineConfig(model="unused", device="cpu", tp_size=2)
    with pytest.raises(ValueError, match="tp_size"):
        Engine(config)  # no group: refused before any loading
    with pytest.raises(ValueError, match="tp_size"):
        Engine(config, tp=TPInfo(rank=1, size=2))  # followers run run_follower, not an Engine
    assert EngineConfig.from_value(dataclasses.asdict(config)) == config
    with pytest.raises(ValueError, match="cache"):
        EngineConfig.from_value({"cache": {"page_sise": 4}})
