"""The offline Python API: `LLM(...).generate(...)` and `.chat(...)`, driving one engine in-process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from specserve.engine.engine import Engine
from specserve.model.loader import LoadedModel
from specserve.model.tokenizer import chat_prompt_ids
from specserve.types import RequestOutput, SamplingParams

Prompt = str | Sequence[int]
Message = dict[str, Any]


class LLM:
    """A model served in this process.

    `model` is an asset name (default `smollm2-135m-instruct`), a `.gguf` file or an HF folder, or a
    `LoadedModel` another LLM already holds (engines then share the weights).
    `device`/`dtype` default to the GPU in bf16 when there is one, else the CPU in fp32.
    `attention_backend`: "auto" (Triton kernels on CUDA, plain torch on the CPU), "torch", "triton" or
    "flash" (vllm-flash-attn where it imports; CUDA, fp16/bf16, `page_size` a multiple of 16).
    `cuda_graphs`: decode and verify steps replay CUDA graphs captured per batch bucket up to
    `cuda_graph_max_batch` (default: on with the Triton backend on CUDA), and prompts of up to
    `cuda_graph_prefill_tokens` tokens a step (default 512 on CUDA). `overlap_schedule`: the
    host prepares step n+1 while the device runs step n (default: on without speculation).
    `decode_steps`: without speculation, greedy requests decode this many steps a run on the device
    before the host reads their tokens (default 8 where CUDA graphs are captured; 0: off).
    `speculative` turns on speculative decoding: a `SpeculativeConfig`, a dict of its fields
    (e.g. `{"method": "ngram", "num_steps": 4}`), a method name, or "default": the draft head
    trained for the model when one ships with specserve (docs/draft-training.md), else n-gram.
    `"adaptive": True` (or a dict of `AdaptiveConfig` settings) in it picks the draft shape, or none,
    every step (docs/speculative.md); `speculative={"adaptive": True}` adapts n-gram drafting.

    An LLM is one process (tensor-parallel size 1). A tensor-parallel engine is an
    `Engine(EngineConfig(..., tp_size=N), tp=...)` on rank 0 of a group whose other ranks run
    `specserve.executor.follower.run_follower` (on one host: `specserve.executor.local.local_tp_group`).
    """

    def __init__(
        self,
        model: str | LoadedModel = "smollm2-135m-instruct",
        *,
        device: str = "auto",
        dtype: str = "auto",
        page_size: int = 1,
        speculative: SpeculativeConfig | dict | str | None = None,
        max_total_tokens: int | None = None,
        max_running_requests: int = 64,
        max_batched_tokens: int = 2048,
        chunked_prefill: bool = True,
        enable_prefix_cache: bool | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        attention_backend: str = "auto",
        cuda_graphs: bool | None = None,
        cuda_graph_max_batch: int = 64,
        cuda_graph_prefill_tokens: int | None = None,
        overlap_schedule: bool | None = None,
        decode_steps: int | None = None,
    ) -> None:
        loaded = model if isinstance(model, LoadedModel) else None
        config = EngineConfig(
            model=str(loaded.location.path) if loaded else model,
            device=device,
            dtype=dtype,
            max_model_len=max_model_len,
            attention_backend=attention_backend,
            cuda_graphs=cuda_graphs,
            cuda_graph_max_batch=cuda_graph_max_batch,
            cuda_graph_prefill_tokens=cuda_graph_prefill_tokens,
            overlap_schedule=overlap_schedule,
            decode_steps=decode_steps,
            seed=seed,
            speculative=SpeculativeConfig.from_value(speculative, loaded.location.name if loaded else model),
            cache=CacheConfig(
                page_size=page_size,
                max_total_tokens=max_total_tokens,
                enable_prefix_cache=enable_prefix_cache,
            ),
            scheduler=SchedulerConfig(
                max_running_requests=max_running_requests,
                max_batched_tokens=max_batched_tokens,
                chunked_prefill=chunked_prefill,
            ),
        )
        self.engine = Engine(config, loaded)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt (text or token ids) to completion; outputs come back in prompt order."""
        batch = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(batch))
        ids: list[str] = []
        try:
            for prompt, p in zip(batch, params, strict=True):
                ids.append(self.engine.add_request(prompt, p, stream=False))  # only the last output is read
            return self._run(ids)
        except BaseException:
            for request_id in ids:  # leave no request (or KV page) behind
                self.engine.abort(request_id)
            while self.engine.has_unfinished():
                self.engine.step()
            raise

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (with the assistant prompt) to one or several conversations."""
        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages: give a conversation (a non-empty list of messages) or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self._chat_ids(c) for c in conversations]
        return self.generate(prompts, sampling_params)

    def _chat_ids(self, conversation: Sequence[Message]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, conversation)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            if not self.engine.has_unfinished():
                raise RuntimeError(f"engine went idle with {len(ids) - len(done)} requests unfinished")
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    # bytes are a Sequence of ints: b"hello" was read as five token ids
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes | bytearray) or len(prompts) == 0:
        raise ValueError("prompts: must be a string, a list of token ids, or a non-empty list of those")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [list(prompts)]
    for p in prompts:
        if not isinstance(p, str | Sequence) or isinstance(p, bytes | bytearray):
            raise ValueError("prompts: every prompt must be a string or a list of token ids")
    return list(prompts)


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, Sequence):
        raise ValueError(f"sampling_params: give one SamplingParams or a list of {n}")
    params = list(params)
    if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"sampling_params: give one SamplingParams or a list of {n}")
    return params
