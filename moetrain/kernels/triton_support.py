"""The guarded Triton import every kernel module shares.

moetrain runs without Triton (CPU machines, CI): then `triton` and `tl` are None, `jit` returns
the plain function so that kernel modules still import, and `triton_available()` is False; the
kernels' entry points check it and their callers fall back to the torch references.
`interpreting()`: TRITON_INTERPRET=1, under which Triton runs kernels on CPU tensors (it must be
set before Triton is first imported: Triton fixes the mode of its own library at import).
`loop_bound(n)`: an int argument that a kernel uses as a runtime loop bound (see there).
"""

from __future__ import annotations

import os

import numpy as np

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


def loop_bound(n: int):
    """`n` for a kernel argument that bounds a runtime loop (`tl.range(0, n, ...)`): `n` on the
    GPU; under Triton 3.6's interpreter a 0-d int32 interpreter tensor, since it wraps an int in
    a 1-element numpy array that numpy 2.4's int() refuses (triton-lang/triton#9171)."""
    if not interpreting() or not -(2**31) <= n < 2**31:
        return n
    try:
        from triton.runtime.interpreter import TensorHandle
    except ImportError:  # an interpreter laid out otherwise: leave the argument to it
        return n
    return tl.tensor(TensorHandle(np.array(n, dtype=np.int32), tl.int32), tl.int32)
