"""The `answers` phase of draft training: a data set's own answers as samples, no generation.

A head is trained on the target's distribution at every answer position (soft labels from the
target's forward in each training batch, `unroll.target_pass`), so the text it reads need not be the
target's own: ShareGPT's answers, in the target's chat template, teach it the same thing at the cost
of a tokenizer pass instead of the target decoding every answer. The inputs then differ from what
the head sees when serving (the target's own greedy text), which is why the target's answers
(`data` phase) stay the better data per token; these add volume and variety beside them
(EAGLE's heads were trained on fixed ShareGPT answers). The file has the layout the data phase
writes (`responses.npz`), so training takes both in one `--responses` list. With `sharegpt-turns`
every gpt turn is an answer, read after the conversation before it (`specserve/train/turns.py`).
The same answer ids, counted over every ShareGPT assistant turn, rank the tokens a head's draft
vocabulary is cut from (`scripts/rank_draft_vocab.py`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specserve.train.data import Samples, append, empty_samples
from specserve.train.turns import Prompt, assistant_texts, prompt_messages

_CHUNK = 4096  # pairs tokenized together


def answer_samples(
    tokenizer,
    exchanges: Sequence[tuple[Prompt, str]],
    *,
    max_prompt_tokens: int,
    max_answer_tokens: int,
    meta: dict | None = None,
) -> Samples:
    """(question, answer) pairs as samples: the question (a user turn's text, or a conversation's
    messages) through the chat template (assistant turn opened), then the answer's ids cut to
    `max_answer_tokens`, then the end-of-turn token if the answer was not cut (the target's own
    answers end the same way). Questions longer than `max_prompt_tokens` are skipped; `prompt_index`
    is the pair's index in `exchanges`. Tokenized in batches (a fast tokenizer uses every core)."""
    from specserve.model.tokenizer import chat_prompts_ids

    samples = empty_samples(meta)
    for first in range(0, len(exchanges), _CHUNK):
        new: list[tuple[list[int], int, int]] = []
        chunk = exchanges[first : first + _CHUNK]
        prompts = chat_prompts_ids(tokenizer, [prompt_messages(q) for q, _ in chunk])
        answers = answer_ids(tokenizer, [a for _, a in chunk], max_answer_tokens)
        for i, (prompt, ids) in enumerate(zip(prompts, answers, strict=True), start=first):
            if len(prompt) <= max_prompt_tokens:
                new.append((prompt + ids, len(prompt), i))
        samples = append(samples, new)  # as arrays: Python lists of every chunk's ids would take GBs
    return samples


def answer_ids(tokenizer, answers: Sequence[str], max_answer_tokens: int) -> list[list[int]]:
    """Each answer's ids as they follow the chat template's assistant opening: cut to
    `max_answer_tokens`, or closed by the end-of-turn token the target ends its own answers with."""
    end = tokenizer.eos_token_id
    out = []
    for ids in tokenizer(list(answers), add_special_tokens=False)["input_ids"]:
        ids = list(ids[:max_answer_tokens])
        if len(ids) < max_answer_tokens and end is not None:
            ids.append(end)
        out.append(ids)
    return out


def answer_token_counts(
    tokenizer, answers: Sequence[str], *, vocab: int, max_answer_tokens: int
) -> np.ndarray:
    """How often each of `vocab` ids occurs in `answers` (as `answer_ids` makes them), in chunks so
    the ids of every answer are never held at once."""
    counts = np.zeros(vocab, np.int64)
    for first in range(0, len(answers), _CHUNK):
        ids = answer_ids(tokenizer, answers[first : first + _CHUNK], max_answer_tokens)
        counts += np.bincount(np.fromiter((t for a in ids for t in a), np.int64), minlength=vocab)[:vocab]
    return counts


def sharegpt_answers(path: Path) -> list[str]:
    """Every assistant turn's text of a ShareGPT file, each distinct text once (the file repeats
    conversations), in file order: what a draft vocabulary is ranked on."""
    from specserve.bench_data import _json_list_items  # reads the conversations before the file's cut

    conversations = _json_list_items(path.read_text())
    return list(dict.fromkeys(text for c in conversations for text in assistant_texts(c)))


def dataset_exchanges(
    data: str, *, seed: int, max_chars: int, tokenizer=None, max_prompt_tokens: int = 1024
) -> list[tuple[Prompt, str]]:
    """A named data set's (question, answer) pairs with questions of at most `max_chars`, in a
    seeded order (so `--num-prompts` takes a representative part). Only ShareGPT has answers:
    `sharegpt` pairs first turns, `sharegpt-turns` every (context, gpt turn) pair of the fitted
    prompts (which needs `tokenizer`)."""
    from specserve.assets import dataset_path
    from specserve.bench_data import sharegpt_exchanges

    if data == "sharegpt-turns":
        from specserve.train.turns import sharegpt_turn_exchanges

        if tokenizer is None:
            raise ValueError(f"data: {data} needs the target's tokenizer")
        return sharegpt_turn_exchanges(
            dataset_path("sharegpt"),
            tokenizer,
            seed=seed,
            max_chars=max_chars,
            max_prompt_tokens=max_prompt_tokens,
        )
    if data != "sharegpt":
        raise ValueError(
            f"data: the answers phase needs a data set with answers (sharegpt, sharegpt-turns), not {data!r}"
        )
    pairs = [(q, a) for q, a in sharegpt_exchanges(dataset_path("sharegpt")) if 4 <= len(q) <= max_chars]
    random.Random(seed).shuffle(pairs)
    return pairs
