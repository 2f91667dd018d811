"""Speculative decoding with the n-gram drafter: lossless greedy and sampling, logprobs, KV, stats."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.sampler import SamplingRow, filtered_probs_ref
from specserve.model.head_checkpoint import random_head, save_head
from specserve.model.loader import load_model
from specserve.spec.ngram import NgramDrafter
from specserve.spec.verify import verify_chains

from engine_utils import assert_follows, assert_logprobs_equal


@pytest.fixture(scope="module")
def loaded(smollm2_gguf):
    return load_model(str(smollm2_gguf), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def prompts(loaded):
    """Prompts whose answers repeat their own text, so n-gram drafts get accepted."""
    tok = loaded.tokenizer
    texts = [
        "Repeat this list exactly three times: apple, banana, cherry, date, elderberry.",
        "Write the numbers from 1 to 30 separated by commas.",
        "Copy this sentence twice: The quick brown fox jumps over the lazy dog.",
        "def add(a, b):\n    return a + b\n\nRewrite the function above with type hints.",
        "Say hello.",
    ]
    return [
        tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True, add_generation_prompt=True)
        for t in texts
    ]


def _ids(p) -> list[int]:
    return list(p["input_ids"] if hasattr(p, "keys") else p)


def _llm(loaded, speculative=None, **kwargs) -> LLM:
    return LLM(
        loaded, device="cpu", dtype="float32", max_total_tokens=4096, speculative=speculative, **kwargs
    )


def test_ngram_drafter_proposes_the_latest_continuation():
    d = NgramDrafter(min_match=1, max_match=3)
    assert d.propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert d.propose([9, 1, 2, 5, 1, 2, 6, 1, 2], 1) == [6]  # latest of several matches
    assert d.propose([5, 6, 7], 2) == []
    assert d.propose([1, 2, 3, 1, 2, 3], 0) == []


@pytest.mark.parametrize(("num_steps", "page_size"), [(1, 1), (3, 16), (5, 1)])
def test_greedy_is_lossless(loaded, prompts, num_steps, page_size):
    params = SamplingParams(max_new_tokens=48, temperature=0.0)
    batch = [_ids(p) for p in prompts]
    reference = _llm(loaded, page_size=page_size).generate(batch, params)
    spec = _llm(loaded, {"method": "ngram", "num_steps": num_steps}, page_size=page_size)
    together = spec.generate(batch, params)
    alone = [spec.generate([p], params)[0] for p in batch[:2]]
    assert [o.token_ids for o in together] == [r.token_ids for r in reference]
    assert [o.token_ids for o in alone] == [r.token_ids for r in reference[:2]]
    assert [o.text for o in together] == [r.text for r in reference]
    accepted = sum(o.meta["completion_tokens"] for o in together) / sum(
        o.meta["spec_verify_ct"] for o in together
    )
    assert accepted > 1.2, "repetitive prompts should accept some drafts"
    for o in together:
        assert sum(o.meta["spec_accept_histogram"]) == o.meta["spec_verify_ct"]


def test_greedy_lossless_under_retraction(loaded, prompts):
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    batch = [_ids(p) for p in prompts]
    reference = _llm(loaded).generate(batch, params)
    tight = LLM(
        loaded,
        device="cpu",
        dtype="float32",
        page_size=4,
        max_total_tokens=200,
        enable_prefix_cache=False,
        speculative={"method": "ngram", "num_steps": 4},
    )
    outs = tight.generate(batch, params)
    assert tight.engine.scheduler.num_retracted > 0
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]


def test_stops_inside_an_accepted_chain(loaded, prompts):
    free = _llm(loaded).generate([_ids(prompts[1])], SamplingParams(max_new_tokens=40, temperature=0.0))[0]
    stop_at = free.token_ids[12]
    params = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=[stop_at])
    spec = _llm(loaded, {"method": "ngram", "num_steps": 6}).generate([_ids(prompts[1])], params)[0]
    assert spec.token_ids == free.token_ids[: free.token_ids.index(stop_at) + 1]
    capped = _llm(loaded, {"method": "ngram", "num_steps": 6}).generate(
        [_ids(prompts[1])], SamplingParams(max_new_tokens=7, temperature=0.0)
    )[0]
    assert capped.token_ids == free.token_ids[:7]


@pytest.fixture(scope="module")
def random_heads(loaded, tmp_path_factory):
    """Random EAGLE / EAGLE-3 (reduced vocabulary) / 2-layer MTP heads shaped for SmolLM2."""
    root = tmp_path_factory.mktemp("heads")
    shapes = {"eagle": {}, "eagle3": {"draft_vocab_size": 8192}, "mtp": {"num_modules": 2}}
    return {
        method: save_head(root / method, *random_head(method, loaded.arch, seed=3, init_std=0.02, **kwargs))
        for method, kwargs in shapes.items()
    }


@pytest.mark.parametrize("method", ["ngram", "standalone", "eagle", "eagle3", "mtp"])
def test_logprobs_equal_prefill_scoring(loaded, prompts, random_heads, method):
    spec = {"method": method, "num_steps": 4}
    if method == "standalone":
        spec["draft_model"] = str(loaded.location.path)  # self-draft: long accepted chains
    elif method != "ngram":
        spec["draft_model"] = str(random_heads[method])
    llm = _llm(loaded, spec)
    prompt = _ids(prompts[0])
    probes = [1, 2, 10, 100, 1000]
    out = llm.generate(
        [prompt],
        SamplingParams(
            max_new_tokens=32,
            temperature=0.0,
            return_logprob=True,
            top_logprobs_num=5,
            token_ids_logprob=probes,
            logprob_start_len=0,
        ),
    )[0]
    if method in ("ngram", "standalone"):  # random heads rarely guess a real model's next token
        assert out.meta["spec_verify_ct"] < len(out.token_ids)
    assert out.meta["spec_accepted_tokens"] <= out.meta["spec_draft_tokens"]
    scored = llm.generate(
        [prompt + out.token_ids],
        SamplingParams(
            max_new_tokens=0,
            return_logprob=True,
            top_logprobs_num=5,
            token_ids_logprob=probes,
            logprob_start_len=len(prompt),
        ),
    )[0].meta
    decoded = out.meta["output_token_logprobs"]
    assert len(out.meta["input_token_logprobs"]) == len(prompt)
    assert [e[1] for e in decoded] == out.token_ids == [e[1] for e in scored["input_token_logprobs"]]
    assert_logprobs_equal(out.meta, scored)


def test_abort_during_speculation_frees_pages(loaded, prompts, tiny_draft):
    spec = {"method": "standalone", "draft_model": str(tiny_draft), "num_steps": 3}
    with pytest.raises(ValueError, match="speculative.draft_model.*max_model_len"):
        _llm(loaded, spec)  # the tiny draft's context (512) is shorter than SmolLM2's
    llm = _llm(loaded, spec, max_model_len=512)
    engine = llm.engine
    ids = [
        engine.add_request(_ids(p), SamplingParams(max_new_tokens=30, temperature=0.0)) for p in prompts[:3]
    ]
    for _ in range(4):
        engine.step()
    assert engine.abort(ids[0])
    while engine.has_unfinished():
        engine.step()


def test_seeded_sampling_with_speculation_is_reproducible(loaded, prompts):
    params = SamplingParams(max_new_tokens=24, temperature=0.7, seed=11)
    llm = _llm(loaded, {"method": "ngram", "num_steps": 3})
    a = llm.generate([_ids(prompts[0])], params)[0]
    b = llm.generate([_ids(prompts[1]), _ids(prompts[0])], [SamplingParams(max_new_tokens=5), params])[1]
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize(
    "row",
    [
        SamplingRow(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0),
        SamplingRow(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=0, counter=0),
    ],
)
def test_rejection_sampling_emits_the_target_distribution(row):
    """χ² of the first emitted token over many seeds with a deterministic (n-gram-like) draft that is
    plausible but not the mode: drafted or not, it is distributed as p_0."""
    vocab, draws = 12, 20000
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(3), dtype=torch.float32) * 1.5
    expected = filtered_probs_ref(logits[0], row).numpy()
    draft = int(np.argsort(expected)[-2])
    rows = [_row(row, seed, j) for seed in range(draws) for j in range(2)]
    chains, _ = verify_chains(logits[[0, 1] * draws], rows, [[draft]] * draws)
    assert_follows([c[0] for c in chains], expected)


def test_all_greedy_chains_take_the_shortcut_to_the_same_tokens():
    """An all-greedy batch skips the rejection rule's probabilities and noise; its chains must emit
    what the rule emits for the same greedy rows beside a sampling one (which forces the rule)."""
    gen = torch.Generator().manual_seed(5)
    vocab, lengths = 16, [3, 0, 5, 1, 4]
    logits = torch.randn(sum(lengths) + len(lengths) + 2, vocab, generator=gen)
    best = logits.argmax(-1).tolist()
    drafts, row = [], 0
    for n in lengths:  # drafts matching the argmax for a random prefix, then wrong
        keep = int(torch.randint(0, n + 1, (1,), generator=gen))
        drafts.append([best[row + j] if j < keep else (best[row + j] + 1) % vocab for j in range(n)])
        row += n + 1
    greedy = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0)
    sampled = SamplingRow(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1, counter=0)
    rows = [greedy] * row
    shortcut, _ = verify_chains(logits[:row], rows, drafts)
    ruled, _ = verify_chains(logits, [*rows, sampled, sampled], [*drafts, [3]])
    assert shortcut == ruled[: len(drafts)]
    assert [len(c) for c in shortcut] != [n + 1 for n in lengths]  # some drafts were rejected


def _row(row: SamplingRow, seed: int, counter: int) -> SamplingRow:
    return SamplingRow(row.temperature, row.top_k, row.top_p, row.min_p, seed, counter)


@pytest.mark.parametrize(
    "row",
    [
        SamplingRow(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0),
        SamplingRow(temperature=0.8, top_k=4, top_p=0.9, min_p=0.0, seed=0, counter=0),
    ],
)
def test_rejection_sampling_over_two_positions(row):
    """Drafts sampled from a drafter's own conditional q (as model drafters do): accept min(1, p/q),
    else draw from norm(max(p - q, 0)), bonus token when all are accepted. The joint distribution
    of the first two emitted tokens must be the target's p0(a) p1(b | a) exactly (χ² over all
    pairs). Where the first step stops early, a second step drafts and verifies the next position
    given the emitted token, as the engine does."""
    vocab, draws = 6, 24000
    g = torch.Generator().manual_seed(11)
    target = [torch.randn(vocab, generator=g) * 1.5, torch.randn(vocab, vocab, generator=g) * 1.5]
    drafter = [torch.randn(vocab, generator=g) * 1.5, torch.randn(vocab, vocab, generator=g) * 1.5]
    p0 = filtered_probs_ref(target[0], row)
    q0 = filtered_probs_ref(drafter[0], row)
    q1 = torch.stack([filtered_probs_ref(drafter[1][a], row) for a in range(vocab)])
    rng = np.random.default_rng(0)

    def draw(q: torch.Tensor) -> int:
        return int(rng.choice(vocab, p=q.numpy() / q.sum().item()))

    first = [draw(q0) for _ in range(draws)]
    second = [draw(q1[a]) for a in first]
    logits = torch.stack([target[0], *target[1]])  # row 0: p0; row 1 + a: p1(. | a)
    index, rows, probs = [], [], []
    for seed, (a, b) in enumerate(zip(first, second, strict=True)):
        index += [0, 1 + a, 1 + b]  # the bonus row's logits do not matter here
        rows += [_row(row, seed, j) for j in range(3)]
        probs += [q0, q1[a], torch.zeros(vocab)]
    chains, _ = verify_chains(
        logits[index], rows, list(zip(first, second, strict=True)), None, torch.stack(probs)
    )
    short = [s for s, c in enumerate(chains) if len(c) < 2]
    assert 0 < len(short) < draws and any(len(c) == 3 for c in chains)  # every branch exercised
    redraft = [draw(q1[chains[s][0]]) for s in short]
    index, rows, probs = [], [], []
    for s in short:
        index += [1 + chains[s][0], 0]
        rows += [_row(row, s, 1), _row(row, s, 2)]
        probs += [q1[chains[s][0]], torch.zeros(vocab)]
    followers, _ = verify_chains(logits[index], rows, [[d] for d in redraft], None, torch.stack(probs))
    for s, follow in zip(short, followers, strict=True):
        chains[s] = chains[s] + follow[:1]
    pairs = [c[0] * vocab + c[1] for c in chains]
    p1 = torch.stack([filtered_probs_ref(target[1][a], row) for a in range(vocab)])
    assert_follows(pairs, (p0[:, None] * p1).flatten().numpy())


def test_standalone_self_draft_accepts_every_draft(loaded, prompts):
    """Drafting with the target itself: in greedy every draft is accepted, so each verify step emits
    num_steps + 1 tokens (fewer only where max_new_tokens cuts the last chain): 1 token from the
    prefill, then 4 + 4 + 4 + 4 + 4 + 3."""
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    batch = [_ids(p) for p in prompts[:3]]
    reference = _llm(loaded).generate(batch, params)
    spec = _llm(
        loaded,
        {"method": "standalone", "draft_model": str(loaded.location.path), "num_steps": 3},
        page_size=4,
    )
    outs = spec.generate(batch, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    for o in outs:
        assert o.meta["spec_verify_ct"] == 6 and o.meta["spec_accept_histogram"] == [0, 0, 1, 5]


@pytest.fixture(scope="module")
def tiny_draft(loaded, tmp_path_factory):
    from tiny_models import save_tiny_llama3

    return save_tiny_llama3(tmp_path_factory.mktemp("draft") / "tiny", loaded.tokenizer)


@pytest.mark.parametrize("page_size", [1, 16])
def test_standalone_weak_draft_is_lossless(loaded, prompts, tiny_draft, page_size):
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    batch = [_ids(p) for p in prompts]
    reference = _llm(loaded, page_size=page_size).generate(batch, params)
    spec = _llm(
        loaded,
        {"method": "standalone", "draft_model": str(tiny_draft), "num_steps": 3},
        page_size=page_size,
        max_model_len=512,
    )
    assert [o.token_ids for o in spec.generate(batch, params)] == [r.token_ids for r in reference]
    sampled = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3)
    a = spec.generate([batch[0]], sampled)[0]
    assert a.token_ids == spec.generate([batch[1], batch[0]], sampled)[1].token_ids


def test_standalone_needs_a_draft_model_with_the_same_vocabulary(loaded, tmp_path):
    with pytest.raises(ValueError, match="speculative.draft_model"):
        _llm(loaded, {"method": "standalone"})


def test_host_work_put_off_until_the_next_forward_loses_nothing(loaded, prompts):
    """A speculative step leaves its prefix-cache commits and the detokenising of requests nobody
    streams to the next step's forward (`Engine._while_device_works`): the texts come out as a
    streamed request's, and every page still enters the cache."""
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    engine = _llm(loaded, {"method": "ngram", "num_steps": 4}, page_size=1).engine
    prompt = _ids(prompts[0])
    quiet = engine.add_request(prompt, params, stream=False)
    streamed = engine.add_request(prompt, params, stream=True)
    outputs: dict[str, list] = {quiet: [], streamed: []}
    put_off = unread = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
        put_off += bool(engine.kv._later)
        unread += bool(engine._unread_texts)
    assert put_off and unread  # the steps did leave work for the next forward
    (last,), chunks = outputs[quiet], outputs[streamed]
    assert last.token_ids == chunks[-1].token_ids
    assert last.text == chunks[-1].text == "".join(c.delta_text for c in chunks)
    # The whole sequence but its last token (which has no KV) is cached.
    sequence = prompt + last.token_ids
    rid = engine.add_request(sequence, SamplingParams(max_new_tokens=1, temperature=0.0), stream=False)
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.request_id == rid and o.finished]
    assert done[0].meta["cached_tokens"] == len(sequence) - 1
    engine.check_kv_accounting()
