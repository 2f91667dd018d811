"""The native, SGLang-compatible `/generate` request and response bodies.

Field names and defaults follow SGLang's; requests are strict and refuse unknown fields. Value
ranges are checked once, by `SamplingParams` and the engine, whose errors name these same fields.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field

from specserve.api.limits import MAX_NATIVE_TOP_LOGPROBS, MAX_PROMPTS, MAX_RID_LEN, MAX_TOKEN_ID_LIST
from specserve.api.openai_schemas import STRICT, StopStrings, Text, TokenIdList, ZeroPenalty, neutral
from specserve.types import SamplingParams

SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_new_tokens",
    "min_new_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "seed",
    "skip_special_tokens",
)


class NativeSamplingParams(BaseModel):
    model_config = STRICT
    temperature: float = Field(1.0, description="Sampling temperature (>= 0); 0 is greedy.")
    top_p: float = Field(1.0, description="Nucleus sampling mass, in (0, 1].")
    top_k: int = Field(-1, description="Sample among the k likeliest tokens; -1 is off.")
    min_p: float = Field(0.0, description="Drop tokens below min_p x the top probability, in [0, 1).")
    max_new_tokens: int | None = Field(
        128, description="Most tokens to generate; 0 scores the prompt only; null: up to the context length."
    )
    min_new_tokens: int = Field(0, description="Tokens to generate before EOS or a stop may end the output.")
    stop: StopStrings = Field(None, description="A stop string or a list; the text ends before it.")
    stop_token_ids: TokenIdList | None = Field(
        None,
        description="Token ids that end the output; the matched token stays in it (and in the text unless "
        "skip_special_tokens drops it), as in vLLM.",
    )
    ignore_eos: bool = Field(False, description="Keep generating past EOS.")
    seed: int | None = Field(None, description="Seed of the sampler: same seed, same output.")
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the text.")
    frequency_penalty: ZeroPenalty = Field(
        0.0, description="Only 0, SGLang's default: penalties are not implemented."
    )
    presence_penalty: ZeroPenalty = Field(
        0.0, description="Only 0, SGLang's default: penalties are not implemented."
    )
    repetition_penalty: Annotated[float, neutral(1.0)] = Field(
        1.0, description="Only 1, SGLang's default: penalties are not implemented."
    )


PromptIds = Annotated[list[int], Field(min_length=1)]
Rid = Annotated[Text, Field(min_length=1, max_length=MAX_RID_LEN)]


class GenerateRequest(BaseModel):
    model_config = STRICT
    text: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)] | None = Field(
        None, description="The prompt, or a batch of prompts (give text or input_ids)."
    )
    input_ids: PromptIds | Annotated[list[PromptIds], Field(min_length=1, max_length=MAX_PROMPTS)] | None = (
        Field(None, description="The prompt as token ids, or a batch of those (give text or input_ids).")
    )
    sampling_params: (
        NativeSamplingParams | Annotated[list[NativeSamplingParams], Field(max_length=MAX_PROMPTS)]
    ) = Field(
        default_factory=NativeSamplingParams,
        description="How to decode: one object for every prompt, or one per prompt of a batch.",
    )
    return_logprob: bool = Field(False, description="Return logprobs in meta_info.")
    top_logprobs_num: int = Field(
        0,
        ge=0,
        le=MAX_NATIVE_TOP_LOGPROBS,
        description="With return_logprob: this many likeliest tokens per position.",
    )
    token_ids_logprob: TokenIdList | None = Field(
        None,
        description=f"With return_logprob: the logprobs of these ids (at most {MAX_TOKEN_ID_LIST}) per position.",
    )
    logprob_start_len: int = Field(
        -1, description="With return_logprob: prompt logprobs from this index on; -1 for none."
    )
    stream: bool = Field(
        False, description="Stream cumulative results as server-sent events ending `data: [DONE]`."
    )
    rid: Rid | Annotated[list[Rid], Field(max_length=MAX_PROMPTS)] | None = Field(
        None, description=f"Request id(s), one per prompt, 1-{MAX_RID_LEN} characters; default: generated."
    )

    @property
    def prompt_field(self) -> str:
        return "input_ids" if self.input_ids is not None else "text"

    @property
    def batched(self) -> bool:
        prompt = self.text if self.text is not None else self.input_ids
        return not (prompt is None or isinstance(prompt, str) or isinstance(prompt[0], int))

    def prompts(self) -> list[str | list[int]]:
        """The prompts; ValueError naming the field when the shape is wrong."""
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("text: give exactly one of text and input_ids")
        prompt = self.text if self.text is not None else self.input_ids
        return list(prompt) if self.batched else [prompt]

    def request_ids(self, count: int, make_id) -> list[str]:
        if self.rid is None:
            return [make_id(i) for i in range(count)]
        rids = [self.rid] if isinstance(self.rid, str) else list(self.rid)
        if len(rids) != count:
            raise ValueError(f"rid: give one id per prompt ({count})")
        return rids

    def params_per_prompt(self, count: int) -> list[SamplingParams]:
        given = self.sampling_params
        per_prompt = given if isinstance(given, list) else [given] * count
        if len(per_prompt) != count:
            raise ValueError(f"sampling_params: give one object, or one per prompt ({count})")
        return [self._params(p) for p in per_prompt]

    def _params(self, p: NativeSamplingParams) -> SamplingParams:
        fields = {name: getattr(p, name) for name in SAMPLING_FIELDS}
        fields["stop"] = tuple(p.stop or ())
        fields["stop_token_ids"] = tuple(p.stop_token_ids or ())
        return SamplingParams(
            **fields,
            return_logprob=self.return_logprob,
            top_logprobs_num=self.top_logprobs_num,
            token_ids_logprob=None if self.token_ids_logprob is None else tuple(self.token_ids_logprob),
            logprob_start_len=self.logprob_start_len,
        )

    def engine_fields(self) -> dict[str, str]:
        fields = {name: f"sampling_params.{name}" for name in SAMPLING_FIELDS}
        fields.update(prompt=self.prompt_field, input_ids=self.prompt_field, request_id="rid")
        return fields


class GenerateResponse(BaseModel):
    text: str = Field(description="The generated text (streaming: all of it so far).")
    output_ids: list[int] = Field(description="The generated token ids (streaming: all so far).")
    meta_info: dict[str, Any] = Field(
        description="id, finish_reason, prompt_tokens, completion_tokens, cached_tokens, spec_* stats, logprobs."
    )
    index: int | None = Field(None, description="Streaming a batch: which prompt this chunk is about.")
