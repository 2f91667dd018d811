"""`sharegpt-turns`: every human turn of ShareGPT as a training prompt, the conversation before it as
context.

The first-turn set (`sharegpt`, ~15.6k prompts) is small and all of one kind (a conversation's
opening); later turns are follow-ups, corrections and "continue", read with earlier answers in view,
which is much of what a served chat looks like. Each human turn k becomes a chat-template prompt of
the turns before it, human turns as user messages and gpt turns as assistant messages with
ShareGPT's own text, then turn k.

Rules (prompts are dropped or shortened by whole turns, never cut inside one):
- turns are `human`/`user` (user) and `gpt`/`chatgpt`/`bing`/`bard`/`assistant` (assistant), text
  stripped; a turn of another role (`system`), an empty turn, two turns of one role in a row, or a turn
  longer than `max_chars` ends the context: what comes after it starts afresh;
- a prompt's own user turn has 4..`max_chars` characters (as the first-turn set's);
- the context is the most recent earlier turns that fit: the oldest (user, assistant) pair is dropped
  until the whole prompt (template, default system message, generation prompt) has at most
  `max_prompt_tokens` tokens, so a prompt always starts at a user turn; a turn that does not fit alone
  is dropped;
- identical prompts (after fitting) are kept once, the first in file order;
- the order is a seeded shuffle of the file order, as `sharegpt`'s: prompt index i (what the data
  phase's resume keys on) is the same prompt on every run with the same file, seed, `max_chars`,
  `max_prompt_tokens` and tokenizer. Written once to a prompts file (`--phase prompts`), the order is
  frozen for any machine that reads it.
Conversations split into parts in the file (ids `x_0`, `x_11`, ...) are read part by part: a part's
context starts at its first user turn.

The `answers` phase takes the pairs (prompt, the gpt turn right after it), deduplicated on both.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

USER, ASSISTANT = "user", "assistant"
_ROLES = {"human": USER, "user": USER, "gpt": ASSISTANT, "chatgpt": ASSISTANT, "bing": ASSISTANT}
_ROLES |= {"bard": ASSISTANT, "assistant": ASSISTANT}
_MIN_CHARS = 4  # as the first-turn set: "hi" and "?" measure nothing
_CHUNK = 4096  # texts tokenized together

Message = dict[str, str]
Prompt = str | list[Message]  # a user turn alone, or a conversation ending in a user turn


@dataclass(frozen=True)
class TurnPrompt:
    """One human turn with the context fitted before it, and the data set's answer to it."""

    messages: tuple[tuple[str, str], ...]  # (role, text), oldest first, the last a user turn
    answer: str | None  # the gpt turn right after it, if any

    def as_messages(self) -> list[Message]:
        return [{"role": role, "content": text} for role, text in self.messages]


def prompt_messages(prompt: Prompt) -> list[Message]:
    """The chat messages of a prompt: a bare text is one user turn."""
    return [{"role": USER, "content": prompt}] if isinstance(prompt, str) else list(prompt)


# ---- candidates: every usable human turn with all the context before it ---------------------------


def _turns(conversation: dict) -> list[tuple[str, str] | None]:
    """(role, stripped text) per turn; None for a turn that ends the context (unknown role, no text)."""
    out: list[tuple[str, str] | None] = []
    for turn in conversation.get("conversations") or []:
        role, value = _ROLES.get(turn.get("from")), turn.get("value")
        text = value.strip() if isinstance(value, str) else ""
        out.append((role, text) if role is not None and text else None)
    return out


def assistant_texts(conversation: dict) -> list[str]:
    """The text of each assistant turn of `conversation` that has any."""
    return [turn[1] for turn in _turns(conversation) if turn is not None and turn[0] == ASSISTANT]


def candidate_windows(
    conversation: dict, max_chars: int
) -> Iterator[tuple[list[tuple[str, str]], str | None]]:
    """Each human turn of `conversation` that can be a prompt, with every earlier turn its context may
    hold (a run of alternating turns starting at a user turn, each of at most `max_chars`), and the
    answer after it (None if there is none)."""
    turns = _turns(conversation)
    context: list[tuple[str, str]] = []
    for i, turn in enumerate(turns):
        if turn is None or len(turn[1]) > max_chars:
            context = []
            continue
        role, text = turn
        if context and context[-1][0] == role:  # two of one role in a row: the run breaks here
            context = []
        if not context and role != USER:  # a context starts at a user turn
            continue
        if role == USER and len(text) >= _MIN_CHARS:
            after = turns[i + 1] if i + 1 < len(turns) else None
            answer = after[1] if after is not None and after[0] == ASSISTANT else None
            yield [*context, turn], answer
        context.append(turn)


# ---- the fit rule --------------------------------------------------------------------------------


class PromptFitter:
    """Fits windows to `max_prompt_tokens` of the tokenizer's chat template: an additive estimate
    (each text's tokens plus its role's template tokens, measured once) picks the longest suffix,
    then the chosen prompts are rendered for real (in batches) and shortened further while too long,
    so no prompt exceeds the bound whatever the template does at message boundaries. (An estimate
    too high would drop a pair that fits; for ChatML templates such as SmolLM2's it is exact.)"""

    def __init__(self, tokenizer, max_prompt_tokens: int) -> None:
        self._tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        (x,) = self._text_lengths(["x"])
        one, two, three = self._prompt_lengths(
            [[(USER, "x")], [(USER, "x"), (ASSISTANT, "x")], [(USER, "x"), (ASSISTANT, "x"), (USER, "x")]]
        )
        self._overhead = {ASSISTANT: two - one - x, USER: three - two - x}
        self._fixed = one - x - self._overhead[USER]  # default system message, generation prompt

    # Token counts only, a chunk at a time: the whole file's id lists would take gigabytes.
    def _text_lengths(self, texts: Sequence[str]) -> list[int]:
        lengths: list[int] = []
        for first in range(0, len(texts), _CHUNK):
            encoded = self._tokenizer(list(texts[first : first + _CHUNK]), add_special_tokens=False)
            lengths += [len(ids) for ids in encoded["input_ids"]]
        return lengths

    def _prompt_lengths(self, windows: Sequence[Sequence[tuple[str, str]]]) -> list[int]:
        from specserve.model.tokenizer import chat_prompts_ids

        chunks = (windows[first : first + _CHUNK] for first in range(0, len(windows), _CHUNK))
        return [
            len(ids)
            for chunk in chunks
            for ids in chat_prompts_ids(self._tokenizer, [[_msg(r, t) for r, t in w] for w in chunk])
        ]

    def fit(self, windows: Sequence[list[tuple[str, str]]]) -> list[tuple[tuple[str, str], ...] | None]:
        """Each window's longest suffix that starts at a user turn and fits, or None."""
        texts = sorted({text for window in windows for _, text in window})
        counts = dict(zip(texts, self._text_lengths(texts), strict=True))
        starts = [self._estimated_start(window, counts) for window in windows]
        fitted: list[tuple[tuple[str, str], ...] | None] = [None] * len(windows)
        pending = [i for i, window in enumerate(windows) if starts[i] < len(window)]
        while pending:
            lengths = self._prompt_lengths([windows[i][starts[i] :] for i in pending])
            retry = []
            for i, length in zip(pending, lengths, strict=True):
                if length <= self.max_prompt_tokens:
                    fitted[i] = tuple(windows[i][starts[i] :])
                else:  # the estimate was short: one pair fewer, rendered again
                    starts[i] += 2
                    if starts[i] < len(windows[i]):
                        retry.append(i)
            pending = retry
        return fitted

    def _estimated_start(self, window: list[tuple[str, str]], counts: dict[str, int]) -> int:
        """Where the window starts once its oldest pairs are dropped until the estimate fits
        (len(window) when not even its last turn does)."""
        cost = self._fixed + sum(counts[text] + self._overhead[role] for role, text in window)
        start = 0
        while start < len(window) and cost > self.max_prompt_tokens:
            for role, text in window[start : start + 2]:
                cost -= counts[text] + self._overhead[role]
            start += 2
        return start


def _msg(role: str, text: str) -> Message:
    return {"role": role, "content": text}


# ---- the data set --------------------------------------------------------------------------------


def turn_prompts(
    conversations: Sequence[dict], tokenizer, *, max_chars: int, max_prompt_tokens: int
) -> list[TurnPrompt]:
    """Every usable human turn of `conversations` with its fitted context, in file order (not yet
    deduplicated or shuffled)."""
    candidates = [c for conversation in conversations for c in candidate_windows(conversation, max_chars)]
    fitted = PromptFitter(tokenizer, max_prompt_tokens).fit([window for window, _ in candidates])
    return [TurnPrompt(m, answer) for m, (_, answer) in zip(fitted, candidates, strict=True) if m]


def _file_turns(path: Path, tokenizer, *, max_chars: int, max_prompt_tokens: int) -> list[TurnPrompt]:
    from specserve.bench_data import _json_list_items  # reads the conversations before the file's cut

    conversations = _json_list_items(path.read_text())
    return turn_prompts(conversations, tokenizer, max_chars=max_chars, max_prompt_tokens=max_prompt_tokens)


def _unique_shuffled(items: list, key, seed: int) -> list:
    seen: set = set()
    kept = [item for item in items if not (key(item) in seen or seen.add(key(item)))]
    random.Random(seed).shuffle(kept)
    return kept


def sharegpt_turns(
    path: Path, tokenizer, *, seed: int, max_chars: int, max_prompt_tokens: int
) -> list[TurnPrompt]:
    """The `sharegpt-turns` prompts of a ShareGPT file: deduplicated on the prompt, seeded order."""
    prompts = _file_turns(path, tokenizer, max_chars=max_chars, max_prompt_tokens=max_prompt_tokens)
    return _unique_shuffled(prompts, lambda p: p.messages, seed)


def sharegpt_turn_exchanges(
    path: Path, tokenizer, *, seed: int, max_chars: int, max_prompt_tokens: int
) -> list[tuple[list[Message], str]]:
    """(prompt messages, ShareGPT's answer) of every turn that has one: deduplicated on the pair (one
    prompt answered differently in two conversations gives two samples), seeded order."""
    prompts = _file_turns(path, tokenizer, max_chars=max_chars, max_prompt_tokens=max_prompt_tokens)
    pairs = _unique_shuffled([p for p in prompts if p.answer], lambda p: (p.messages, p.answer), seed)
    return [(p.as_messages(), p.answer) for p in pairs]


# ---- prompts files -------------------------------------------------------------------------------


def read_prompts_file(path: Path, *, max_chars: int) -> list[Prompt]:
    """A prompts file's prompts, in file order: a line is a string or an object with `prompt`/`text`
    (a user turn; kept if it has 4..`max_chars` characters, as `bench_data.select_texts` does, so
    the indices of files written before conversations existed stay what they were) or with
    `messages` (a conversation, kept as written: it was fitted when the file was written)."""
    opener = gzip.open if path.suffix == ".gz" else open
    prompts: list[Prompt] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            item = json.loads(line)
            if isinstance(item, dict) and isinstance(item.get("messages"), list):
                prompts.append([_msg(m["role"], m["content"]) for m in item["messages"]])
                continue
            text = item if isinstance(item, str) else item.get("prompt") or item.get("text") or ""
            if _MIN_CHARS <= len(text) <= max_chars:
                prompts.append(text)
    return prompts
