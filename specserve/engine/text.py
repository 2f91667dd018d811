"""A request's output text: incremental detokenisation, stop strings, and what may be streamed yet."""

from __future__ import annotations

from collections.abc import Sequence

from specserve.engine.detokenizer import IncrementalDetokenizer, StopMatcher


class TextState:
    def __init__(
        self, tokenizer, prompt_ids: Sequence[int], stops: Sequence[str], skip_special_tokens: bool
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._stops = StopMatcher(stops) if stops else None
        self._final: str | None = None
        self._sent = 0

    def push(self, token_id: int, *, check_stops: bool) -> str | None:
        """Add one token; returns the stop string it completed, if any (the text then ends before it)."""
        before = len(self._detok.text)
        self._detok.push([token_id])
        if not (check_stops and self._stops):
            return None
        hit = self._stops.find(self._detok.text, before)
        if hit is None:
            return None
        index, stop = hit
        self._final = self._detok.text[:index]
        return stop

    def finish(self) -> None:
        if self._final is None:
            self._final = self._detok.text + self._detok.flush()

    @property
    def text(self) -> str:
        return self._final if self._final is not None else self._detok.text

    def take_delta(self) -> str:
        """Text not streamed yet; while running, a tail that may still turn into a stop string is held back."""
        if self._final is not None:
            visible = self._final
        elif self._stops is not None:
            visible = self._detok.text[: self._stops.safe_len(self._detok.text)]
        else:
            visible = self._detok.text
        delta = visible[self._sent :]
        self._sent = max(self._sent, len(visible))
        return delta
