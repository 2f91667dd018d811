"""The speculative-decoding flags `generate` and `bench` share, and the config they make.

`--speculative/--num-steps/--topk/--num-draft-tokens/--draft-model` name one configuration, and
`--adaptive` lets adaptive speculation pick among shapes up to it every step; `bench` also takes
`--spec` specs (`METHOD[:SHAPE[:DRAFT_MODEL]]`, repeatable) to compare several in one run, where SHAPE
is NUM_STEPS (a chain) or NUM_STEPSxTOPK[xNUM_DRAFT_TOKENS] (a tree), and `adaptive` or
`adaptive-SHAPE` the adaptive configuration over the default tiers up to that shape, its settings
after commas (`ngram:adaptive-8,hysteresis=0.1`: two variants of the policy side by side in one
process, their repeats in the same rounds). `--draft-vocab N` cuts an EAGLE-3 head's draft vocabulary
to the N ids its token ranking puts first.
"""

from __future__ import annotations

import argparse
import json

from specserve.config import SPEC_METHODS, SpeculativeConfig

DEFAULT_NUM_STEPS = 4
ADAPTIVE_NUM_STEPS = 8  # the longest chain of `METHOD:adaptive` (shorter ones and none are tiers too)
DEFAULT_MODEL = "smollm2-135m-instruct"  # what every command serves without --model


def count(least: int = 1):
    """An argparse type: an integer of at least `least` (a bad one is a usage error naming the flag)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is below {least}")
        return value

    parse.__name__ = f"integer >= {least}"
    return parse


def counts(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1 (`--batch-sizes 1,16,64`)."""
    return [count()(part.strip()) for part in text.split(",")]


def add_speculative_arguments(parser: argparse.ArgumentParser, default: str = "off") -> None:
    """`default`: what the command does without --speculative, for the help text."""
    parser.add_argument(
        "--speculative",
        default=None,
        choices=(*SPEC_METHODS, "default"),
        help=f"speculative method (default: {default}); `default`: the model's shipped draft head, else n-gram",
    )
    parser.add_argument(
        "--num-steps",
        type=int,
        default=None,
        help=f"draft tokens per step with --speculative (default: {DEFAULT_NUM_STEPS}; `default`: the head's own)",
    )
    parser.add_argument(
        "--topk",
        type=int,
        default=None,
        help="candidates per draft-tree node with --speculative (default: 1, a chain)",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="draft-tree nodes verified per step with --topk > 1 (default: min(topk * num-steps, 64))",
    )
    parser.add_argument(
        "--draft-model",
        default=None,
        help="standalone: a smaller model (asset, .gguf or HF folder); eagle/eagle3/mtp: the head's HF folder",
    )
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="eagle3 heads sharing the target's lm_head: draft over the N ids the head's shipped token "
        "ranking puts first (default: as the head was trained, or the shipped head's own setting); without "
        "--speculative, the default drafter's",
    )
    parser.add_argument(
        "--adaptive",
        action="store_true",
        help="adaptive speculation: each step picks the draft shape up to the one configured (or none) "
        "of most predicted tokens per second; without --speculative, the default drafter's",
    )


def speculative_from_args(args: argparse.Namespace) -> dict | None:
    """The speculative config the flags name; ValueError naming a flag that needs --speculative."""
    adaptive = getattr(args, "adaptive", False)
    vocab = draft_vocab_setting(args)
    shape = shape_setting(args)
    method = args.speculative or ("default" if adaptive or vocab else None)
    if not method:
        named = {**shape, "draft_model": args.draft_model}
        given = next((name for name, value in named.items() if value is not None), None)
        if given:
            raise ValueError(f"--{given.replace('_', '-')}: needs --speculative (or --adaptive)")
        return None
    if method == "default":  # its own draft model, and its own num_steps unless given
        from specserve.default_drafter import default_speculative

        spec = {**default_speculative(getattr(args, "model", None) or DEFAULT_MODEL), **shape, **vocab}
        return {**spec, "adaptive": True} if adaptive else spec
    spec = {"method": method, "num_steps": DEFAULT_NUM_STEPS, **shape, **vocab}
    if args.draft_model:
        spec["draft_model"] = args.draft_model
    if adaptive:
        spec["adaptive"] = True
    return spec


def shape_setting(args: argparse.Namespace) -> dict:
    """`--num-steps`, `--topk`, `--num-draft-tokens` as speculative settings, those given only."""
    names = ("num_steps", "topk", "num_draft_tokens")
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def draft_vocab_setting(args: argparse.Namespace) -> dict:
    """`--draft-vocab` as speculative settings: none when not given (the head's own then holds)."""
    draft_vocab = getattr(args, "draft_vocab", None)
    return {} if draft_vocab is None else {"draft_vocab": draft_vocab}


def parse_spec(text: str) -> dict:
    """`METHOD[:SHAPE[:DRAFT_MODEL]]` (e.g. `ngram:4`, `ngram:6x8x64`, `eagle3:5:heads/llama3-eagle3`)
    as a validated speculative config mapping; SHAPE is NUM_STEPS[xTOPK[xNUM_DRAFT_TOKENS]], or
    `adaptive` / `adaptive-SHAPE` (e.g. `ngram:adaptive-8`): adaptive speculation over the default
    tiers up to that shape (default ADAPTIVE_NUM_STEPS), `,NAME=VALUE` after it: its settings
    (`speculative.adaptive`, e.g. `ngram:adaptive-8,hysteresis=0.1,patience=5`); `@N` after the
    shape: `draft_vocab` N (e.g. `eagle3:3@8192:HEAD`). An argparse type, so a bad spec is a usage
    error."""
    method, _, rest = text.partition(":")
    shape, _, draft = rest.partition(":")  # the draft path keeps any further colons
    shape, *settings = shape.split(",")
    shape, at, vocab = shape.partition("@")
    spec: dict = {"method": method, "num_steps": DEFAULT_NUM_STEPS}
    if at:
        if not vocab.isdigit():
            raise argparse.ArgumentTypeError(f"{text!r}: @N must be the draft vocabulary's size (an integer)")
        spec["draft_vocab"] = int(vocab)
    if shape == "adaptive" or shape.startswith("adaptive-"):
        spec.update(num_steps=ADAPTIVE_NUM_STEPS, adaptive=_adaptive_settings(text, settings))
        shape = shape.removeprefix("adaptive").removeprefix("-")
    elif settings:
        raise argparse.ArgumentTypeError(f"{text!r}: settings after the shape need an adaptive one")
    if shape:
        try:
            numbers = [int(part) for part in shape.split("x")]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: SHAPE must be NUM_STEPS[xTOPK[xNUM_DRAFT_TOKENS]] (integers)"
            ) from None
        if len(numbers) > 3:
            raise argparse.ArgumentTypeError(f"{text!r}: SHAPE has at most three numbers")
        spec.update(zip(("num_steps", "topk", "num_draft_tokens"), numbers, strict=False))
    if draft:
        spec["draft_model"] = draft
    try:
        SpeculativeConfig.from_value(spec).validate()
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None
    return spec


def _adaptive_settings(text: str, settings: list[str]) -> dict | bool:
    """`NAME=VALUE` pairs as adaptive speculation's settings (values read as JSON: numbers, true,
    null; else strings); True (the defaults) when there are none."""
    out: dict = {}
    for item in settings:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise argparse.ArgumentTypeError(f"{text!r}: adaptive settings are NAME=VALUE, got {item!r}")
        try:
            out[name] = json.loads(value)
        except json.JSONDecodeError:
            out[name] = value
    return out or True


def spec_name(spec: dict | None) -> str:
    """A system's name in bench reports: `specserve` (plain), `specserve-METHOD-NUM_STEPS` (a chain)
    or `specserve-METHOD-NUM_STEPSxTOPKxNUM_DRAFT_TOKENS` (a tree); `-adaptive` appended when the
    shape is adaptive speculation's largest, and then its settings given (`-hysteresis0.1`)."""
    if spec is None:
        return "specserve"
    config = SpeculativeConfig.from_value(spec)
    shape = str(config.num_steps)
    if config.topk > 1:
        shape += f"x{config.topk}x{config.draft_tokens}"
    vocab = "" if config.draft_vocab is None else f"-vocab{config.draft_vocab}"
    name = f"specserve-{config.method}-{shape}{vocab}"
    if config.adaptive is None:
        return name
    given = spec.get("adaptive")
    settings = given if isinstance(given, dict) else {}
    return name + "-adaptive" + "".join(f"-{key}{value}" for key, value in sorted(settings.items()))


def draft_slots(spec: dict | None) -> int:
    """KV slots a request may need past its tokens for one draft (a chain's drafts, or a tree's
    verify and drafting slots, `Drafter.tree_slots`)."""
    if spec is None:
        return 0
    config = SpeculativeConfig.from_value(spec)
    if config.topk == 1:
        return config.num_steps
    return max(config.draft_tokens, config.topk * (config.num_steps - 1))
