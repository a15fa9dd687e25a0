"""The guarded Triton import every kernel module shares.

moetrain runs without Triton (CPU machines, CI): then `triton` and `tl` are None, `jit` returns
the plain function so that kernel modules still import, and `triton_available()` is False; the
kernels' entry points check it and their callers fall back to the torch references.
`interpreting()`: TRITON_INTERPRET=1, under which Triton runs kernels on CPU tensors (it must be
set before Triton is first imported: Triton fixes the mode of its own library at import).
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
except ImportError:  # the package works without Triton; only the kernels need it
    triton = None
    tl = None


def jit(fn):
    """triton.jit, or the plain function without Triton."""
    return triton.jit(fn) if triton is not None else fn


def triton_available() -> bool:
    return triton is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
