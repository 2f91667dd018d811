"""Triton kernels of specserve, importable as ``specserve_kernels``.

One module per kernel family: the ``@triton.jit`` kernel, a launcher that checks shapes, and a
plain-torch ``*_ref`` it is tested against (on CPU under ``TRITON_INTERPRET=1``).
"""

if __name__ == "kernels":
    # Reached only when the repository root is on sys.path: `kernels` is a different PyPI package
    # (transformers probes for it), so refuse to stand in for it.
    raise ImportError("this folder is specserve's Triton kernels; import it as `specserve_kernels`")
