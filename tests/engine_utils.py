"""Helpers for engine tests (a helper module, not a test file)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import chisquare

from specserve.engine.engine import Engine
from specserve.engine.request import Request
from specserve.engine.scheduler import ScheduledItem
from specserve.engine.step_input import build_step_input
from specserve.types import SamplingParams


def last_logits(engine: Engine, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Last-position logits [B, V] of a batch of prompts, through the engine's paged path in one step
    (its runner: under TP rank 0 this drives the followers too)."""
    reqs = [
        Request(f"probe-{i}", list(p), SamplingParams(max_new_tokens=1), seed=0)
        for i, p in enumerate(prompts)
    ]
    try:
        for req in reqs:
            assert engine.kv.reserve(req, req.prompt_len), "KV pool too small for the probe"
        items = [ScheduledItem.of(req, req.prompt_len) for req in reqs]
        # Eager (no graph bucket); a hybrid model's step also needs its recurrent layout.
        hybrid = engine.states is not None
        inp = (
            engine.build_input(items)
            if hybrid
            else build_step_input(items, engine.kv.page_size, engine.device)
        )
        _, _, logits = engine.runner.execute(inp)
        return logits[inp.sample_logit_rows]
    finally:
        for req in reqs:
            engine.kv.free(req)


def hf_greedy(model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by HF transformers `generate` (stops at EOS like the engine does)."""
    ids = torch.tensor([list(prompt)], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        top_p=None,
        top_k=None,
        temperature=None,
    )
    return out[0, ids.shape[1] :].tolist()


def hf_last_logits(model, prompt: Sequence[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([list(prompt)], device=model.device)).logits[0, -1].float()


def max_rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def assert_same_outputs(ours, reference, tol: float = 1e-4) -> None:
    """The same tokens, and each output token's logprob within `tol` (outputs made with `return_logprob`)."""
    assert [o.token_ids for o in ours] == [r.token_ids for r in reference]
    for o, r in zip(ours, reference, strict=True):
        mine = [entry[0] for entry in o.meta["output_token_logprobs"]]
        theirs = [entry[0] for entry in r.meta["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(mine, theirs, strict=True)) <= tol


OUTPUT_LOGPROB_FIELDS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


def assert_same_logprobs(ours, reference, tol: float = 1e-4) -> None:
    """The same tokens, and every output logprob field (the token's, top k, named ids) of each
    output with the same entries: ids and texts equal, logprobs within `tol`."""
    assert [o.token_ids for o in ours] == [r.token_ids for r in reference]
    for o, r in zip(ours, reference, strict=True):
        for name in OUTPUT_LOGPROB_FIELDS:
            mine, theirs = o.meta.get(name), r.meta.get(name)
            assert (mine is None) == (theirs is None), name
            for a, b in zip(_entries(mine or []), _entries(theirs or []), strict=True):
                assert a[1:] == b[1:] and abs(a[0] - b[0]) <= tol, (name, a, b)


def _entries(field: list) -> list[list]:
    """A logprob field's [logprob, id, text] entries, flat (top k and named ids: a list a position)."""
    return [e for pos in field for e in (pos if pos and isinstance(pos[0], list) else [pos])]


def assert_logprobs_equal(decoded: dict, scored: dict, tol: float = 1e-4) -> None:
    """Invariant 3: a decoded output's token, top-k and chosen-id logprobs (`meta` with `output_*`)
    equal a prefill-only scoring's of the same tokens (`meta` with `input_*`), within `tol`."""
    pairs = [(decoded["output_token_logprobs"], scored["input_token_logprobs"])]
    pairs += list(zip(decoded["output_top_logprobs"], scored["input_top_logprobs"], strict=True))
    pairs += list(zip(decoded["output_token_ids_logprobs"], scored["input_token_ids_logprobs"], strict=True))
    for ours, reference in pairs:
        assert [e[1] for e in ours] == [e[1] for e in reference]
        assert max(abs(a[0] - b[0]) for a, b in zip(ours, reference, strict=True)) <= tol


@dataclass(frozen=True)
class Agreement:
    """How two engines agree on the same prompts: greedy outputs identical, first tokens equal (of
    `total`), and the largest absolute and relative difference of their last-position logits."""

    identical: int
    first: int
    total: int
    max_abs: float
    max_rel: float

    def __str__(self) -> str:
        return (
            f"{self.identical}/{self.total} greedy outputs identical, first tokens {self.first}/{self.total}, "
            f"max abs logit diff {self.max_abs:.4g}, max rel {self.max_rel:.3g}"
        )


def agreement(ours, reference, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64) -> Agreement:
    """`ours` against `reference` (two `LLM`s): last logits of the prompts, then greedy continuations."""
    mine, theirs = (last_logits(llm.engine, prompts).float() for llm in (ours, reference))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    a, b = ([o.token_ids for o in llm.generate(prompts, params)] for llm in (ours, reference))
    return Agreement(
        identical=sum(x == y for x, y in zip(a, b, strict=True)),
        first=sum(x[0] == y[0] for x, y in zip(a, b, strict=True)),
        total=len(prompts),
        max_abs=(mine - theirs).abs().max().item(),
        max_rel=max_rel_error(mine, theirs),
    )


def motif_prompts(count: int, vocab: int, seed: int = 4, max_noise: int = 30) -> list[list[int]]:
    """Prompts of random noise then a short motif repeated 1-4 times (so n-gram lookups hit), ids in
    [3, vocab)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        motif = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 6))]
        noise = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, max_noise))]
        out.append(noise + motif * (1 + i % 4))
    return out


def assert_follows(samples: list[int], expected: np.ndarray) -> None:
    """χ²: the samples are drawn from `expected` (probabilities over ids), never outside its support."""
    counts = np.bincount(samples, minlength=expected.size)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token outside the filtered support was emitted"
    stat = chisquare(counts[keep], expected[keep] / expected[keep].sum() * len(samples))
    assert stat.pvalue > 1e-3, stat


def loop_llm(target, speculative=None, max_total_tokens: int = 4096, **kwargs):
    """An fp32 CPU engine with the device loop's prerequisites (CUDA-graph buckets run uncaptured,
    the Triton backend's paths; page size 4 unless given): the device-loop tests' engine."""
    from specserve import LLM

    return LLM(
        target,
        device="cpu",
        dtype="float32",
        page_size=kwargs.pop("page_size", 4),
        max_total_tokens=max_total_tokens,
        attention_backend="triton",
        cuda_graphs=True,
        cuda_graph_max_batch=4,
        speculative=speculative,
        **kwargs,
    )


def cycle_tiers(engine: Engine, lengths: Sequence[int]) -> list[int]:
    """Make an adaptive engine's policy hold the chains of `lengths` in turn, one decision each (a
    switch every engine step, the hardest case for the loops' shared state). Returns the lengths
    decided, in order."""
    from specserve.spec.adaptive import Decision, Tier

    policy, decided = engine.adaptive.policy, []

    def decide(ids, remaining=None, verifies=1):
        tier = Tier.chain(lengths[len(decided) % len(lengths)])
        decided.append(tier.num_steps)
        policy.current = tier  # held, not a probe
        return Decision(tier, dict.fromkeys(ids, tier.num_steps), 1.0, True)

    policy.decide = decide
    return decided


def switched_on_device(flights) -> int:
    """Runs of another chain length than the run before them, queued behind it on the device."""
    pairs = zip(flights, flights[1:], strict=False)
    return sum(1 for before, run in pairs if run.resumed and run.loop is not before.loop)


def check_loop_reservations(monkeypatch) -> list:
    """Spy on every device-loop run an engine launches: each live request holds pages for every
    position the run can write KV to, the run before it (in flight, perhaps of another chain length)
    taking every draft. Returns the runs seen."""
    from specserve.engine.device_loop import LoopFlight

    runs: list[LoopFlight] = []
    original = Engine._loop_launch

    def launching(self, flight):
        run = original(self, flight)
        if run is None:
            return None
        runs.append(run)
        ahead = 0 if flight is None else flight.steps * flight.loop.query_len
        q, k = run.loop.query_len, run.loop.num_steps
        for _, req in run.live():
            limit = run.limits[run.reqs.index(req)]
            last_start = min(limit - 1, len(req.token_ids) + ahead + (run.steps - 1) * q)  # active below it
            furthest = last_start - 1 + k  # the last verify's last position
            assert len(req.pages) * self.kv.page_size > furthest, (req.request_id, furthest, len(req.pages))
        return run

    monkeypatch.setattr(Engine, "_loop_launch", launching)
    return runs


def gpu_switches_equal_plain(gguf, prompts, params, spec: dict, order: Sequence[int], monkeypatch, **common):
    """On a GPU: an adaptive engine's captured loops switched at every step through the chain
    lengths of `order` (`cycle_tiers`) emit plain greedy decoding's tokens, each run with its pages
    held (`check_loop_reservations`), and switches happened on the device. Returns its outputs."""
    from specserve import LLM

    plain = LLM(str(gguf), decode_steps=0, **common)  # every step from the host
    want = plain.generate(prompts, params)
    del plain
    looped = LLM(str(gguf), speculative=spec, **common)
    assert all(loop.loop_graphs for loop in looped.engine.device_loops.values()), "captured"
    cycle_tiers(looped.engine, order)
    flights = check_loop_reservations(monkeypatch)
    got = looped.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert switched_on_device(flights) >= 4, [(f.loop.num_steps, f.resumed) for f in flights]
    return got
