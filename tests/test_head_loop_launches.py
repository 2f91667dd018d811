"""How many launches a head-loop iteration makes around the head's own forwards (printed figures).

Inside a CUDA graph every kernel costs 1.5-2 us however small, so the bookkeeping of a chain step and
of the extend (positions, slots, the next seeds) is fused into one Triton kernel each
(`kernels/head_glue.py`). This counts, on the CPU, what a batch-1 iteration of `HeadDeviceLoop`
launches outside `head.run` and `head.logits`: torch operators that would be kernels on a GPU (views
and allocations left out) plus Triton launches (run by the interpreter: SPECSERVE_TRITON_CPU=1).
The figures are printed (`-s`); the assertion only pins the fused shape: per chain step and for the
extend, the glue kernel and the split argmax's two launches.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import pytest
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.interpreter import InterpretedFunction

from specserve.engine.head_loop import HeadDeviceLoop
from specserve.model.head_checkpoint import random_head, save_head
from specserve.spec.draft_graphs import DraftGraphs

from engine_utils import loop_llm

# Operators that launch no kernel on a GPU: views, metadata, allocations.
NO_KERNEL = {
    "view", "_unsafe_view", "t", "transpose", "permute", "slice", "select", "unsqueeze", "squeeze",
    "expand", "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind", "empty",
    "empty_strided", "empty_like", "lift_fresh", "_reshape_alias", "reshape", "flatten",
    "to", "promote_types", "scalar_tensor",  # a dtype no-op; a CPU scalar operand (none on a GPU)
}  # fmt: skip


class _Counter(TorchDispatchMode):
    """Kernel-launching torch operators and Triton launches, by region; paused inside the head."""

    def __init__(self) -> None:
        super().__init__()
        self.region: str | None = None
        self.counts: Counter[str] = Counter()
        self.ops: dict[str, Counter[str]] = {}

    def note(self, name: str) -> None:
        if self.region is not None:
            self.counts[self.region] += 1
            self.ops.setdefault(self.region, Counter())[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in NO_KERNEL:
            self.note(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def _patched(obj, name: str, wrap):
    original = getattr(obj, name)
    setattr(obj, name, wrap(original))
    try:
        yield
    finally:
        setattr(obj, name, original)


def _in_region(counter: _Counter, region):
    def wrap(original):
        def run(*args, **kwargs):
            saved = counter.region
            counter.region = region(*args) if callable(region) else region
            try:
                return original(*args, **kwargs)
            finally:
                counter.region = saved

        return run

    return wrap


def _count_iteration(loop: HeadDeviceLoop, batch: int) -> _Counter:
    counter = _Counter()
    head = loop.drafter.head

    def triton_run(original):  # one launch; the interpreter's own torch calls are not the kernel's
        def run(self, *args, **kwargs):
            counter.note(f"triton:{self.fn.__name__}")
            return _in_region(counter, None)(original)(self, *args, **kwargs)

        return run

    with (
        _patched(DraftGraphs, "chain_forward", _in_region(counter, "chain")),
        _patched(HeadDeviceLoop, "_extend", _in_region(counter, "extend")),
        _patched(head, "run", _in_region(counter, None)),
        _patched(head, "logits", _in_region(counter, None)),
        _patched(loop.graphs, "forward", _in_region(counter, None)),
        _patched(InterpretedFunction, "run", triton_run),
        counter,
    ):
        counter.region = "iteration"
        loop.step_once(batch)
        counter.region = None
    return counter


def test_glue_launches_of_an_iteration(small_vocab_target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_TRITON_CPU", "1")  # the kernels (interpreted), not their references
    config, tensors = random_head("eagle3", small_vocab_target.arch, seed=5, draft_vocab_size=64)
    folder = save_head(tmp_path / "eagle3", config, tensors)
    num_steps = 4  # a chain of 3 head steps after the extend's seed
    spec = {"method": "eagle3", "draft_model": str(folder), "num_steps": num_steps, "device_steps": 4}
    loop = loop_llm(small_vocab_target, spec, max_total_tokens=512).engine.device_loop
    assert isinstance(loop, HeadDeviceLoop)
    loop.reset_rows(1)
    counter = _count_iteration(loop, 1)
    chain, extend = counter.counts["chain"], counter.counts["extend"]
    print(f"\nglue launches at batch 1 (outside head.run / head.logits): chain {chain} over {num_steps - 1} "
          f"steps, extend {extend}, the rest of the iteration's glue {counter.counts['iteration']}")  # fmt: skip
    for region, ops in counter.ops.items():
        print(f"  {region}: {dict(ops)}")
    assert chain <= 3 * (num_steps - 1) and extend <= 3, counter.ops


if __name__ == "__main__":
    pytest.main([__file__, "-s", "-q"])


def test_kernels_in_the_loop_equal_plain_greedy(small_vocab_target, tmp_path, monkeypatch):
    """The loop with the glue kernels (interpreted) gives plain greedy decoding's tokens (the CPU's
    other loop tests run the references, which the kernel tests hold the kernels to bit for bit)."""
    from specserve import SamplingParams

    config, tensors = random_head("eagle3", small_vocab_target.arch, seed=5, draft_vocab_size=64)
    folder = save_head(tmp_path / "eagle3", config, tensors)
    prompts = [[5, 9, 11, 5, 9, 11, 5, 9], [40, 41, 42, 43]]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    plain = loop_llm(small_vocab_target, max_total_tokens=512).generate(prompts, params)
    monkeypatch.setenv("SPECSERVE_TRITON_CPU", "1")
    spec = {"method": "eagle3", "draft_model": str(folder), "num_steps": 3, "device_steps": 4}
    llm = loop_llm(small_vocab_target, spec, max_total_tokens=512)
    assert isinstance(llm.engine.device_loop, HeadDeviceLoop)
    iterations: list[int] = []
    original = HeadDeviceLoop._iteration
    monkeypatch.setattr(
        HeadDeviceLoop, "_iteration", lambda self, batch: (iterations.append(batch), original(self, batch))
    )
    looped = llm.generate(prompts, params)
    assert [o.token_ids for o in looped] == [o.token_ids for o in plain]
    assert iterations, "the loop ran"
