"""The multi-tensor sum of squares (global gradient norm) against a float64 sum, on CUDA and, on
CPU, through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from conftest import interpreted, needs_cuda_and_triton, needs_interpreter, run_interpreted_tests

# sizes around the block (8192), a one-element tensor, an odd-offset view (unaligned)
SHAPES = [(1,), (8191,), (8192,), (8193,), (3, 5000), (20000,)]


def check(dtype, device, seed=0, unaligned=False):
    from moetrain.kernels.sum_of_squares_triton import multi_tensor_sum_of_squares

    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(s, generator=gen).to(dtype=dtype, device=device) for s in SHAPES]
    if unaligned:
        tensors = [t.reshape(-1)[1:] for t in tensors if t.numel() > 1]
    got = multi_tensor_sum_of_squares(tensors)
    exact = sum(t.double().square().sum() for t in tensors)
    assert got.dtype == torch.float32 and got.shape == ()
    torch.testing.assert_close(got.double().cpu(), exact.cpu(), rtol=1e-5, atol=0)


@needs_interpreter
def test_sum_of_squares_under_interpreter():
    run_interpreted_tests(__file__)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unaligned", [False, True])
def test_matches_float64_interpreted(dtype, unaligned):
    check(dtype, "cpu", unaligned=unaligned)


@pytest.mark.gpu
@needs_cuda_and_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unaligned", [False, True])
def test_matches_float64_cuda(dtype, unaligned):
    check(dtype, "cuda", unaligned=unaligned)


@pytest.mark.gpu
@needs_cuda_and_triton
def test_global_grad_norm_on_gpu_matches_torch():
    from moetrain.optim.clip import global_grad_norm

    gen = torch.Generator().manual_seed(1)
    params = [torch.zeros(s, device="cuda", dtype=torch.bfloat16) for s in [(300, 70), (4096,)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to("cuda", torch.bfloat16)
    norm = global_grad_norm([(params[0], "dense"), (params[1], "expert")])
    expected = torch.nn.utils.get_total_norm([p.grad.float() for p in params])
    torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)
