"""A request's output text: incremental detokenisation, stop strings, and what may be streamed yet."""

from __future__ import annotations

from collections.abc import Sequence

from specserve.engine.detokenizer import IncrementalDetokenizer, StopMatcher


class TextState:
    """Tokens are detokenised when the text is read, or at once when a stop string must be checked:
    a request nobody streams is decoded once, at its end, by the same incremental calls."""

    def __init__(
        self,
        tokenizer,
        prompt_ids: Sequence[int],
        stops: Sequence[str],
        skip_special_tokens: bool,
        offsets: bool = False,
    ) -> None:
        """`offsets`: keep where each token's text starts (`start_of`; logprobs' `text_offset`)."""
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._starts: list[int] | None = [] if offsets else None
        self._stops = StopMatcher(stops) if stops else None
        self._final: str | None = None
        self._sent = 0
        self._unread: list[int] = []  # pushed ids not detokenised yet

    def push(self, token_id: int, *, check_stops: bool) -> str | None:
        """Add one token; returns the stop string it completed, if any (the text then ends before it)."""
        if not (check_stops and self._stops):
            self._unread.append(token_id)
            return None
        self._catch_up()
        before = len(self._detok.text)
        if self._starts is not None:
            self._starts.append(before)
        self._detok.push([token_id])
        hit = self._stops.find(self._detok.text, before)
        if hit is None:
            return None
        index, stop = hit
        self._final = self._detok.text[:index]
        return stop

    def finish(self) -> None:
        if self._final is None:
            self._catch_up()
            self._final = self._detok.text + self._detok.flush()

    @property
    def text(self) -> str:
        if self._final is not None:
            return self._final
        self._catch_up()
        return self._detok.text

    def take_delta(self) -> str:
        """Text not streamed yet; while running, a tail that may still turn into a stop string is held back."""
        if self._final is not None:
            visible = self._final
        else:
            self._catch_up()
            text = self._detok.text
            visible = text[: self._stops.safe_len(text)] if self._stops is not None else text
        delta = visible[self._sent :]
        self._sent = max(self._sent, len(visible))
        return delta

    def catch_up(self) -> None:
        """Detokenise the ids pushed so far (the text is the same whenever this runs: the engine
        runs it while the device works, so little is left when the text is read)."""
        self._catch_up()

    def _catch_up(self) -> None:
        # As if each token had been pushed on its own (`push_each`): the text cannot depend on when
        # it is read. Where each token's start is kept, one at a time.
        if self._starts is None:
            self._detok.push_each(self._unread)
        else:
            for token_id in self._unread:
                self._starts.append(len(self._detok.text))
                self._detok.push([token_id])
        self._unread.clear()

    def start_of(self, index: int) -> int | None:
        """Where output token `index`'s text starts in the text, in characters (None unless kept).
        A token that adds no text of its own (a skipped special token, a character's first bytes)
        starts where the next text does; none starts past the end (a stop string cut there)."""
        if self._starts is None:
            return None
        self._catch_up()
        return min(self._starts[index], len(self.text))
