"""`specserve train-draft`: generate data with the target, train a draft head, measure its acceptance.

    specserve train-draft --method eagle3 --target smollm2-135m-instruct --data sharegpt --out DIR

`--data sharegpt-turns` takes every ShareGPT human turn with the conversation before it (fitted to
`--max-prompt-tokens` of the target's chat template; `specserve/train/turns.py`), not only first turns.
Phases (`--phase`, comma-separated, in this order): `prompts` writes the data set's prompts to
DIR/prompts.jsonl.gz (a file a machine without the data set's wheel can carry, then `--data FILE`);
`answers` writes the data set's own answers (ShareGPT's) as samples, no generation (`--responses`,
default DIR/answers.npz); `data` answers the prompts with the target (`--responses`, default
DIR/responses.npz); `train` trains the
head into DIR (an HF folder `--speculative METHOD --draft-model DIR` loads; resumed from
DIR/training/state.pt when present); `eval` measures accept lengths on MT-Bench into DIR/eval.json.
Only argparse is imported until a phase runs (no Ray, pydantic or FastAPI on the way).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

from specserve.cli_spec_args import count

PHASES = ("prompts", "answers", "data", "train", "eval")
METHODS = ("eagle3", "eagle", "mtp")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", default="eagle3", choices=METHODS, help="head to train")
    parser.add_argument(
        "--target", default="smollm2-135m-instruct", help="target model: asset name, .gguf or HF folder"
    )
    parser.add_argument(
        "--data",
        default="sharegpt",
        help="prompts: sharegpt (first turns), sharegpt-turns (every turn, with its context), mt-bench, "
        "or a JSON-lines file (.gz too)",
    )
    parser.add_argument("--out", required=True, help="the head's folder (and the run's state)")
    parser.add_argument("--phase", default="data,train,eval", help=f"comma-separated, of {', '.join(PHASES)}")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--dtype", default="auto", help="the target's dtype (auto: bf16 on GPU, fp32 on CPU)")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the data order, sampling and the head's init (default: 0)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")

    data = parser.add_argument_group("data generation")
    data.add_argument(
        "--responses",
        default=None,
        help="generated data file (default: OUT/responses.npz); training reads a comma-separated list",
    )
    data.add_argument(
        "--shard",
        default="0/1",
        metavar="W/N",
        help="answer every N-th prompt from the W-th (N generation processes can share one GPU)",
    )
    data.add_argument(
        "--num-prompts", type=count(), default=None, help="stop after this many answered prompts"
    )
    data.add_argument(
        "--skip-answered",
        default=None,
        metavar="R1,R2",
        help="prompts phase: leave out the prompts these responses files answered (each file's indices "
        "within the --shard it recorded), so a prompts file of the rest can be carried alone",
    )
    data.add_argument("--data-minutes", type=float, default=None, help="stop generating after this long")
    data.add_argument("--max-new-tokens", type=count(), default=512, help="longest answer (default: 512)")
    data.add_argument("--gen-temperature", type=float, default=0.0, help="0: greedy answers")
    data.add_argument("--gen-batch", type=count(), default=64, help="requests decoded together (default: 64)")
    data.add_argument(
        "--stop-loops",
        type=int,
        default=16,
        metavar="N",
        help="end an answer N tokens into its first loop (a recurring N-gram), where --cut-loops N "
        "cuts it anyway; 0 generates to --max-new-tokens",
    )
    data.add_argument(
        "--max-prompt-chars", type=int, default=2000, help="longest user turn (sharegpt-turns: longest turn)"
    )
    data.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=1024,
        help="longest prompt, chat template included (sharegpt-turns: its context is fitted to it)",
    )

    train = parser.add_argument_group("training")
    train.add_argument("--max-steps", type=int, default=None, help="optimizer steps (total, across resumes)")
    train.add_argument(
        "--max-minutes", type=float, default=None, help="training time (total, across resumes)"
    )
    train.add_argument(
        "--session-minutes",
        type=float,
        default=None,
        help="end this run after this long (snapshot saved; the schedule stays --max-minutes'/--max-steps')",
    )
    train.add_argument(
        "--cut-loops",
        type=int,
        default=16,
        metavar="N",
        help="cut each answer N tokens into its first loop (a recurring N-gram); 0 keeps them whole",
    )
    train.add_argument("--unroll", type=int, default=6, help="chain steps unrolled per batch")
    train.add_argument("--loss-decay", type=float, default=0.8, help="step s's loss weighs DECAY**s")
    train.add_argument(
        "--start-weight",
        type=float,
        default=1.0,
        help="label positions within an answer's first --start-tokens tokens weigh this much (the rest 1): "
        "where a one-layer head agrees least with the target, and where MT-Bench measures it",
    )
    train.add_argument("--start-tokens", type=int, default=128, help="see --start-weight")
    train.add_argument(
        "--hard-label",
        type=float,
        default=0.0,
        help="share of the target's argmax mixed into the soft labels, 0..1 (1: cross-entropy against "
        "it): greedy acceptance counts only the argmax (default: 0, pure distillation)",
    )
    train.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (AdamW; default: 3e-4)")
    train.add_argument("--warmup-steps", type=count(0), default=50, help="linear warm-up steps (default: 50)")
    train.add_argument(
        "--min-lr-ratio", type=float, default=0.1, help="the cosine schedule ends at LR x this"
    )
    train.add_argument(
        "--init-from",
        default=None,
        metavar="DIR",
        help="start from this trained head's weights (same shape; a new schedule, not a resume)",
    )
    train.add_argument("--tokens-per-batch", type=int, default=32768, help="padded tokens per batch")
    train.add_argument("--max-len", type=int, default=2048, help="tokens kept of each sample")
    train.add_argument("--num-modules", type=int, default=2, help="mtp: layers in the chain")
    train.add_argument(
        "--layers",
        type=int,
        default=1,
        help="eagle, eagle3: decoder layers of the head (with --init-from a shallower eagle3 head, the "
        "new layers start as identities: the run starts from its drafts exactly)",
    )
    train.add_argument("--intermediate-size", type=int, default=None, help="the head's MLP width")
    train.add_argument(
        "--aux-layers",
        type=_layer_ids,
        default=None,
        metavar="I,J,K",
        help="eagle3: the target layers whose residual streams the head fuses (default: EAGLE-3's low, "
        "middle and high layers); with --init-from, the trained head's first, then more",
    )
    train.add_argument(
        "--draft-vocab", type=int, default=None, help="eagle3: a reduced vocabulary of this many ids"
    )
    train.add_argument("--checkpoint-every", type=int, default=200, help="snapshot every N steps")
    train.add_argument(
        "--save-dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32", "int8"),
        help="the exported head's tensors; int8: its matrices as int8 rows with a scale each (half "
        "the bytes of bf16, dequantised at load), the rest bf16",
    )
    train.add_argument("--no-resume", action="store_true", help="start afresh even if OUT holds a snapshot")
    train.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the head's step modules (fewer host ops per step; compiles in the first batches)",
    )

    ev = parser.add_argument_group("evaluation")
    ev.add_argument("--eval-data", default="mt-bench", help="prompts to measure acceptance on")
    ev.add_argument(
        "--eval-prompts", type=count(), default=80, help="prompts measured (default: 80, all of MT-Bench)"
    )
    ev.add_argument(
        "--eval-max-new-tokens", type=count(), default=256, help="tokens each answer may have (default: 256)"
    )
    ev.add_argument("--eval-steps", type=count(), default=5, help="chain length (num_steps; default: 5)")
    ev.add_argument("--eval-temperatures", default="0,0.7", help="comma-separated")
    ev.add_argument(
        "--eval-tree",
        action="append",
        default=[],
        metavar="TOPK:DRAFT_TOKENS",
        help="also a tree of this shape (repeatable; skipped with a note where the engine has no trees)",
    )
    ev.add_argument("--eval-ngram", action="store_true", help="also the n-gram drafter, for reference")


def run(args: argparse.Namespace) -> int:
    phases = [p.strip() for p in args.phase.split(",") if p.strip()]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        print(f"specserve train-draft: error: unknown phase {unknown} (of {list(PHASES)})", file=sys.stderr)
        return 2
    try:
        return _run(args, phases)
    except ValueError as err:
        print(f"specserve train-draft: error: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, phases: list[str]) -> int:
    from specserve.bench_data import write_prompts
    from specserve.train.data import TURN_DATASETS

    out = Path(args.out)
    if "prompts" in phases:
        tokenizer = _tokenizer(args) if args.data in TURN_DATASETS or args.skip_answered else None
        texts = _prompts(args, args.data, tokenizer)
        if args.skip_answered:
            texts = _unanswered(texts, args.skip_answered, tokenizer)
        texts = texts[: args.num_prompts] if args.num_prompts else texts
        print(f"prompts: {len(texts)} in {write_prompts(texts, out / 'prompts.jsonl.gz')}")
    rest = [p for p in phases if p != "prompts"]
    if not rest:
        return 0
    loaded = _load(args)
    phase_runs = (
        ("answers", _answers_phase),
        ("data", _data_phase),
        ("train", _train_phase),
        ("eval", _eval_phase),
    )
    for phase, run_phase in phase_runs:
        if phase in rest:
            run_phase(args, loaded, out)
            _free_memory()  # the phase's engines and batches are gone: give their memory back
    return 0


def _load(args: argparse.Namespace):
    from specserve.config import EngineConfig
    from specserve.model.loader import load_model

    where = EngineConfig(model=args.target, device=args.device, dtype=args.dtype)
    return load_model(args.target, where.torch_device(), where.torch_dtype())


def _tokenizer(args: argparse.Namespace):
    """The target's tokenizer alone (the prompts phase loads no weights; `sharegpt-turns` fits its
    prompts to the chat template)."""
    from specserve.assets import resolve_model
    from specserve.model.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(args.target).path)


def _prompts(args: argparse.Namespace, data: str, tokenizer) -> list:
    from specserve.train.data import prompt_texts

    return prompt_texts(
        data,
        seed=args.seed,
        max_chars=args.max_prompt_chars,
        tokenizer=tokenizer,
        max_prompt_tokens=args.max_prompt_tokens,
    )


def _responses_paths(args: argparse.Namespace, out: Path) -> list[Path]:
    if not args.responses:
        return [out / "responses.npz"]
    return [Path(p) for p in args.responses.split(",") if p.strip()]


def _layer_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer ids") from None


def _chat_prompts(loaded, prompts: list) -> list[list[int]]:
    return _chat_ids(loaded.tokenizer, prompts)


def _chat_ids(tokenizer, prompts: list) -> list[list[int]]:
    from specserve.model.tokenizer import chat_prompts_ids
    from specserve.train.turns import prompt_messages

    return chat_prompts_ids(tokenizer, [prompt_messages(p) for p in prompts])


def _unanswered(prompts: list, responses: str, tokenizer) -> list:
    from specserve.train.data import unanswered_prompts

    paths = [p for p in responses.split(",") if p.strip()]
    rest = unanswered_prompts(prompts, paths, lambda shard: _chat_ids(tokenizer, shard))
    print(f"prompts: {len(prompts) - len(rest)} of {len(prompts)} answered in {len(paths)} files")
    return rest


def _answers_phase(args: argparse.Namespace, loaded, out: Path) -> None:
    from specserve.train.answers import answer_samples, dataset_exchanges
    from specserve.train.data import save_samples

    exchanges = dataset_exchanges(
        args.data,
        seed=args.seed,
        max_chars=args.max_prompt_chars,
        tokenizer=loaded.tokenizer,
        max_prompt_tokens=args.max_prompt_tokens,
    )
    exchanges = exchanges[: args.num_prompts] if args.num_prompts else exchanges
    meta = {"target": args.target, "data": args.data, "answers": "dataset"}
    samples = answer_samples(
        loaded.tokenizer,
        exchanges,
        max_prompt_tokens=args.max_prompt_tokens,
        max_answer_tokens=args.max_new_tokens,
        meta=meta,
    )
    path = save_samples(samples, args.responses or out / "answers.npz")
    answer_tokens = int(samples.lengths.sum() - samples.prompt_lens.sum())
    print(f"answers: {len(samples)} samples, {answer_tokens} answer tokens in {path}")


def _data_phase(args: argparse.Namespace, loaded, out: Path) -> None:
    from specserve import LLM
    from specserve.train.data import GenerationSettings, generate_responses

    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        temperature=args.gen_temperature,
        max_prompt_tokens=args.max_prompt_tokens,
        batch=args.gen_batch,
        stop_loops=args.stop_loops,
    )
    from specserve.train.data import parse_shard

    worker, workers = parse_shard(args.shard)
    paths = _responses_paths(args, out)
    if len(paths) != 1:
        raise ValueError("--responses: the data phase writes one file")
    texts = _prompts(args, args.data, loaded.tokenizer)[worker::workers]
    prompts = _chat_prompts(loaded, texts)
    deadline = time.monotonic() + args.data_minutes * 60 if args.data_minutes else None
    llm = LLM(
        loaded,
        device=args.device,
        dtype=args.dtype,
        max_running_requests=args.gen_batch,
        cuda_graph_max_batch=args.gen_batch,
        max_batched_tokens=8192,
        max_total_tokens=args.gen_batch * (args.max_prompt_tokens + args.max_new_tokens + 8),
        seed=args.seed,
    )
    meta = {"target": args.target, "data": args.data, "shard": args.shard, **dataclasses.asdict(settings)}
    generate_responses(
        llm,
        prompts,
        paths[0],
        settings,
        max_samples=args.num_prompts,
        deadline=deadline,
        meta=meta,
    )


def _train_phase(args: argparse.Namespace, loaded, out: Path) -> None:
    from specserve.train.data import cut_loops, load_all
    from specserve.train.trainer import TrainConfig, train_head

    max_steps, max_minutes = args.max_steps, args.max_minutes
    if max_steps is None and max_minutes is None:
        max_minutes = 30.0
    cfg = TrainConfig(
        method=args.method,
        num_modules=args.num_modules if args.method == "mtp" else 1,
        layers_per_module=args.layers if args.method in ("eagle", "eagle3") else 1,
        intermediate_size=args.intermediate_size,
        aux_layers=args.aux_layers if args.method == "eagle3" else None,
        draft_vocab=args.draft_vocab if args.method == "eagle3" else None,
        steps=args.unroll,
        decay=args.loss_decay,
        start_weight=args.start_weight,
        start_tokens=args.start_tokens,
        hard_label=args.hard_label,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        min_lr_ratio=args.min_lr_ratio,
        init_from=args.init_from,
        tokens_per_batch=args.tokens_per_batch,
        max_len=args.max_len,
        max_steps=max_steps,
        max_minutes=max_minutes,
        checkpoint_every=args.checkpoint_every,
        save_dtype=args.save_dtype,
        seed=args.seed,
        compile=args.compile,
    )
    samples = load_all(_responses_paths(args, out))
    cut = cut_loops(samples, args.cut_loops)
    print(
        f"train: {int(cut.lengths.sum() - cut.prompt_lens.sum())} answer tokens of "
        f"{int(samples.lengths.sum() - samples.prompt_lens.sum())} kept (--cut-loops {args.cut_loops})"
    )
    samples = cut
    session = args.session_minutes * 60 if args.session_minutes else None
    train_head(
        loaded,
        samples,
        cfg,
        out,
        resume=not args.no_resume,
        progress_bar=not args.no_progress,
        stop_seconds=session,
    )


def _eval_phase(args: argparse.Namespace, loaded, out: Path) -> None:
    from specserve.train.data import prompt_texts

    texts = prompt_texts(
        args.eval_data, seed=args.seed, tokenizer=loaded.tokenizer, max_prompt_tokens=args.max_prompt_tokens
    )[: args.eval_prompts]
    prompts = [p for p in _chat_prompts(loaded, texts) if len(p) <= args.max_prompt_tokens]
    head = {"method": args.method, "num_steps": args.eval_steps, "draft_model": str(out)}
    configs = [head] + [_tree(head, shape) for shape in args.eval_tree]
    if args.eval_ngram:
        configs.append({"method": "ngram", "num_steps": args.eval_steps})
    temperatures = [float(t) for t in args.eval_temperatures.split(",") if t.strip()]
    reports: list[dict] = []
    for spec in configs:
        reports += _measure(args, loaded, spec, prompts, temperatures)
        _free_memory()
    path = out / "eval.json"
    path.write_text(json.dumps({"target": args.target, "data": args.eval_data, "reports": reports}, indent=2))
    print(f"eval: {path}")


def _tree(head: dict, shape: str) -> dict:
    topk, _, tokens = shape.partition(":")
    try:
        return {**head, "topk": int(topk), "num_draft_tokens": int(tokens)}
    except ValueError:
        raise ValueError(f"--eval-tree: {shape!r} is not TOPK:DRAFT_TOKENS") from None


def _measure(args, loaded, spec: dict, prompts: list[list[int]], temperatures: list[float]) -> list[dict]:
    from specserve import LLM
    from specserve.train.evaluate import measure_acceptance

    longest = max(len(p) for p in prompts)
    try:
        llm = LLM(
            loaded,
            device=args.device,
            dtype=args.dtype,
            speculative=spec,
            max_running_requests=len(prompts),
            max_total_tokens=len(prompts) * (longest + args.eval_max_new_tokens + 2 * args.eval_steps + 8),
            seed=args.seed,
        )
    except ValueError as err:  # e.g. trees where the engine has none yet
        print(f"eval: {spec} skipped: {err}")
        return [{"speculative": spec, "skipped": str(err)}]
    reports = []
    for temperature in temperatures:
        report = measure_acceptance(llm, prompts, temperature, args.eval_max_new_tokens, seed=args.seed)
        print(
            f"eval: {spec['method']} steps {spec['num_steps']} topk {spec.get('topk', 1)} T={temperature}: "
            f"accept length {report.accept_length:.2f}, per position "
            + " ".join(f"{a:.2f}" for a in report.per_position)
        )
        reports.append(report.as_dict())
    return reports


def _free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
