"""The sum of squares of many tensors in one Triton launch (the global gradient norm), where
`torch._foreach_norm` takes dozens of launches below copy bandwidth.

Program c reduces chunk c (BLOCK elements of one tensor, chunk tables from
`moetrain.kernels.multi_tensor`) to one fp32 partial sum; the partials are then summed in a fixed
order, so the result is deterministic. As in the AdamW kernel, whole chunks of 16-byte-aligned
tensors load without a mask (full-width vectors); only a tensor's last chunk is masked.
"""

from __future__ import annotations

import torch

from moetrain.kernels.multi_tensor import chunk_layout, upload
from moetrain.kernels.triton_support import interpreting as _interpreting
from moetrain.kernels.triton_support import jit as _jit
from moetrain.kernels.triton_support import tl, triton
from moetrain.kernels.triton_support import triton_available as triton_available

BLOCK = 8192
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@_jit
def _sum_of_squares_kernel(
    addr_ptr, chunk_ptr, numel_ptr, partial_ptr,
    DTYPE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    i = tl.load(chunk_ptr + 2 * pid)
    start = tl.load(chunk_ptr + 2 * pid + 1)
    numel = tl.load(numel_ptr + i)
    ptr = tl.load(addr_ptr + i).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
        start = tl.multiple_of(start, BLOCK)
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= numel:
        x = tl.load(ptr + offs).to(tl.float32)
    else:
        x = tl.load(ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
    tl.store(partial_ptr + pid, tl.sum(x * x, axis=0))


def supports(tensors: list[torch.Tensor]) -> bool:
    """Whether `multi_tensor_sum_of_squares` takes these: Triton, CUDA (or the interpreter), one
    device and one float dtype, contiguous."""
    if triton is None or not tensors:
        return False
    t0 = tensors[0]
    return (
        (t0.is_cuda or _interpreting())
        and t0.dtype in _DTYPES
        and all(t.device == t0.device and t.dtype == t0.dtype for t in tensors)
        and all(t.is_contiguous() for t in tensors)
    )


def multi_tensor_sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """sum over tensors and elements of x^2, as an fp32 scalar on their device."""
    if not supports(tensors):
        raise ValueError("multi_tensor_sum_of_squares: needs contiguous tensors of one float dtype")
    device = tensors[0].device
    chunk_c2, numel_n, n_chunks = chunk_layout(tuple(t.numel() for t in tensors), BLOCK, device)
    if n_chunks == 0:
        return torch.zeros((), dtype=torch.float32, device=device)
    addrs = [t.data_ptr() for t in tensors]
    addr_n = upload(torch.tensor(addrs, dtype=torch.int64), device)
    partial_c = torch.empty(n_chunks, dtype=torch.float32, device=device)
    tl_dtype = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    _sum_of_squares_kernel[(n_chunks,)](
        addr_n, chunk_c2, numel_n, partial_c,
        DTYPE=tl_dtype[tensors[0].dtype], ALIGNED=all(a % 16 == 0 for a in addrs), BLOCK=BLOCK,
        num_warps=8,
    )  # fmt: skip
    return partial_c.sum()
