"""Gradient accumulation into a buffer of wider dtype in one Triton pass: `buffer = grad` (the
first micro-batch of a step) or `buffer += grad`, with the cast fused into the load.

For the gradient sync's fp32 buffers, which take every micro-batch's bf16 `.grad` (torch's
mixed-dtype `copy_` / `add_` cast element by element). The result equals torch's: one fp32
addition of the exactly widened gradient per element.
"""

from __future__ import annotations

import torch

from moetrain.kernels.triton_support import interpreting as _interpreting
from moetrain.kernels.triton_support import jit as _jit
from moetrain.kernels.triton_support import tl, triton
from moetrain.kernels.triton_support import triton_available as triton_available

BLOCK = 4096
_BUFFER_DTYPES = (torch.float32,)
_GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@_jit
def _accumulate_kernel(buf_ptr, grad_ptr, numel, FIRST: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if not FIRST:
        g += tl.load(buf_ptr + offs, mask=mask, other=0.0)
    tl.store(buf_ptr + offs, g, mask=mask)


def supports(buffer: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether `accumulate_` runs the kernel for these: Triton, CUDA (or the interpreter), an
    fp32 buffer and a float gradient of the same shape, both contiguous on one device."""
    return (
        triton is not None
        and (buffer.is_cuda or _interpreting())
        and buffer.dtype in _BUFFER_DTYPES
        and grad.dtype in _GRAD_DTYPES
        and buffer.shape == grad.shape
        and buffer.device == grad.device
        and buffer.is_contiguous()
        and grad.is_contiguous()
    )


def accumulate_(buffer: torch.Tensor, grad: torch.Tensor, first: bool) -> torch.Tensor:
    """`buffer.copy_(grad)` when `first`, else `buffer.add_(grad)`; in one Triton pass where
    `supports(buffer, grad)`, through torch otherwise. Returns `buffer`."""
    if not supports(buffer, grad):
        return buffer.copy_(grad) if first else buffer.add_(grad)
    numel = buffer.numel()
    if numel:
        grid = (triton.cdiv(numel, BLOCK),)
        _accumulate_kernel[grid](buffer, grad, numel, FIRST=first, BLOCK=BLOCK)
    return buffer
