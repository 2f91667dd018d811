"""Triton kernels of specserve, importable as ``specserve_kernels``.

One module per kernel family: the ``@triton.jit`` kernel, a launcher that checks shapes, and a
plain-torch ``*_ref`` it is tested against (on CPU under ``TRITON_INTERPRET=1``).
"""

if __name__ == "kernels":
    # Reached only when the repository root is on sys.path (`python -m ...` from the checkout, or
    # PYTHONPATH): `kernels` is a different PyPI package that transformers probes for, and passing
    # for it would break transformers in obscure ways. Fail here, where the cause is plain.
    raise ImportError(
        "the specserve checkout is on sys.path, so its kernels/ folder shadows the PyPI package `kernels`; "
        "run the installed `specserve` / `pytest` commands (or `python -P`) instead"
    )

import os as _os


def use_triton(device) -> bool:
    """Whether the engine calls a Triton kernel or its torch reference on `device`.

    Kernels run natively on CUDA. On the CPU the engine takes the references, unless
    SPECSERVE_TRITON_CPU=1 asks for the kernels under the Triton interpreter (tests of the engine's
    kernel path; the interpreter is far too slow to serve with).
    """
    return getattr(device, "type", device) == "cuda" or _os.environ.get("SPECSERVE_TRITON_CPU") == "1"


def check_indices() -> bool:
    """Whether the engine asks its kernel launchers to assert every index in bounds (a host sync per
    launch): SPECSERVE_CHECK_INDICES=1, which the test suite sets. Host-built index lists (the KV
    moves) are checked always; they cost no sync."""
    return _os.environ.get("SPECSERVE_CHECK_INDICES") == "1"
