"""OpenAI-compatible request and response bodies (`/v1/completions`, `/v1/chat/completions`, `/v1/models`).

Requests are strict (no type coercion) and refuse unknown fields, so a misspelt or unsupported
option is a 400 naming it rather than silently ignored. Each request model turns itself into the
engine's `SamplingParams` and knows which of its fields an engine error is about.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from specserve.api.limits import (
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP,
    MAX_STOP_LEN,
    MAX_TOKEN_ID_LIST,
    MAX_TOP_LOGPROBS,
)
from specserve.types import SamplingParams

# Floats must be finite: JSON has no Infinity or NaN, and Python's parser takes both (a temperature
# of Infinity sampled uniformly, with a 200).
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _unicode(value: str) -> str:
    """JSON may escape half a surrogate pair (`"\\ud800"`), which is no Unicode text: the tokenizer
    cannot encode it (a prompt of one failed the replica's admission with a TypeError, a 503 that
    asked for a retry) and a request id holding one could not be sent back (a 500)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it holds an unpaired surrogate)") from None
    return value


Text = Annotated[str, AfterValidator(_unicode)]  # every string a request may hold


def neutral(value: float) -> AfterValidator:
    """A knob the engine does not implement, accepted at its no-op value only: clients send their
    defaults whether or not the user set them (LangChain's `ChatOpenAI` sends `presence_penalty: 0`
    and `frequency_penalty: 0` with every request; SGLang's clients send `repetition_penalty: 1`),
    and refusing the field refused those requests whole. Any other value is a 400 naming it."""

    def check(given: float) -> float:
        if given != value:
            raise ValueError(f"only {value:g} is supported (penalties are not implemented)")
        return given

    return AfterValidator(check)


ZeroPenalty = Annotated[float, neutral(0.0)]


def _one_or_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


StopStrings = Annotated[
    Annotated[list[Annotated[Text, Field(min_length=1, max_length=MAX_STOP_LEN)]], Field(max_length=MAX_STOP)]
    | None,
    BeforeValidator(_one_or_list),
]
TokenIdList = Annotated[list[int], Field(max_length=MAX_TOKEN_ID_LIST)]


# ---- requests ---------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = Field(
        False, description="Send one more chunk before `[DONE]`: empty `choices` and the request's usage."
    )


class OpenAISampling(BaseModel):
    """Fields completions and chat share."""

    model_config = STRICT
    model: Text | None = Field(
        None, description="The served model's name (see /v1/models); omitted: that model."
    )
    n: int = Field(
        1, ge=1, le=MAX_N, description="Choices to generate per prompt (seeds seed, seed+1, ... when seeded)."
    )
    stream: bool = Field(
        False, description="Stream chunks as server-sent events, ending with `data: [DONE]`."
    )
    stream_options: StreamOptions | None = Field(
        None, description="Streaming options; only with `stream: true`."
    )
    stop: StopStrings = Field(
        None, description=f"A stop string or up to {MAX_STOP}; the text ends before it."
    )
    seed: int | None = Field(None, ge=0, lt=2**63, description="Seed of the sampler: same seed, same output.")
    temperature: float = Field(1.0, ge=0, le=2, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus sampling: the smallest set of tokens with this mass."
    )
    top_k: int = Field(-1, description="Sample among the k likeliest tokens; -1 is off (an extension).")
    min_p: float = Field(
        0.0, ge=0, lt=1, description="Drop tokens below min_p x the top probability (an extension)."
    )
    min_tokens: int = Field(
        0, ge=0, description="Tokens to generate before EOS or a stop may end the output (an extension)."
    )
    ignore_eos: bool = Field(False, description="Keep generating past EOS (an extension).")
    stop_token_ids: TokenIdList | None = Field(
        None,
        description="Token ids that end the output (an extension); the matched token stays in it, as in vLLM.",
    )
    skip_special_tokens: bool = Field(
        True, description="Leave special tokens out of the text (an extension)."
    )
    user: Text | None = Field(None, description="An id of the caller's end user; accepted and not used.")
    presence_penalty: ZeroPenalty = Field(
        0.0,
        description="Only 0, OpenAI's default: penalties are not implemented (sent by clients that always send it).",
    )
    frequency_penalty: ZeroPenalty = Field(
        0.0,
        description="Only 0, OpenAI's default: penalties are not implemented (sent by clients that always send it).",
    )

    def _params(self, max_tokens: int | None, top_logprobs: int | None, seed_offset: int) -> SamplingParams:
        seed = None if self.seed is None else (self.seed + seed_offset) % 2**63
        return SamplingParams(
            max_new_tokens=max_tokens,
            min_new_tokens=self.min_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            stop=tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            seed=seed,
            skip_special_tokens=self.skip_special_tokens,
            return_logprob=top_logprobs is not None,
            top_logprobs_num=top_logprobs or 0,
        )

    def check(self) -> None:
        """Checks across fields; ValueError("field: ...") names the field at fault."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


PromptIds = Annotated[list[int], Field(min_length=1)]


class CompletionRequest(OpenAISampling):
    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
        | PromptIds
        | Annotated[list[PromptIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    ) = Field(description="A prompt (text or token ids) or a list of prompts.")
    max_tokens: int | None = Field(
        16, ge=1, description="Most tokens to generate per choice; null: up to the context length."
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Return logprobs of the output tokens and this many top ones.",
    )

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    def sampling_params(self, index: int) -> SamplingParams:
        return self._params(self.max_tokens, self.logprobs, index)

    def engine_fields(self) -> dict[str, str]:
        """API names of the engine's fields, for mapping engine errors."""
        return {
            "max_new_tokens": "max_tokens",
            "min_new_tokens": "min_tokens",
            "top_logprobs_num": "logprobs",
            "prompt": "prompt",
            "input_ids": "prompt",
        }


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: Text = Field(description="The text.")


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"] = Field(description="Who speaks.")
    content: Text | list[TextPart] = Field(description="The message: a string or a list of text parts.")
    name: Text | None = Field(None, description="A speaker's name; accepted and not used.")

    def as_template_message(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(OpenAISampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)] = Field(
        description="The conversation so far; the reply is the next assistant turn."
    )
    max_tokens: int | None = Field(None, ge=1, description="Deprecated name of max_completion_tokens.")
    max_completion_tokens: int | None = Field(
        None, ge=1, description="Most tokens to generate per choice; null: up to the context length."
    )
    logprobs: bool = Field(False, description="Return the logprob of each output token.")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="With logprobs: this many likeliest tokens per position."
    )

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("max_tokens: give max_completion_tokens or max_tokens, not both")

    def sampling_params(self, index: int) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, index)

    def engine_fields(self) -> dict[str, str]:
        return {
            "max_new_tokens": "max_tokens" if self.max_tokens is not None else "max_completion_tokens",
            "min_new_tokens": "min_tokens",
            "top_logprobs_num": "top_logprobs",
            "prompt": "messages",
            "input_ids": "messages",
        }


# ---- responses --------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")


class Usage(BaseModel):
    prompt_tokens: int = Field(description="Prompt tokens (each distinct prompt once).")
    completion_tokens: int = Field(description="Generated tokens over all choices.")
    total_tokens: int = Field(description="prompt_tokens + completion_tokens.")
    prompt_tokens_details: PromptTokensDetails = Field(description="Where the prompt tokens came from.")


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(description="Each output token's text.")
    token_logprobs: list[float | None] = Field(description="Each output token's logprob.")
    top_logprobs: list[dict[str, float]] | None = Field(
        description="Per position, the likeliest tokens' logprobs."
    )
    text_offset: list[int] = Field(description="Where each token's text starts in the choice's text.")


class CompletionChoice(BaseModel):
    index: int = Field(description="The choice's position: prompt index x n + sample index.")
    text: str = Field(description="The generated text (a chunk of it when streaming).")
    logprobs: CompletionLogprobs | None = Field(None, description="Logprobs, when asked for.")
    finish_reason: str | None = Field(None, description="stop, length or abort; null until the choice ends.")


class ResponseHead(BaseModel):
    """What every body (and chunk) of one request repeats."""

    id: str = Field(description="The request's id (the same in every chunk).")
    created: int = Field(description="Unix time of the request.")
    model: str = Field(description="The model's name.")


class CompletionResponse(ResponseHead):
    object: Literal["text_completion"] = Field("text_completion", description="The object type.")
    choices: list[CompletionChoice] = Field(description="The choices (streaming: those with news).")
    usage: Usage | None = Field(None, description="Token counts (streaming: only in the usage chunk).")


class ChatTopLogprob(BaseModel):
    token: str = Field(description="The token's text.")
    logprob: float | None = Field(description="Its logprob.")
    bytes: list[int] = Field(description="The UTF-8 bytes of its text.")


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(description="The likeliest tokens at this position.")


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(description="Per output token.")
    refusal: None = Field(None, description="Always null.")


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = Field("assistant", description="Always assistant.")
    content: str = Field(description="The reply.")


class ChatChoice(BaseModel):
    index: int = Field(description="The choice's position (0 .. n-1).")
    message: ChatMessageOut = Field(description="The reply.")
    logprobs: ChatLogprobs | None = Field(None, description="Logprobs, when asked for.")
    finish_reason: str | None = Field(description="stop, length or abort.")


class ChatCompletionResponse(ResponseHead):
    object: Literal["chat.completion"] = Field("chat.completion", description="The object type.")
    choices: list[ChatChoice] = Field(description="The choices.")
    usage: Usage = Field(description="Token counts.")


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(None, description="In a choice's first chunk only.")
    content: str | None = Field(None, description="New text.")


class ChatChunkChoice(BaseModel):
    index: int = Field(description="The choice's position (0 .. n-1).")
    delta: ChatDelta = Field(description="What is new.")
    logprobs: ChatLogprobs | None = Field(None, description="Logprobs of the new tokens, when asked for.")
    finish_reason: str | None = Field(None, description="Set in the choice's last chunk.")


class ChatCompletionChunk(ResponseHead):
    object: Literal["chat.completion.chunk"] = Field("chat.completion.chunk", description="The object type.")
    choices: list[ChatChunkChoice] = Field(description="Choices with news (empty in the usage chunk).")
    usage: Usage | None = Field(None, description="Only in the usage chunk (stream_options.include_usage).")


class ModelCard(BaseModel):
    id: str = Field(description="The name requests use.")
    object: Literal["model"] = Field("model", description="The object type.")
    created: int = Field(description="Unix time the engine started.")
    owned_by: str = Field("specserve", description="Always specserve.")
    max_model_len: int = Field(description="Prompt plus output tokens one request may hold.")


class ModelList(BaseModel):
    object: Literal["list"] = Field("list", description="The object type.")
    data: list[ModelCard] = Field(description="The served models.")
