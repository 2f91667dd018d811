"""`specserve serve | generate | bench | pull | train-draft`: the command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from specserve.cli_spec_args import add_speculative_arguments, speculative_from_args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="LLM serving with speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    from specserve.serve.launch import add_arguments as add_serve_arguments

    add_serve_arguments(sub.add_parser("serve", help="serve over HTTP on Ray (OpenAI + native /generate)"))

    gen = sub.add_parser("generate", help="generate text for one prompt, in this process")
    gen.add_argument("--model", default="smollm2-135m-instruct", help="asset name, .gguf file or HF folder")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate (default: 128)")
    gen.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)"
    )
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1] (default: 1)")
    gen.add_argument(
        "--top-k", type=int, default=-1, help="sample among the k likeliest tokens (default: -1, off)"
    )
    gen.add_argument(
        "--seed", type=int, default=None, help="sampler seed: same seed, same output (default: none)"
    )
    add_speculative_arguments(gen)
    gen.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    gen.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    gen.add_argument("--json", action="store_true", help="print the full result (text, ids, meta) as JSON")

    bench = sub.add_parser(
        "bench",
        help="benchmarks: offline throughput beside HF generate (the default), or a server under load",
        description="`specserve bench [offline] ...` or `specserve bench online ...`; "
        "`specserve bench MODE --help` for a mode's flags.",
    )
    modes = bench.add_subparsers(dest="bench_mode", required=True)
    from specserve.bench import add_arguments as add_offline_arguments
    from specserve.bench_online import add_arguments as add_online_arguments

    add_offline_arguments(
        modes.add_parser(
            "offline",
            help="tok/s of plain and speculative engines (and --peer hf) per batch size: JSON, table, PNG",
        )
    )
    add_online_arguments(
        modes.add_parser(
            "online",
            help="TTFT / inter-token / end-to-end latency of a running server under bounded load: JSON, table",
        )
    )

    pull = sub.add_parser("pull", help="download named assets (models, data sets) into the cache")
    pull.add_argument("names", nargs="*", help="asset names, e.g. smollm2-135m-instruct mt-bench sharegpt")

    from specserve.train.cli import add_arguments as add_train_arguments

    add_train_arguments(
        sub.add_parser(
            "train-draft",
            help="train a draft head (EAGLE-3, EAGLE, MTP chain) on the target's own answers",
            description="Phases: prompts (export), data (the target answers), train, eval (accept length).",
        )
    )
    return parser


def _generate(args: argparse.Namespace) -> int:
    from specserve import LLM, SamplingParams

    try:
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        spec = speculative_from_args(args)
        llm = LLM(args.model, device=args.device, dtype=args.dtype, speculative=spec)
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        else:
            out = llm.generate(args.prompt, params)[0]
    except ValueError as err:
        print(f"specserve generate: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                {
                    "text": out.text,
                    "token_ids": out.token_ids,
                    "finish_reason": out.finish_reason,
                    "meta_info": out.meta,
                },
                indent=2,
            )
        )
    else:
        print(out.text)
    return 0


BENCH_MODES = ("offline", "online")


def _with_bench_mode(argv: list[str]) -> list[str]:
    """`specserve bench --flags` means `specserve bench offline --flags` (the command before modes)."""
    if argv[:1] == ["bench"] and not (argv[1:2] and argv[1] in (*BENCH_MODES, "-h", "--help")):
        return ["bench", "offline", *argv[1:]]
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    typed = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(_with_bench_mode(typed))
    args.argv = typed  # the command line as typed: what bench reports record
    if args.command == "serve":
        from specserve.serve.launch import run as run_serve

        return run_serve(args)
    if args.command == "generate":
        return _generate(args)
    if args.command == "bench" and args.bench_mode == "online":
        from specserve.bench_online import run as run_online

        return run_online(args)
    if args.command == "bench":
        from specserve.bench import run as run_offline

        return run_offline(args)
    if args.command == "train-draft":
        from specserve.train.cli import run as run_train

        return run_train(args)
    from specserve.assets import main_pull

    return main_pull(args.names)


if __name__ == "__main__":
    sys.exit(main())
