"""Tokenizers (with chat templates) for HF folders and GGUFs; GGUF conversions are cached."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from specserve.assets import cache_dir
from specserve.model.arch import ModelArch


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of an HF folder, or of a GGUF (converted once, then read from the cache)."""
    path = Path(path)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(path)
    cached = cache_dir() / "tokenizers" / gguf_tokenizer_key(path)
    if not cached.is_dir():
        _convert_gguf_tokenizer(path, cached)
    return AutoTokenizer.from_pretrained(cached)


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """A conversation rendered with the tokenizer's chat template, the assistant turn opened.

    Raises ValueError("messages...: ...") for malformed messages or ones the template rejects.
    """
    ids = _apply_chat_template(tokenizer, messages, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def chat_prompts_ids(
    tokenizer: PreTrainedTokenizerBase, conversations: Sequence[Sequence[Mapping[str, Any]]]
) -> list[list[int]]:
    """`chat_prompt_ids` of many conversations: each rendered to text by the template, then all
    tokenized in one batch as `apply_chat_template` tokenizes its text (no special tokens added),
    which a fast tokenizer spreads over every core (draft training's tens of thousands of prompts)."""
    texts = [_apply_chat_template(tokenizer, messages, tokenize=False) for messages in conversations]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []


def _apply_chat_template(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]], *, tokenize
):
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages: must be a non-empty list of {'role': ..., 'content': ...} objects")
    for i, message in enumerate(messages):
        if not (
            isinstance(message, Mapping)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ValueError(f"messages[{i}]: must be an object with a string 'role' and a string 'content'")
    if not tokenizer.chat_template:
        raise ValueError("messages: the model has no chat template")
    try:
        return tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=tokenize, add_generation_prompt=True
        )
    except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"messages: the chat template rejected them ({exc})") from exc


def eos_token_ids(
    tokenizer: PreTrainedTokenizerBase, arch: ModelArch, folder: str | Path | None = None
) -> tuple[int, ...]:
    """Every id that ends a reply: the tokenizer's, the checkpoint's and generation_config.json's."""
    ids = [tokenizer.eos_token_id, *arch.eos_token_ids]
    gen_config = Path(folder) / "generation_config.json" if folder is not None else None
    if gen_config is not None and gen_config.is_file():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids.extend(eos if isinstance(eos, list) else [eos])
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _convert_gguf_tokenizer(gguf_path: Path, dest: Path) -> None:
    # Slow (~10 s for a 49k vocab): transformers rebuilds a fast tokenizer from GGUF metadata.
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        tokenizer.save_pretrained(tmp)
        # Publish atomically: readers see no folder or a complete one.
        os.replace(tmp, dest)
    except OSError:
        if not dest.is_dir():  # a concurrent process winning the race is fine; anything else is not
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def gguf_tokenizer_key(gguf_path: Path) -> str:
    """A digest of the GGUF's ``tokenizer.*`` metadata and the converting transformers version.

    Content-addressed so copies and re-quantisations of a model share one cache entry. It walks the
    key-value section by hand because ``gguf.GGUFReader`` takes seconds to parse a large vocabulary.
    """
    digest = hashlib.sha256(f"transformers={transformers.__version__}".encode())
    with open(gguf_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for key, raw in _GgufKvWalker(buf).items():
            if key.startswith("tokenizer."):
                digest.update(raw)
    return digest.hexdigest()[:32]


class _GgufKvWalker:
    """Yields (key, raw bytes of the whole entry) for each metadata entry of a GGUF v2/v3 file."""

    # GGUF value types 0..12 and their sizes; 8 (string) and 9 (array) have variable length.
    _SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def __init__(self, buf: mmap.mmap) -> None:
        if buf[:4] != b"GGUF":
            raise ValueError("not a GGUF file")
        self._buf = buf
        version = struct.unpack_from("<I", buf, 4)[0]
        self._order = "<" if version < 0x10000 else ">"  # big-endian GGUFs exist too
        if self._unpack("I", 4) < 2:
            raise ValueError("GGUF version 1 is not supported")

    def items(self):
        kv_count = self._unpack("Q", 16)
        pos = 24
        for _ in range(kv_count):
            start = pos
            key_len = self._unpack("Q", pos)
            key = bytes(self._buf[pos + 8 : pos + 8 + key_len]).decode()
            pos += 8 + key_len
            pos = self._skip_value(self._unpack("I", pos), pos + 4)
            yield key, self._buf[start:pos]

    def _skip_value(self, vtype: int, pos: int) -> int:
        if vtype == 8:
            return pos + 8 + self._unpack("Q", pos)
        if vtype == 9:
            item_type, count = self._unpack("I", pos), self._unpack("Q", pos + 4)
            pos += 12
            if item_type in self._SIZES:
                return pos + count * self._SIZES[item_type]
            for _ in range(count):
                pos = self._skip_value(item_type, pos)
            return pos
        return pos + self._SIZES[vtype]

    def _unpack(self, fmt: str, pos: int) -> int:
        return struct.unpack_from(self._order + fmt, self._buf, pos)[0]
