"""A draft vocabulary cut from the target's lm_head at load (`speculative.draft_vocab`): the ranking
shipped beside the default head, the cut head's weights and greedy drafts (the full head's argmax
whenever that is inside the cut), the tokens of every drafting path (plain greedy decoding's: drafts
are only proposals), and the setting's errors."""

from __future__ import annotations

import argparse
import json
import random
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from specserve import LLM, SamplingParams
from specserve.cli_spec_args import DEFAULT_MODEL, add_speculative_arguments, speculative_from_args
from specserve.config import EngineConfig, SpeculativeConfig
from specserve.default_drafter import HEADS_DIR, shipped_head
from specserve.engine.head_loop import HeadDeviceLoop
from specserve.model.head_checkpoint import load_head, random_head, read_ranking, save_head, save_ranking
from specserve.model.hf_loader import DRAFT_VOCAB_FILE
from specserve.serve.config import ServeConfig

from engine_utils import loop_llm

CPU = torch.device("cpu")
VOCAB = 96
RANKED = 80  # ids the tiny head's ranking holds (a real ranking leaves out ids never seen)
CUT = 40


def _ranked_head(target, folder: Path, **kwargs) -> Path:
    """A seeded random EAGLE-3 head for the tiny target with a random ranking of `RANKED` ids."""
    config, tensors = random_head("eagle3", target.arch, seed=3, **kwargs)
    save_head(folder, config, tensors)
    ranking = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:RANKED]
    save_ranking(folder / DRAFT_VOCAB_FILE, ranking, {"data": "a random permutation"})
    return folder


@pytest.fixture(scope="module")
def folder(small_vocab_target, tmp_path_factory) -> Path:
    return _ranked_head(small_vocab_target, tmp_path_factory.mktemp("draft_vocab") / "head")


def _cut_ids(folder: Path, size: int) -> torch.Tensor:
    return read_ranking(folder)[0][:size].sort().values


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 30))] for _ in range(count)]


def test_the_shipped_ranking_is_small_package_data_over_valid_ids(smollm2_gguf):
    from specserve.model.tokenizer import load_tokenizer

    head = shipped_head(DEFAULT_MODEL)
    file = head / DRAFT_VOCAB_FILE
    assert file.stat().st_size < 300_000
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["specserve"]
    assert any(fnmatch(str(file.relative_to(HEADS_DIR.parent)), glob) for glob in globs)
    ranking, meta = read_ranking(head)
    vocab = json.loads((head / "config.json").read_text())["vocab_size"]
    assert ranking.unique().numel() == len(ranking) and 32768 < len(ranking) <= vocab
    assert int(ranking.min()) >= 0 and int(ranking.max()) < vocab
    assert load_tokenizer(smollm2_gguf).eos_token_id in ranking[:4096].tolist()  # answers end with it
    coverage = [json.loads(meta["coverage"])[str(n)] for n in (4096, 8192, 16384, 32768)]
    assert coverage == sorted(coverage) and coverage[0] > 0.5 and coverage[-1] <= 1
    assert meta["data"].startswith("sharegpt") and int(meta["answer_tokens"]) > 10**6


def test_a_cut_head_holds_the_target_rows_and_drafts_the_full_argmax(small_vocab_target, folder):
    target = small_vocab_target
    full = load_head(folder, "eagle3", target.model, CPU, torch.float32)
    cut = load_head(folder, "eagle3", target.model, CPU, torch.float32, draft_vocab=CUT)
    ids = _cut_ids(folder, CUT)
    assert full.spec.draft_vocab_size is None and full.lm_head is None
    assert cut.spec.draft_vocab_size == CUT and cut.spec.own_lm_head
    assert torch.equal(cut.draft_to_target, ids)
    assert torch.equal(cut.lm_head.weight, target.model.lm_head.weight[ids])
    for a, b in zip(full.step_modules.parameters(), cut.step_modules.parameters(), strict=True):
        assert torch.equal(a, b)
    hidden = torch.randn(4096, target.arch.hidden_size, generator=torch.Generator().manual_seed(1))
    full_top = full.logits(0, hidden).argmax(-1)
    cut_top = cut.to_target_ids(cut.logits(0, hidden).argmax(-1))
    inside = torch.isin(full_top, ids)
    assert 0 < int(inside.sum()) < len(hidden)  # both cases occur
    assert torch.equal(cut_top[inside], full_top[inside])
    assert bool(torch.isin(cut_top, ids).all())


GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_tokens(small_vocab_target) -> list[list[int]]:
    outs = LLM(small_vocab_target, device="cpu", dtype="float32").generate(_prompts(4), GREEDY)
    return [o.token_ids for o in outs]


def _record_drafts(llm: LLM, drafts: list[int]) -> None:
    """Collect every synchronous chain draft (target ids) into `drafts`."""
    drafter = llm.engine.drafter
    original = drafter.draft

    def recording(reqs, budgets):
        original(reqs, budgets)
        drafts.extend(d for r in reqs for d in r.draft or ())

    drafter.draft = recording


def _record_loop_drafts(llm: LLM, drafts: list[int]) -> None:
    """Collect the drafts of every active row the device loop's verify input takes into `drafts`."""
    loop = llm.engine.device_loop
    assert isinstance(loop, HeadDeviceLoop)
    original = loop.prepare

    def recording(hist, lengths, limits, *args, given, **kw):
        drafts.extend(d for b in range(hist.shape[0]) if lengths[b] < limits[b] for d in given[b].tolist())
        return original(hist, lengths, limits, *args, given=given, **kw)

    loop.prepare = recording


@pytest.mark.parametrize("path", ["synchronous", "device-loop", "tree"])
def test_every_drafting_path_over_a_cut_vocabulary_decodes_plain_greedy_tokens(
    small_vocab_target, folder, plain_tokens, path
):
    target = small_vocab_target
    spec = {"method": "eagle3", "draft_model": str(folder), "num_steps": 3, "draft_vocab": CUT}
    drafts: list[int] = []
    if path == "synchronous":
        llm = LLM(target, device="cpu", dtype="float32", speculative=spec)
        _record_drafts(llm, drafts)
    elif path == "device-loop":  # the draft graphs' static buffers and the head loop, uncaptured
        llm = loop_llm(target, {**spec, "device_steps": 4}, max_total_tokens=2048)
        _record_loop_drafts(llm, drafts)
    else:
        tree = {**spec, "topk": 4, "num_draft_tokens": 8}
        llm = LLM(target, device="cpu", dtype="float32", speculative=tree)
    assert llm.engine.drafter.head.spec.draft_vocab_size == CUT
    outs = llm.generate(_prompts(4), GREEDY)
    assert [o.token_ids for o in outs] == plain_tokens
    assert sum(o.meta["spec_verify_ct"] for o in outs) > 0
    assert set(drafts) <= set(_cut_ids(folder, CUT).tolist()) and (drafts or path == "tree")
    if path == "synchronous":  # sampled drafts' probabilities go back onto the target vocabulary
        sampled = llm.generate(_prompts(3, seed=1), SamplingParams(max_new_tokens=16, temperature=1.0))
        assert all(len(o.token_ids) == 16 or o.finish_reason == "stop" for o in sampled)


def test_the_shipped_head_with_a_cut_vocabulary_decodes_plain_greedy_tokens(mtbench_questions):
    """The default model and its shipped head (fp32 on the CPU) over the 4096 ids ranked first."""
    params = SamplingParams(max_new_tokens=32, temperature=0.0)
    plain = LLM(DEFAULT_MODEL, device="cpu", dtype="float32")
    spec = {"method": "default", "draft_vocab": 4096}
    drafted = LLM(plain.engine.loaded, device="cpu", dtype="float32", speculative=spec)
    assert drafted.engine.config.speculative.draft_model == str(shipped_head(DEFAULT_MODEL))
    assert drafted.engine.drafter.head.lm_head.weight.shape[0] == 4096
    chats = [[{"role": "user", "content": q}] for q in mtbench_questions[:2]]
    outs = drafted.chat(chats, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.chat(chats, params)]
    verifies = sum(o.meta["spec_verify_ct"] for o in outs)
    assert sum(len(o.token_ids) for o in outs) / verifies > 1.3


def test_bad_draft_vocab_settings_name_the_setting(small_vocab_target, folder, tmp_path):
    target = small_vocab_target
    no_ranking = save_head(tmp_path / "bare", *random_head("eagle3", target.arch, seed=3))
    reduced = _ranked_head(target, tmp_path / "reduced", draft_vocab_size=64)
    head = {"method": "eagle3", "draft_model": str(folder)}
    cases = [
        ({**head, "draft_vocab": 0}, "integer >= 1"),
        ({**head, "draft_vocab": True}, "integer >= 1"),
        ({**head, "draft_vocab": RANKED + 1}, rf"in \[1, {RANKED}\]"),
        ({"method": "ngram", "draft_vocab": 8}, "only EAGLE-3"),
        ({"method": "eagle", "draft_model": str(folder), "draft_vocab": 8}, "only EAGLE-3"),
        ({"method": "eagle3", "draft_model": str(no_ranking), "draft_vocab": 8}, "no token ranking"),
        ({"method": "eagle3", "draft_model": str(reduced), "draft_vocab": 8}, "lm_head of its own"),
    ]
    for spec, message in cases:
        with pytest.raises(ValueError, match=f"speculative.draft_vocab: .*{message}"):
            EngineConfig(speculative=SpeculativeConfig.from_value(spec))
    with pytest.raises(ValidationError, match="speculative.draft_vocab"):
        ServeConfig(model=str(target.location.path), speculative={**head, "draft_vocab": RANKED + 1})
    with pytest.raises(ValueError, match="speculative.draft_vocab"):
        load_head(folder, "eagle3", target.model, CPU, torch.float32, draft_vocab=RANKED + 1)
    ok = SpeculativeConfig.from_value({**head, "draft_vocab": RANKED})
    EngineConfig(speculative=ok)  # the whole ranking is allowed


def test_the_cli_flag_reaches_the_speculative_settings():
    parser = argparse.ArgumentParser()
    add_speculative_arguments(parser)
    args = parser.parse_args(["--speculative", "default", "--draft-vocab", "8192"])
    spec = speculative_from_args(args)
    assert spec["draft_vocab"] == 8192 and spec["draft_model"] == str(shipped_head(DEFAULT_MODEL))
    assert "draft_vocab" not in speculative_from_args(parser.parse_args(["--speculative", "default"]))
    alone = speculative_from_args(parser.parse_args(["--draft-vocab", "4096"]))  # the default drafter's
    assert alone["method"] == "eagle3" and alone["draft_vocab"] == 4096
