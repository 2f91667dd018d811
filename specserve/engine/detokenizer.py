"""Incremental detokenisation and stop-string matching for streamed outputs.

``IncrementalDetokenizer`` turns output token ids into text in O(1) tokenizer work per token with
the prefix/read-offset technique: it decodes only a short window of recent ids, once without and
once with the new ids, and emits the difference. Text is held back while the decoded window ends in
U+FFFD (an incomplete multi-byte UTF-8 character, e.g. one emoji split over byte-level tokens) or
while the new ids add no text yet; ``flush`` releases it at the end.

The window starts at the last few prompt ids, so the output is decoded in context (a tokenizer that
strips the leading space of a decode's first token does not strip it from the reply's first word).
For byte-level BPE tokenizers (GPT-2, Llama-3, SmolLM2, Qwen) the concatenated output then equals
``tokenizer.decode(output_ids)`` exactly.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence

_PROMPT_CONTEXT = 5  # prompt ids decoded ahead of the output, for context
_INCOMPLETE = "\ufffd"


Decoder = Callable[[Sequence[int], bool], str]
_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decoder(tokenizer) -> Decoder:
    """`decode(ids, skip_special_tokens)` for a tokenizer, without cleanup of tokenization spaces.

    Two decodes per output token per request add up at large batch, and most of an HF decode's time
    is its Python wrapper: where the tokenizer is backed by a `tokenizers.Tokenizer` that decodes a
    probe identically, that backend is called directly (checked once per tokenizer)."""
    try:
        return _DECODERS[tokenizer]
    except (KeyError, TypeError):
        pass
    decode = _backend_decoder(tokenizer) or _hf_decoder(tokenizer)
    with contextlib.suppress(TypeError):  # not weakly referenceable: decide again next time
        _DECODERS[tokenizer] = decode
    return decode


def _hf_decoder(tokenizer) -> Decoder:
    def decode(ids: Sequence[int], skip_special_tokens: bool) -> str:
        return tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    return decode


def _backend_decoder(tokenizer) -> Decoder | None:
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return None
    vocab = len(tokenizer)
    special = list(getattr(tokenizer, "all_special_ids", []) or [])
    probe = [*range(min(vocab, 512)), *special, *range(max(0, vocab - 64), vocab)]
    reference = _hf_decoder(tokenizer)
    for skip in (True, False):
        for chunk in (probe, probe[5:37], special[:1] + probe[100:110]):
            try:
                if backend.decode(chunk, skip_special_tokens=skip) != reference(chunk, skip):
                    return None
            except Exception:  # a backend that cannot decode what HF can: keep HF's
                return None
    return lambda ids, skip_special_tokens: backend.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._decoder = decoder(tokenizer)
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        if self._decode(self._ids).endswith(_INCOMPLETE):
            # A prompt ending mid-character would glue its bytes to the reply's first character;
            # decode the reply on its own instead, like decode(output_ids) does.
            self._ids = []
        self._prefix_offset = 0  # window start: ids before it are final and need no re-decoding
        self._read_offset = len(self._ids)  # ids before it have been emitted as text
        self._text = ""

    def push(self, token_ids: Sequence[int]) -> str:
        """Add output ids; returns the text they finalised ("" while a character is incomplete)."""
        if not token_ids:
            return ""
        return self._take(token_ids, self._decode([*self._ids[self._prefix_offset :], *token_ids]))

    def push_each(self, token_ids: Sequence[int]) -> str:
        """`push` of each id in turn, in one pair of decodes where they end on a complete character:
        the text is then what one push at a time leaves (each emits all it decodes unless its window
        ends mid-character), for two decodes, not two an id. Where they end mid-character, one at a
        time: a single push would hold back every character of the ids, not just the last."""
        if len(token_ids) < 2:
            return self.push(token_ids)
        full = self._decode([*self._ids[self._prefix_offset :], *token_ids])
        if full.endswith(_INCOMPLETE):
            return "".join(self.push([token_id]) for token_id in token_ids)
        return self._take(token_ids, full)

    def _take(self, token_ids: Sequence[int], full: str) -> str:
        """`token_ids` added, `full` the window's decode with them: the text they finalised."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self._ids.extend(token_ids)
        if len(full) <= len(prefix) or full.endswith(_INCOMPLETE):
            return ""
        return self._emit(full[len(prefix) :])

    def flush(self) -> str:
        """Releases any held-back text (at the end of the output, incomplete characters included)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        return self._emit(full[len(prefix) :])

    @property
    def text(self) -> str:
        """The output text emitted so far (prompt excluded)."""
        return self._text

    def _emit(self, delta: str) -> str:
        # The window now starts where the emitted text ended: everything before is settled.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text += delta
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        return self._decoder(ids, self._skip_special)


class StopMatcher:
    """Finds stop strings in a growing text, scanning only its new tail."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stops if s))  # "" would match everywhere
        self._max_len = max((len(s) for s in self._stops), default=0)

    def find(self, text: str, start: int = 0) -> tuple[int, str] | None:
        """The earliest stop occurrence whose last character is at index ``start`` or later.

        Returns (index where the stop begins, the stop). Callers pass ``start = len(previous text)``
        so each call scans only about ``max stop length`` characters plus the new text. Of stops
        beginning at the same index the longest wins (it is the one that was being typed).
        """
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = text.find(stop, max(0, start - len(stop) + 1))
            if index < 0:
                continue
            if best is None or index < best[0] or (index == best[0] and len(stop) > len(best[1])):
                best = (index, stop)
        return best

    def safe_len(self, text: str) -> int:
        """Length of the prefix of ``text`` that may be streamed now.

        Excludes a trailing part that is a proper prefix of some stop (it may still grow into one).
        A stop already complete in ``text`` is the caller's business (``find``).
        """
        for held in range(min(self._max_len - 1, len(text)), 0, -1):
            tail = text[-held:]
            if any(len(stop) > held and stop.startswith(tail) for stop in self._stops):
                return len(text) - held
        return len(text)
