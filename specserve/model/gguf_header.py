"""A GGUF's header as the loader needs it (the model's shape, and where each tensor lies), parsed once
per file and kept in the cache.

`gguf.GGUFReader` parses every metadata entry into numpy views, the tokenizer's arrays included
(98k strings): ~4.8 s of a 9 s SmolLM2 load on a 2-core CPU, paid again by every process that loads
the model (a server's replicas, each test worker). The loader needs none of those strings: the shape
(`arch_from_gguf`), the converter's architecture, and each tensor's type, layout and file offset.
Those are written beside the asset cache after the first parse, keyed by the file's path, size and
modification time, and read back as JSON; the tensors are then views of the file at those offsets,
exactly what the reader would have given.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import gguf
import numpy as np

from specserve.assets import cache_dir, stat_key, write_record
from specserve.model.arch import ModelArch, RopeScaling, arch_from_gguf

# Bumped when what is stored changes: entries of another version are parsed afresh.
FORMAT = 1


@dataclass(frozen=True)
class TensorSpan:
    """One tensor as `GGUFReader` lays it out: its data is `shape` items of `dtype` at byte `offset`
    (quantised types: rows of raw block bytes, which `gguf.quants.dequantize` reads)."""

    name: str
    ggml_type: int
    dtype: str  # numpy dtype string, byte order included
    shape: tuple[int, ...]
    offset: int

    def data(self, file: np.memmap) -> np.ndarray:
        return np.ndarray(self.shape, dtype=np.dtype(self.dtype), buffer=file, offset=self.offset)

    @property
    def tensor_type(self) -> gguf.GGMLQuantizationType:
        return gguf.GGMLQuantizationType(self.ggml_type)


@dataclass(frozen=True)
class GgufHeader:
    arch: ModelArch
    architecture: str  # general.architecture: the converter that wrote the file
    tensors: tuple[TensorSpan, ...]


def read_header(path: str | Path) -> GgufHeader:
    """The header of the GGUF at `path`: from the cache when an entry for this file is there, else
    parsed (and stored, where the cache is writable)."""
    path = Path(path).resolve()
    entry = _entry(path)
    if entry.is_file():
        try:
            return _decode(json.loads(entry.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged or foreign entry: parse afresh and replace it
    header = parse_header(path)
    write_record(entry, json.dumps(_encode(header)))  # read-only cache: the next load parses again
    return header


def parse_header(path: str | Path) -> GgufHeader:
    """The header through `gguf.GGUFReader` (the slow way, and the reference of the cached one)."""
    reader = gguf.GGUFReader(path)
    spans = tuple(
        TensorSpan(
            t.name,
            int(t.tensor_type),
            t.data.dtype.str,
            tuple(int(d) for d in t.data.shape),
            int(t.data_offset),
        )
        for t in reader.tensors
    )
    return GgufHeader(arch_from_gguf(reader), str(reader.fields["general.architecture"].contents()), spans)


def _entry(path: Path) -> Path:
    stat = stat_key(path)
    key = f"{FORMAT}:{version('gguf')}:{path}:{stat['size']}:{stat['mtime_ns']}"
    return cache_dir() / "gguf-headers" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _encode(header: GgufHeader) -> dict:
    return {
        "format": FORMAT,
        "arch": dataclasses.asdict(header.arch),
        "architecture": header.architecture,
        "tensors": [dataclasses.astuple(t) for t in header.tensors],
    }


def _decode(payload: dict) -> GgufHeader:
    if payload.get("format") != FORMAT:
        raise ValueError("another format")
    fields = dict(payload["arch"])
    if fields.get("attention_layers") is not None or fields.get("mamba") is not None:
        raise ValueError("GGUF headers describe plain decoders only")
    fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
    tensors = tuple(
        TensorSpan(name, int(kind), dtype, tuple(shape), int(offset))
        for name, kind, dtype, shape, offset in payload["tensors"]
    )
    return GgufHeader(ModelArch(**fields), str(payload["architecture"]), tensors)
