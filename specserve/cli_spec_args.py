"""The speculative-decoding flags `generate` and `bench` share, and the config they make."""

from __future__ import annotations

import argparse

from specserve.config import SPEC_METHODS


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative", default=None, choices=SPEC_METHODS, help="speculative method (default: off)"
    )
    parser.add_argument("--num-steps", type=int, default=4, help="draft tokens per step with --speculative")
    parser.add_argument(
        "--draft-model",
        default=None,
        help="standalone: a smaller model (asset, .gguf or HF folder); eagle/eagle3/mtp: the head's HF folder",
    )


def speculative_from_args(args: argparse.Namespace) -> dict | None:
    if not args.speculative:
        return None
    spec = {"method": args.speculative, "num_steps": args.num_steps}
    if args.draft_model:
        spec["draft_model"] = args.draft_model
    return spec
