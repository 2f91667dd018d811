"""Hybrid (Bamba: Mamba-2 + attention) targets: logits against transformers, lossless greedy
speculation with chains and trees (recurrent states per draft token, the last accepted one committed),
logprobs, retract and abort under a tiny pool, the refusals (`docs/hybrid-models.md`).

The target is a small-vocabulary random Bamba. Real drafters (n-gram, a random Llama as standalone
drafter) rarely get long drafts accepted on it, so an oracle drafter (test-only) proposes the target's
own greedy continuation, wrong at seeded random places, as chains and as trees whose true path hides
among decoys: drafts are accepted to every depth and at every tree row, and every later token reads
the state the commit left. The state-pool accounting is checked after every test (conftest's KV
check) and, in the runs below, after every step.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from specserve.config import EngineConfig
from specserve.engine.engine import Engine
from specserve.engine.recurrent_batch import build_recurrent_batch
from specserve.engine.request import Request
from specserve.engine.scheduler import ScheduledItem
from specserve.engine.state_pool import StatePool
from specserve.engine.stats import SpecSettings
from specserve.engine.step_input import item_forest
from specserve.model.arch import arch_from_hf_config
from specserve.model.bamba import BambaForCausalLM
from specserve.model.head_checkpoint import random_head, save_head
from specserve.model.loader import load_model
from specserve.model.parallel import TPInfo
from specserve.model.tokenizer import load_tokenizer
from specserve.spec.drafter import Drafter
from specserve.spec.tree import build_tree

from engine_utils import assert_logprobs_equal, hf_greedy, last_logits, max_rel_error, motif_prompts
from tiny_models import save_tiny_bamba, save_tiny_llama3

VOCAB = 96
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy 2-core machine their spinning
    made this module ten times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def folders(smollm2_gguf, tmp_path_factory):
    tokenizer = load_tokenizer(smollm2_gguf)
    root = tmp_path_factory.mktemp("hybrid")
    return {
        "target": save_tiny_bamba(root / "bamba", tokenizer, VOCAB),
        "draft": save_tiny_llama3(root / "llama", tokenizer, VOCAB),
    }


@pytest.fixture(scope="module")
def target(folders):
    return load_model(str(folders["target"]), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def drafts(folders, target, tmp_path_factory):
    """Draft model folders by method: a random Llama (standalone) and random heads over the target."""
    root = tmp_path_factory.mktemp("heads")
    shapes = {"eagle": {}, "eagle3": {"draft_vocab_size": 48}, "mtp": {"num_modules": 2}}
    heads = {m: save_head(root / m, *random_head(m, target.arch, seed=9, **kw)) for m, kw in shapes.items()}
    return {"ngram": None, "standalone": folders["draft"], **heads}


@pytest.fixture(scope="module")
def prompts():
    return motif_prompts(6, VOCAB, seed=11)


@pytest.fixture(scope="module")
def reference(target, prompts):
    """Plain greedy outputs (overlap scheduling, the default without speculation), by prompt."""
    outs = LLM(target, device="cpu", dtype="float32").generate(prompts, GREEDY)
    return {tuple(p): o.token_ids for p, o in zip(prompts, outs, strict=True)}


def test_the_bamba_layout_is_read(target):
    arch = target.arch
    assert arch.is_hybrid and arch.attention_layers == (1, 3) and arch.mamba_layers == (0, 2)
    assert arch.kv_layers == 2 and arch.rotary_dim == arch.head_dim // 2
    m = arch.mamba
    assert (m.num_heads, m.head_dim, m.num_groups, m.state_size, m.conv_kernel) == (8, 16, 2, 16, 4)
    assert m.conv_dim == 8 * 16 + 2 * 2 * 16 and m.chunk_size == 8
    assert isinstance(target.model, BambaForCausalLM)
    per_slot = 2 * (4 * 8 * 16 * 16 + 4 * 3 * m.conv_dim)
    assert StatePool.bytes_per_slot(arch, torch.float32) == per_slot
    config = json.loads((target.location.path / "config.json").read_text())
    bad = {
        "attn_layer_indices": {"attn_layer_indices": []},
        "mamba_d_head": {"mamba_d_head": 12},
        "mamba_n_groups": {"mamba_n_groups": 3},
        "attention_bias": {"attention_bias": True},
    }
    for match, change in bad.items():
        with pytest.raises(ValueError, match=match):
            arch_from_hf_config({**config, **change})


def test_logits_and_greedy_match_transformers(folders, target, prompts):
    """fp32 on the CPU: last logits of a batch (ragged, prompts spanning several scan blocks), every
    prompt position through chunked prefill (the state carried across steps), and greedy decoding
    (HF's recurrent decode path) against transformers' Bamba."""
    hf = AutoModelForCausalLM.from_pretrained(folders["target"], dtype=torch.float32).eval()
    llm = LLM(target, device="cpu", dtype="float32", max_batched_tokens=7)
    batch = prompts[:4]
    ours = last_logits(llm.engine, batch)
    with torch.no_grad():
        theirs = torch.stack([hf(torch.tensor([p])).logits[0, -1].float() for p in batch])
    assert max_rel_error(ours, theirs) < 1e-4
    prompt = max(prompts, key=len)
    scored = llm.generate(
        [prompt], SamplingParams(max_new_tokens=0, return_logprob=True, logprob_start_len=0)
    )
    mine = torch.tensor([e[0] for e in scored[0].meta["input_token_logprobs"][1:]])
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    expected = logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert (mine - expected).abs().max() < 1e-4
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    for p in prompts[:2]:
        assert llm.generate([p], greedy)[0].token_ids == hf_greedy(hf, p, 12)


SPECS = {
    "ngram-chain": {"method": "ngram", "num_steps": 3},
    "ngram-tree": {"method": "ngram", "num_steps": 4, "topk": 2, "num_draft_tokens": 8},
    "standalone-chain": {"method": "standalone", "num_steps": 3},
    "standalone-tree": {"method": "standalone", "num_steps": 3, "topk": 2, "num_draft_tokens": 6},
    "eagle-chain": {"method": "eagle", "num_steps": 3},
    "eagle3-tree": {"method": "eagle3", "num_steps": 3, "topk": 2, "num_draft_tokens": 6},
    "mtp-chain": {"method": "mtp", "num_steps": 2},
    "mtp-tree": {"method": "mtp", "num_steps": 2, "topk": 3, "num_draft_tokens": 6},
}


@pytest.mark.parametrize("batch", [1, 6])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", list(SPECS))
def test_real_drafters_are_lossless(target, drafts, prompts, reference, name, page_size, batch):
    spec = dict(SPECS[name])
    if drafts[spec["method"]] is not None:
        spec["draft_model"] = str(drafts[spec["method"]])
    llm = LLM(target, device="cpu", dtype="float32", page_size=page_size, speculative=spec)
    outs = llm.generate(prompts[:batch], GREEDY)
    assert [o.token_ids for o in outs] == [reference[tuple(p)] for p in prompts[:batch]]
    assert all(o.meta["spec_verify_ct"] > 0 for o in outs)


class OracleDrafter(Drafter):
    """Proposes each request's reference continuation, each token wrong with probability `wrong`; a
    tree puts the (possibly wrong) true token beside a decoy at every depth, in random order, and
    grows a decoy's own child now and then (test-only)."""

    def __init__(self, reference: dict[tuple, list[int]], wrong: float, seed: int) -> None:
        self.reference, self.wrong, self.rng = reference, wrong, random.Random(seed)

    def _truth(self, req, count: int) -> list[int]:
        ahead = self.reference[tuple(req.prompt_ids)][req.num_output : req.num_output + count]
        return [self._spoil(t) if self.rng.random() < self.wrong else t for t in ahead]

    def _spoil(self, token: int) -> int:
        return (token + self.rng.randrange(1, VOCAB - 3)) % VOCAB

    def draft(self, reqs, budgets) -> None:
        for req, budget in zip(reqs, budgets, strict=True):
            req.draft, req.draft_probs = self._truth(req, budget), None

    def draft_tree(self, reqs, depths, topk, num_nodes) -> None:
        for req, depth in zip(reqs, depths, strict=True):
            tokens, parents, cands = [], [], [[]]
            main = 0  # the row continuing the true path
            for token in self._truth(req, depth):
                if len(tokens) + 2 > num_nodes:
                    break
                pair = [(self._spoil(token), "decoy"), (token, "true")]
                self.rng.shuffle(pair)
                rows = {}
                for tok, kind in pair:
                    tokens.append(tok)
                    parents.append(main)
                    cands.append([])
                    rows[kind] = len(tokens)
                    cands[main].append((tok, len(tokens)))
                if len(tokens) < num_nodes and self.rng.random() < 0.5:  # a branch off the path
                    decoy = rows["decoy"]
                    tokens.append(self._spoil(token))
                    parents.append(decoy)
                    cands.append([])
                    cands[decoy].append((tokens[-1], len(tokens)))
                main = rows["true"]
            tree = build_tree(tokens, parents, cands, max(topk, 2)) if tokens else None
            req.draft, req.draft_tree, req.draft_probs = list(tokens), tree, None


def oracle_run(
    target, reference, prompts, settings: SpecSettings, page_size: int, seed: int, params=GREEDY, **kwargs
):
    """Outputs of `prompts` under the oracle drafter (accounting checked after every step)."""
    spec = {"method": "ngram", "num_steps": settings.num_steps, "topk": settings.topk}
    if settings.topk > 1:
        spec["num_draft_tokens"] = settings.num_draft_tokens
    llm = LLM(target, device="cpu", dtype="float32", page_size=page_size, speculative=spec, **kwargs)
    engine = llm.engine
    engine.drafter = OracleDrafter(reference, wrong=0.2, seed=seed)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_kv_accounting()
    return llm, [done[i] for i in ids]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    "settings", [SpecSettings(4, 1, 4), SpecSettings(5, 2, 12), SpecSettings(3, 3, 9)], ids=str
)
def test_oracle_drafts_are_lossless(target, prompts, reference, settings, page_size):
    _, outs = oracle_run(target, reference, prompts, settings, page_size, seed=page_size)
    assert [o.token_ids for o in outs] == [reference[tuple(p)] for p in prompts]
    histogram = [
        sum(h) for h in zip(*(o.meta["spec_accept_histogram"] + [0] * 8 for o in outs), strict=False)
    ]
    # Drafts were accepted to every depth, and rejected at the first token too.
    assert histogram[0] > 0 and all(histogram[d] > 0 for d in range(1, settings.num_steps + 1))


def test_logprobs_equal_prefill_scoring(target, prompts, reference):
    """Invariant 3: token, top-k and chosen-id logprobs read during tree speculation equal scoring
    the same sequence with a prefill-only request."""
    asked = dict(return_logprob=True, top_logprobs_num=3, token_ids_logprob=[1, 5, 50])
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, **asked)
    prompt = prompts[3]
    _, (out,) = oracle_run(target, reference, [prompt], SpecSettings(4, 2, 10), 4, seed=3, params=params)
    assert out.meta["spec_accepted_tokens"] > 4
    plain = LLM(target, device="cpu", dtype="float32")
    scored = plain.generate(
        [prompt + out.token_ids], SamplingParams(max_new_tokens=0, logprob_start_len=len(prompt), **asked)
    )[0].meta
    assert_logprobs_equal(out.meta, scored)


@pytest.mark.parametrize("speculate", [True, False], ids=["oracle-trees", "plain-overlapped"])
def test_retract_and_abort_under_a_tiny_pool(target, prompts, reference, speculate):
    """A pool too small for every request at once: requests are retracted (state slot freed with
    the pages, recomputed from a zero state) and one is aborted mid-way; the rest match plain decoding.
    Without speculation the steps overlap (an aborted request's slot may be handed out while its
    last step is in flight: the new owner starts from a zero state whatever the slot holds)."""
    spec = {"method": "ngram", "num_steps": 4, "topk": 2, "num_draft_tokens": 8} if speculate else None
    llm = LLM(target, device="cpu", dtype="float32", page_size=2, max_total_tokens=120, speculative=spec)
    engine = llm.engine
    assert engine._overlap is not speculate
    if speculate:
        engine.drafter = OracleDrafter(reference, wrong=0.2, seed=5)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done, aborted = {}, ids[2]
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if steps == 6:
            assert engine.abort(aborted)
        engine.check_kv_accounting()
        assert engine.states.num_free == engine.states.capacity - len(engine.scheduler.running)
    assert engine.scheduler.num_retracted > 0
    assert done[aborted].finish_reason == "abort"
    for request_id, prompt in zip(ids, prompts, strict=True):
        if request_id != aborted:
            assert done[request_id].token_ids == reference[tuple(prompt)]


def test_sampled_speculation_is_reproducible(target, prompts, reference):
    """Sampling with tree drafts: a request's tokens do not depend on its batch."""
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    spec = {"method": "ngram", "num_steps": 3, "topk": 2, "num_draft_tokens": 6}
    llm = LLM(target, device="cpu", dtype="float32", speculative=spec)
    alone = llm.generate([prompts[0]], params)[0]
    together = llm.generate(prompts[:3], [params, GREEDY, params])
    assert alone.token_ids == together[0].token_ids
    assert together[1].token_ids == reference[tuple(prompts[1])]


def test_the_triton_commit_inside_the_engine(target, prompts, reference, monkeypatch):
    """The engine's kernels under the interpreter: state_commit, verify_tree, kv_move, and the Triton
    attention backend (its plain KV write: Bamba's partial RoPE is applied before it)."""
    monkeypatch.setenv("SPECSERVE_TRITON_CPU", "1")
    settings = SpecSettings(3, 2, 6)
    _, outs = oracle_run(target, reference, prompts[:2], settings, 4, seed=9, attention_backend="triton")
    assert [o.token_ids for o in outs] == [reference[tuple(p)] for p in prompts[:2]]
    assert sum(o.meta["spec_accepted_tokens"] for o in outs) > 0


def test_what_hybrid_models_refuse(target, folders):
    """Each refusal names its setting; the defaults work (prefix caching and CUDA graphs off)."""
    engine = LLM(target, device="cpu", dtype="float32").engine
    assert engine.kv.prefix_cache is None and engine.config.cuda_graphs is False
    assert engine.config.cache.enable_prefix_cache is False
    refused = {
        "enable_prefix_cache": dict(enable_prefix_cache=True),
        "cuda_graphs": dict(cuda_graphs=True),
        "speculative.draft_model": dict(
            speculative={"method": "standalone", "draft_model": str(folders["target"])}
        ),
    }
    for name, kwargs in refused.items():
        with pytest.raises(ValueError, match=name):
            LLM(target, device="cpu", dtype="float32", **kwargs)
    with pytest.raises(ValueError, match="tp_size"):
        EngineConfig(model=str(folders["target"]), tp_size=2).for_model(hybrid=True)
    with pytest.raises(ValueError, match="tp_size"):
        BambaForCausalLM(target.arch, TPInfo(rank=0, size=2, group=None))
    # A plain model keeps its prefix cache by default.
    assert EngineConfig().for_model(hybrid=False).cache.enable_prefix_cache is True
    assert isinstance(engine, Engine)


@pytest.mark.gpu
def test_hybrid_speculation_on_the_gpu(folders, prompts):
    """bf16 on CUDA (Triton attention and commit kernels): tree and chain speculation against plain
    decoding; near-ties may flip in bf16, so the match rate is reported and must stay high."""
    loaded = load_model(str(folders["target"]), torch.device("cuda"), torch.bfloat16)
    params = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(loaded).generate(prompts, params)]
    for spec in (SPECS["ngram-chain"], SPECS["ngram-tree"]):
        outs = LLM(loaded, speculative=spec).generate(prompts, params)
        same = sum(o.token_ids == p for o, p in zip(outs, plain, strict=True))
        print(f"{spec}: {same}/{len(prompts)} outputs identical to plain bf16 decoding")
        assert same >= len(prompts) - 1


def test_the_mixer_equals_its_recurrence_token_by_token(target):
    """One Mamba-2 layer over a mixed step (a fresh prefill longer than a scan block, a continued
    prefill chunk, a verified chain, a verified tree) against the recurrence run row by row along
    each row's parent path: outputs, end states written to live slots, and every tracked row's snapshot."""
    arch, mixer = target.arch, target.model.model.layers[0].mamba
    m, k = arch.mamba, arch.mamba.conv_kernel
    gen = torch.Generator().manual_seed(0)
    pool = StatePool(arch, 5, torch.float32, torch.device("cpu"))
    pool.ssm.copy_(torch.randn(pool.ssm.shape, generator=gen) * 0.3)
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=gen))
    tree = build_tree([7, 8, 9, 10, 11, 12], [0, 0, 1, 1, 3, 2], [[]] * 7, 2)
    shapes = [  # (slot, start, known tokens, draft, tree)
        (0, 0, 19, (), None),
        (1, 5, 6, (), None),
        (2, 10, 1, (4, 5, 6), None),
        (3, 7, 1, tree.tokens, tree),
    ]
    items = []
    for slot, start, known, draft, draft_tree in shapes:
        req = Request(f"r{slot}", [3] * (start + known), SamplingParams(), seed=0)
        req.state_slot, req.draft_tree = slot, draft_tree
        items.append(ScheduledItem(req, start, known + len(draft), True, tuple(draft)))
    batch = build_recurrent_batch(items, k, m.chunk_size, torch.device("cpu"))
    assert len(batch.groups) == 2 and batch.num_snapshots == 4 + 7
    hidden = torch.randn(sum(it.num_tokens for it in items), arch.hidden_size, generator=gen)
    live_ssm, live_conv = pool.ssm[0].clone(), pool.conv[0].clone()
    with torch.no_grad():
        context = pool.context(batch)
        out = mixer(hidden, context)
        expected, offset = [], 0
        for item in items:
            parents = item_forest(item)
            parents = list(range(-1, item.num_tokens - 1)) if parents is None else parents.tolist()
            fresh = item.start == 0
            slot = item.request.state_slot
            start_state = torch.zeros_like(live_ssm[slot]) if fresh else live_ssm[slot]
            start_window = list(torch.zeros_like(live_conv[slot]) if fresh else live_conv[slot])
            rows = _recurrence(
                mixer, hidden[offset : offset + item.num_tokens], parents, start_state, start_window
            )
            expected += [y for y, _, _ in rows]
            if item.draft:
                first = next(f for i, f, _ in batch.tracked if items[i] is item)
                for r in range(item.num_known - 1, item.num_tokens):
                    snap = first + r - (item.num_known - 1)
                    torch.testing.assert_close(context.snap_ssm[0, snap], rows[r][1], atol=1e-4, rtol=1e-4)
                    torch.testing.assert_close(context.snap_conv[0, snap], rows[r][2], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(pool.ssm[0, slot], live_ssm[slot])  # untouched until commit
            else:
                torch.testing.assert_close(pool.ssm[0, slot], rows[-1][1], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(pool.conv[0, slot], rows[-1][2], atol=1e-5, rtol=1e-5)
            offset += item.num_tokens
    torch.testing.assert_close(out, torch.stack(expected), atol=1e-4, rtol=1e-4)


def _recurrence(mixer, hidden, parents, state, window):
    """Row by row: (output, state after, convolution window after) of each row along its path."""
    m = mixer.shape
    z, xbc, dt = mixer.in_proj(hidden).split([m.inner_size, m.conv_dim, m.num_heads], dim=-1)
    a = -torch.exp(mixer.A_log)
    weight, bias = mixer.conv1d.weight[:, 0, :], mixer.conv1d.bias
    rows = []
    for r, parent in enumerate(parents):
        prev_state, prev_window = (state, window) if parent < 0 else rows[parent][1:]
        inputs = [*list(prev_window), xbc[r]]  # oldest first, K entries
        conv = torch.nn.functional.silu(sum(weight[:, j] * inputs[j] for j in range(len(inputs))) + bias)
        x, b, c = conv.split([m.inner_size, m.num_groups * m.state_size, m.num_groups * m.state_size])
        x = x.view(m.num_heads, m.head_dim)
        per_group = m.num_heads // m.num_groups
        b = b.view(m.num_groups, m.state_size).repeat_interleave(per_group, 0)
        c = c.view(m.num_groups, m.state_size).repeat_interleave(per_group, 0)
        step = torch.nn.functional.softplus(dt[r] + mixer.dt_bias)
        new_state = (
            torch.exp(step * a)[:, None, None] * prev_state
            + step[:, None, None] * x[:, :, None] * b[:, None, :]
        )
        y = (new_state * c[:, None, :]).sum(-1) + mixer.D[:, None] * x
        out = mixer.out_proj(mixer.norm(y.reshape(1, -1), z[r : r + 1]))[0]
        rows.append((out, new_state, torch.stack(inputs[1:])))
    return rows
