"""The fused gradient accumulation (buffer = grad, buffer += grad, cast fused) against torch's
copy_ / add_ on fresh random inputs: bitwise, since both add the exactly widened gradient once."""

from __future__ import annotations

import pytest
import torch
from conftest import interpreted, needs_cuda_and_triton, needs_interpreter, run_interpreted_tests

# around the block (4096): one element, a block, a block and one, a 2-d gradient
SHAPES = [(1,), (4096,), (4097,), (3, 5000)]


def check(grad_dtype, device, seed=0):
    from moetrain.kernels.accumulate_triton import accumulate_, supports

    gen = torch.Generator().manual_seed(seed)
    for shape in SHAPES:
        grads = [torch.randn(shape, generator=gen).to(grad_dtype).to(device) for _ in range(3)]
        got = torch.full(shape, float("nan"), device=device)  # the first copy overwrites it
        expected = torch.empty(shape, device=device)
        assert supports(got, grads[0])
        for i, grad in enumerate(grads):
            accumulate_(got, grad, first=i == 0)
            expected.copy_(grad) if i == 0 else expected.add_(grad)
        assert torch.equal(got, expected), shape


@needs_interpreter
def test_accumulate_under_interpreter():
    run_interpreted_tests(__file__)


@interpreted
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_matches_torch_interpreted(grad_dtype):
    check(grad_dtype, "cpu")


@pytest.mark.gpu
@needs_cuda_and_triton
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_torch_cuda(grad_dtype):
    check(grad_dtype, "cuda")


def test_falls_back_to_torch_where_the_kernel_does_not_apply():
    from moetrain.kernels.accumulate_triton import accumulate_, supports

    buffer = torch.zeros(6, 4)[:, :2]  # not contiguous: never the kernel
    grad = torch.randn(6, 2, dtype=torch.bfloat16)
    assert not supports(buffer, grad)
    accumulate_(buffer, grad, first=True)
    accumulate_(buffer, grad, first=False)
    assert torch.equal(buffer, 2 * grad.float())
