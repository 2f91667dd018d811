"""Text and chat prompts to token ids, off the engine thread.

The engine thread steps the model for every running request; anything else it does holds them all
up. Tokenising a prompt there did: a 15 MiB text prompt (under the body cap) took 12 s before its
400, and a 4-token request sent a second later waited 11.7 s (an HTTP probe of the CPU server). So
`AsyncEngine.generate` turns text and chat prompts into token ids here first, on a thread of its own
(the fast tokenizer lets go of the GIL while it encodes), and hands the engine ids.

The thread has its own copy of the tokenizer: a fast tokenizer is one Rust object behind borrow
checks, and the transformers wrapper reconfigures it on calls, so two threads sharing one (the
engine thread decodes as it streams) fail now and then with "Already borrowed". One thread, so its
copy is never shared.

A prompt of more characters than the context could hold as tokens (each token decodes to at most
the longest entry of the vocabulary, twice that for margin: normalisers may shorten text) is
refused before it is tokenised at all.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from transformers import PreTrainedTokenizerBase

from specserve.api.client import ChatPrompt, Prompt
from specserve.model.tokenizer import chat_prompt_ids

MARGIN = 2  # times the characters the context could hold, before a prompt is refused untokenised


class PromptEncoder:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> None:
        self._tokenizer = copy.deepcopy(tokenizer)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-tokenize")
        self.max_model_len = max_model_len
        self.max_chars = MARGIN * max_model_len * longest_token_chars(tokenizer)

    async def ids(self, prompt: Prompt) -> Prompt:
        """`prompt` as token ids (ids as given); ValueError("prompt: ...") for one that cannot fit,
        ValueError("messages...: ...") for messages the chat template rejects."""
        if not isinstance(prompt, (str, ChatPrompt)):
            return prompt
        chars = len(prompt) if isinstance(prompt, str) else _message_chars(prompt)
        if chars > self.max_chars:
            raise ValueError(
                f"prompt: {chars} characters are more tokens than the context length {self.max_model_len}"
            )
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._encode, prompt)

    def _encode(self, prompt: str | ChatPrompt) -> list[int]:
        if isinstance(prompt, ChatPrompt):
            return chat_prompt_ids(self._tokenizer, prompt.messages)
        return self._tokenizer.encode(prompt, add_special_tokens=True)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters one vocabulary entry spells (byte-level entries: one character a byte)."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(p) for p in pieces if isinstance(p, str)), default=1)


def _message_chars(prompt: ChatPrompt) -> int:
    return sum(_content_chars(m.get("content")) for m in prompt.messages)


def _content_chars(content: Any) -> int:
    return len(content) if isinstance(content, str) else 0
