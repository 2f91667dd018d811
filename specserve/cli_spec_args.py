"""The speculative-decoding flags `generate` and `bench` share, and the config they make.

`--speculative/--num-steps/--draft-model` name one configuration; `bench` also takes `--spec` specs
(`METHOD[:NUM_STEPS[:DRAFT_MODEL]]`, repeatable) to compare several in one run.
"""

from __future__ import annotations

import argparse

from specserve.config import SPEC_METHODS, SpeculativeConfig

DEFAULT_NUM_STEPS = 4
DEFAULT_MODEL = "smollm2-135m-instruct"  # what every command serves without --model


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative",
        default=None,
        choices=(*SPEC_METHODS, "default"),
        help="speculative method (default: off); `default`: the model's shipped draft head, else n-gram",
    )
    parser.add_argument(
        "--num-steps", type=int, default=DEFAULT_NUM_STEPS, help="draft tokens per step with --speculative"
    )
    parser.add_argument(
        "--draft-model",
        default=None,
        help="standalone: a smaller model (asset, .gguf or HF folder); eagle/eagle3/mtp: the head's HF folder",
    )


def speculative_from_args(args: argparse.Namespace) -> dict | None:
    if not args.speculative:
        return None
    if args.speculative == "default":  # its own num_steps and draft model
        from specserve.default_drafter import default_speculative

        return default_speculative(getattr(args, "model", None) or DEFAULT_MODEL)
    spec = {"method": args.speculative, "num_steps": args.num_steps}
    if args.draft_model:
        spec["draft_model"] = args.draft_model
    return spec


def parse_spec(text: str) -> dict:
    """`METHOD[:NUM_STEPS[:DRAFT_MODEL]]` (e.g. `ngram:4`, `eagle3:5:heads/llama3-eagle3`) as a
    validated speculative config mapping; an argparse type, so a bad spec is a usage error."""
    method, _, rest = text.partition(":")
    steps, _, draft = rest.partition(":")  # the draft path keeps any further colons
    spec: dict = {"method": method, "num_steps": DEFAULT_NUM_STEPS}
    if steps:
        try:
            spec["num_steps"] = int(steps)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: NUM_STEPS must be an integer") from None
    if draft:
        spec["draft_model"] = draft
    try:
        SpeculativeConfig.from_value(spec).validate()
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None
    return spec


def spec_name(spec: dict | None) -> str:
    """A system's name in bench reports: `specserve` (plain) or `specserve-METHOD-NUM_STEPS`."""
    return "specserve" if spec is None else f"specserve-{spec['method']}-{spec['num_steps']}"
