"""A speed-up of Triton's interpreter for the CPU runs of the suite (a helper module, not a test file).

The interpreter (`triton.runtime.interpreter`, Triton 3.x) patches `triton.language` before each
launch (`GridExecutor.__call__`: `_patch_lang`, restored after the grid ran) and again at every call
of a `@triton.jit` helper inside the kernel (`InterpretedFunction.__call__`), once per program of the
grid. Each patch walks the language modules with `inspect.getmembers`; inside a launch they are
patched already, so the helpers' patches change nothing but cost a third of the interpreted tests'
time (test_head_loop_launches.py: 40k helper calls in 405 launches). Here a helper's patch is skipped
when the launch running on this thread has patched the same language modules already; kernels run
exactly as before (the launch's own patch and restore are untouched).
"""

from __future__ import annotations

import inspect
import threading
from types import ModuleType
from typing import Any


class _NothingPatched:
    """The scope of a skipped patch: nothing to restore (a helper's scope is never restored anyway)."""

    def restore(self) -> None:
        pass


def skip_nested_lang_patches() -> bool:
    """Install the skip; False (nothing changed) where the interpreter is not the one described above."""
    import triton.language as tl
    from triton.runtime import interpreter

    executor = getattr(interpreter, "GridExecutor", None)
    original_patch = getattr(interpreter, "_patch_lang", None)
    if executor is None or original_patch is None or getattr(original_patch, "_skips_nested", False):
        return False
    if list(inspect.signature(original_patch).parameters) != ["fn"]:
        return False
    original_call = executor.__call__
    launches = threading.local()  # per thread: the language modules each running launch has patched

    def languages(fn: Any) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if isinstance(v, ModuleType) and v in (tl, tl.core)}

    def call(self, *args: Any, **kwargs: Any) -> Any:
        stack = launches.__dict__.setdefault("stack", [])
        stack.append(set())
        try:
            return original_call(self, *args, **kwargs)
        finally:
            stack.pop()

    def patch_lang(fn: Any) -> Any:
        stack = launches.__dict__.get("stack")
        if stack:
            patched, modules = stack[-1], languages(fn)
            if patched and modules <= patched:
                return _NothingPatched()  # a helper whose modules this launch has patched already
            # The launch's own patch, or a helper's of other modules (triton's `tl.sum` and `tl.zeros`
            # see `triton.language.core`), which stay patched for the rest of the launch: upstream
            # never restores a helper's patch.
            patched |= modules
        return original_patch(fn)

    patch_lang._skips_nested = True  # type: ignore[attr-defined]
    executor.__call__ = call
    interpreter._patch_lang = patch_lang
    return True
