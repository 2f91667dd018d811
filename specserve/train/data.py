"""Phase 1 of draft training: the target answers prompts through our own engine; token ids are kept.

The target's answers, not the data set's, are what a draft head must predict (self-distillation):
each prompt is wrapped in the target's chat template and generated with the offline `LLM` in large
batches, fed continuously through the engine's step loop (a new prompt joins as soon as one ends:
no batch waits for its longest answer). Only token ids are stored (`responses.npz`: one flat id
array, each sample's length, prompt length and prompt index); hidden states are recomputed during
training, never written to disk. The file is rewritten every `save_seconds` with the prompts
answered so far, so a run stopped by its time budget (whose unfinished answers are dropped) or
killed resumes with the prompts it has not answered.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specserve.types import SamplingParams

RESPONSES = "responses.npz"
LOOP_CHECK_STEPS = 16  # engine steps between looks for answers that have started looping


@dataclass(frozen=True)
class Samples:
    """Token sequences (prompt + the target's answer) in one flat array."""

    tokens: np.ndarray  # [N] int32, every sample's ids back to back
    lengths: np.ndarray  # [n] int64
    prompt_lens: np.ndarray  # [n] int64
    prompt_index: np.ndarray  # [n] int64: which prompt each sample answers
    meta: dict | None = None  # how the answers were generated

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    def sample(self, i: int) -> np.ndarray:
        start = int(self.starts[i])
        return self.tokens[start : start + int(self.lengths[i])]

    def response_tokens(self) -> np.ndarray:
        """Every answer token (the draft vocabulary is chosen from these)."""
        keep = np.ones(len(self.tokens), dtype=bool)
        for start, prompt in zip(self.starts, self.prompt_lens, strict=True):
            keep[start : start + prompt] = False
        return self.tokens[keep]


def empty_samples(meta: dict | None = None) -> Samples:
    none = np.zeros(0, np.int64)
    return Samples(np.zeros(0, np.int32), none, none, none, meta)


def append(samples: Samples, new: Sequence[tuple[list[int], int, int]]) -> Samples:
    """`samples` plus `new` (token ids, prompt length, prompt index) triples."""
    if not new:
        return samples
    return Samples(
        np.concatenate([samples.tokens, *[np.asarray(ids, np.int32) for ids, _, _ in new]]),
        np.concatenate([samples.lengths, [len(ids) for ids, _, _ in new]]).astype(np.int64),
        np.concatenate([samples.prompt_lens, [p for _, p, _ in new]]).astype(np.int64),
        np.concatenate([samples.prompt_index, [i for _, _, i in new]]).astype(np.int64),
        samples.meta,
    )


def save_samples(samples: Samples, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.npz")
    np.savez_compressed(
        tmp,
        tokens=samples.tokens,
        lengths=samples.lengths,
        prompt_lens=samples.prompt_lens,
        prompt_index=samples.prompt_index,
        meta=np.array(json.dumps(samples.meta or {})),
    )
    tmp.replace(path)
    return path


def load_all(paths: Sequence[str | Path]) -> Samples:
    """Several response files (e.g. one per generation worker) as one set of samples."""
    parts = [load_samples(p) for p in paths]
    if not parts:
        raise ValueError("data: no response files given")
    return Samples(
        np.concatenate([p.tokens for p in parts]),
        np.concatenate([p.lengths for p in parts]),
        np.concatenate([p.prompt_lens for p in parts]),
        np.concatenate([p.prompt_index for p in parts]),
        parts[0].meta,
    )


def cut_loops(samples: Samples, ngram: int) -> Samples:
    """Each answer cut `ngram` tokens into its first loop: where an `ngram`-gram recurs that already
    occurred earlier in the answer. A small target's greedy answers often end in a loop it repeats
    to the token limit (more than half of SmolLM2-135M's ShareGPT answers, two thirds of their
    tokens); those tokens are trivial to predict, so uncut they fill the batches, inflate training
    accuracy (0.85 on them against 0.6 on MT-Bench answers) and teach the head little. The loop's
    first `ngram` tokens stay: a head must still learn to follow a repetition. 0: unchanged."""
    if ngram <= 0:
        return samples
    lengths = samples.lengths.copy()
    for i, (start, prompt) in enumerate(zip(samples.starts, samples.prompt_lens, strict=True)):
        end = _loop_end(samples.tokens[start + prompt : start + lengths[i]], ngram)
        if end is not None:
            lengths[i] = min(lengths[i], prompt + end)
    keep = np.zeros(len(samples.tokens), dtype=bool)
    for start, length in zip(samples.starts, lengths, strict=True):
        keep[start : start + length] = True
    return Samples(samples.tokens[keep], lengths, samples.prompt_lens, samples.prompt_index, samples.meta)


def _loop_start(ids: np.ndarray, n: int) -> int | None:
    """The first position whose n-gram occurred at an earlier position, or None (64-bit rolling
    hashes of every window; a false match needs a hash collision)."""
    if len(ids) <= n:
        return None
    windows = len(ids) - n + 1
    h = np.zeros(windows, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * np.uint64(1_000_003) + ids[j : j + windows].astype(np.uint64)
    _, first, inverse = np.unique(h, return_index=True, return_inverse=True)
    repeats = np.nonzero(first[inverse] < np.arange(windows))[0]
    return int(repeats[0]) if len(repeats) else None


def load_samples(path: str | Path) -> Samples:
    """A `responses.npz`, or a folder holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / RESPONSES
    if not path.is_file():
        raise ValueError(f"data: no generated responses at {path} (run the data phase first)")
    with np.load(path) as f:
        return Samples(
            f["tokens"].astype(np.int32),
            f["lengths"].astype(np.int64),
            f["prompt_lens"].astype(np.int64),
            f["prompt_index"].astype(np.int64),
            json.loads(str(f["meta"])),
        )


# ---- prompts -------------------------------------------------------------------------------------


TURN_DATASETS = ("sharegpt-turns",)  # data sets of conversations, built with the target's tokenizer


def prompt_texts(
    data: str,
    *,
    seed: int = 0,
    max_chars: int = 2000,
    tokenizer=None,
    max_prompt_tokens: int = 1024,
) -> list:
    """Prompts (`turns.Prompt`: a user turn's text, or a conversation's messages): a named data set
    (`sharegpt`, `mt-bench`: first user turns, in benchmark order; `sharegpt-turns`: every ShareGPT
    human turn with its context fitted to `max_prompt_tokens` of `tokenizer`'s chat template,
    `specserve/train/turns.py`) or a prompts file (JSON lines, optionally gzipped: a string, an object
    with `prompt`/`text`, or one with `messages`)."""
    from specserve.bench_data import DATASETS
    from specserve.bench_data import prompt_texts as dataset_texts

    if data in TURN_DATASETS:
        from specserve.assets import dataset_path
        from specserve.train.turns import sharegpt_turns

        if tokenizer is None:
            raise ValueError(f"data: {data} needs the target's tokenizer")
        turns = sharegpt_turns(
            dataset_path("sharegpt"),
            tokenizer,
            seed=seed,
            max_chars=max_chars,
            max_prompt_tokens=max_prompt_tokens,
        )
        return [t.as_messages() for t in turns]
    if data in DATASETS:
        return dataset_texts(data, seed=seed, max_chars=max_chars)
    if not Path(data).is_file():
        raise ValueError(f"data: {data!r} is neither one of {[*DATASETS, *TURN_DATASETS]} nor a prompts file")
    from specserve.train.turns import read_prompts_file

    return read_prompts_file(Path(data), max_chars=max_chars)


# ---- generation ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 512
    temperature: float = 0.0
    max_prompt_tokens: int = 1024
    batch: int = 128  # requests decoding together (the engine's running cap)
    # New requests join in waves of at least this many (0: a quarter of `batch`): a step that
    # prefills runs without CUDA graphs, so topping up one request at a time made nearly every
    # step of a large batch an eager one (28 ms a step at batch 256 on an H100, against ~3).
    wave: int = 0
    save_seconds: float = 30.0
    # End an answer this many tokens into its first loop (what `cut_loops` keeps of it): 0 never. Two
    # thirds of a small target's greedy answer tokens are loops run to the token limit, which
    # training cuts anyway; generating them took two thirds of the data phase.
    stop_loops: int = 0


def generate_responses(
    llm,
    prompts: Sequence[Sequence[int]],
    path: str | Path,
    settings: GenerationSettings,
    *,
    max_samples: int | None = None,
    deadline: float | None = None,
    meta: dict | None = None,
    log=print,
) -> Samples:
    """Answer `prompts` (token ids, chat template applied) with `llm`'s engine, resuming from `path`
    if it exists (answered prompts are skipped; a file made for another prompt list is refused), until
    the prompts, `max_samples` or the `deadline` (time.monotonic()) run out; answers unfinished at the
    deadline are dropped. Prompts longer than `max_prompt_tokens` are skipped."""
    path = Path(path)
    engine = llm.engine
    fingerprint = prompts_fingerprint(prompts)
    if path.is_file():
        samples = load_samples(path)
        known = (samples.meta or {}).get("prompts_sha256")  # files written before it have none
        if known is not None and known != fingerprint:
            raise ValueError(
                f"data: {path} answers another prompt list (its prompt indices would mean other prompts "
                "here): the same --data, --seed, --max-prompt-chars, --max-prompt-tokens and --shard "
                "resume it, or give another --responses"
            )
    else:
        samples = empty_samples({**(meta or {}), "prompts_sha256": fingerprint})
    answered = set(samples.prompt_index.tolist())
    todo = (i for i, p in enumerate(prompts) if i not in answered and len(p) <= settings.max_prompt_tokens)
    # Answers this run may add; `new` empties at each save, so the count is held against `kept`.
    kept = len(samples)
    budget = (max_samples - kept) if max_samples is not None else len(prompts)
    in_flight: dict[str, int] = {}
    new: list[tuple[list[int], int, int]] = []
    began = saved = time.monotonic()
    pace = _Pace()
    wave = settings.wave or max(1, settings.batch // 4)
    while True:
        late = deadline is not None and time.monotonic() >= deadline
        done = len(samples) - kept + len(new)
        top_up = settings.batch - len(in_flight) >= min(wave, budget - len(in_flight) - done)
        while top_up and not late and len(in_flight) < settings.batch and len(in_flight) + done < budget:
            i = next(todo, None)
            if i is None:
                break
            params = SamplingParams(
                max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, seed=i
            )
            # Not streamed: a streamed request builds its whole output (ids, text) every step.
            in_flight[engine.add_request(list(prompts[i]), params, stream=False)] = i
        if late:
            for request_id in in_flight:
                engine.abort(request_id)
        if not in_flight:
            break
        pace.steps += 1
        pace.running += len(engine.scheduler.running)
        for out in engine.step():
            i = in_flight.pop(out.request_id, None) if out.finished else None
            if i is not None and out.finish_reason != "abort":
                answer = list(out.token_ids)
                end = _loop_end(answer, settings.stop_loops) if settings.stop_loops else None
                new.append((list(prompts[i]) + answer[:end], len(prompts[i]), i))
        if settings.stop_loops and pace.steps % LOOP_CHECK_STEPS == 0:
            new += _stop_loops(engine, in_flight, prompts, settings.stop_loops)
        if time.monotonic() - saved >= settings.save_seconds:
            samples, new, saved = _save(samples, new, path, began, log, pace), [], time.monotonic()
    while engine.has_unfinished():  # the aborted requests' last outputs
        engine.step()
    return _save(samples, new, path, began, log, pace)


def _stop_loops(engine, in_flight: dict[str, int], prompts, ngram: int) -> list[tuple[list[int], int, int]]:
    """Requests whose answer has run `ngram` tokens into its first loop: aborted, and their answers
    so far, cut as `cut_loops` would cut them, returned as samples (out of `in_flight`). Answers that
    end by themselves get the same cut where they are collected."""
    done = []
    for request_id, i in list(in_flight.items()):
        answer = engine.output_ids(request_id)
        end = None if answer is None else _loop_end(answer, ngram)
        if end is not None and len(answer) >= end:
            engine.abort(request_id)
            del in_flight[request_id]
            done.append((list(prompts[i]) + answer[:end], len(prompts[i]), i))
    return done


def _loop_end(answer: Sequence[int] | np.ndarray, ngram: int) -> int | None:
    """Where `cut_loops` ends an answer: `ngram` tokens into its first loop (None: no loop yet)."""
    loop = _loop_start(np.asarray(answer, dtype=np.int64), ngram)
    return None if loop is None else loop + ngram


def prompts_fingerprint(prompts: Sequence[Sequence[int]]) -> str:
    """sha256 of a prompt list's token ids in order: a responses file records it, so that resuming
    with another list (whose index i is another prompt) is refused instead of mixing them up."""
    digest = hashlib.sha256()
    for ids in prompts:
        digest.update(np.int64(len(ids)).tobytes() + np.asarray(ids, np.int64).tobytes())
    return digest.hexdigest()


def unanswered_prompts(prompts: list, responses: Sequence[str | Path], chat_ids) -> list:
    """`prompts` less those the responses files answered (`--phase prompts --skip-answered`): each
    file's prompt indices count within its `--shard W/N` (its meta; 0/1 where none), index i being
    prompt W + N i. A file of its own for the rest lets a later data run carry it without the whole
    list and the answers it would resume from. `chat_ids` maps prompts to their chat-template ids:
    a file must hold this list's prompts at its indices (checked on up to CHECKED_PROMPTS of them)."""
    answered: set[int] = set()
    for path in responses:
        samples = load_samples(path)
        w, n = parse_shard(str((samples.meta or {}).get("shard") or "0/1"))
        indices = [w + n * int(i) for i in samples.prompt_index]
        if not _holds_prompts(samples, indices, prompts, chat_ids):
            raise ValueError(
                f"--skip-answered: {path} answers another prompt list (or other --shard settings)"
            )
        answered.update(indices)
    return [p for i, p in enumerate(prompts) if i not in answered]


CHECKED_PROMPTS = 200


def parse_shard(text: str) -> tuple[int, int]:
    """`--shard W/N` (as a responses file records it): (W, N)."""
    worker, _, count = text.partition("/")
    try:
        w, n = int(worker), int(count)
    except ValueError:
        raise ValueError(f"--shard: {text!r} is not W/N") from None
    if not 0 <= w < n:
        raise ValueError(f"--shard: {text!r} needs 0 <= W < N")
    return w, n


def _holds_prompts(samples: Samples, indices: list[int], prompts: list, chat_ids) -> bool:
    """Whether the samples' prompt tokens are those prompts' (all but 5% of those checked). Not the
    recorded fingerprint: tokenizer versions split a rare text differently (2 of 17,576 ShareGPT
    turns between the GPU machine's and this one's), which changes it for the whole list."""
    if any(i >= len(prompts) for i in indices):
        return False
    picks = sorted(set(np.linspace(0, len(indices) - 1, min(CHECKED_PROMPTS, len(indices)), dtype=int)))
    wanted = chat_ids([prompts[indices[j]] for j in picks])
    same = sum(
        samples.sample(j)[: samples.prompt_lens[j]].tolist() == list(ids)
        for j, ids in zip(picks, wanted, strict=True)
    )
    return same >= 0.95 * len(picks)


@dataclass
class _Pace:
    """Engine steps and the running requests summed over them: the log's steps/s and mean batch say
    whether slow generation is slow steps or small batches."""

    steps: int = 0
    running: int = 0


def _save(samples: Samples, new: list, path: Path, began: float, log, pace: _Pace) -> Samples:
    samples = append(samples, new)
    save_samples(samples, path)
    answer_tokens = int(samples.lengths.sum() - samples.prompt_lens.sum())
    seconds = time.monotonic() - began
    batch = pace.running / max(pace.steps, 1)
    log(
        f"data: {len(samples)} samples, {answer_tokens} answer tokens ({seconds:.0f}s; "
        f"{pace.steps / max(seconds, 1e-9):.1f} steps/s, {batch:.0f} requests running a step)"
    )
    return samples
