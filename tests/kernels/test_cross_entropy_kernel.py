"""The Triton cross-entropy chunk (loss and softmax-minus-onehot gradient) against the torch chunk
function it replaces on CUDA (`moetrain.nn.loss._chunk_loss_and_grad`), on CUDA and, on CPU,
through Triton's interpreter."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import interpreted, needs_cuda_and_triton, needs_interpreter, run_interpreted_tests

from moetrain.nn.loss import _chunk_loss_and_grad

# (rows, vocabulary): one block, several blocks with a ragged last one, a 50k vocabulary
SHAPES = [(5, 7), (9, 4096 * 2 + 3), (3, 50304)]


def check_against_torch_chunk(rows, vocab, dtype, device, seed=0):
    from moetrain.kernels.cross_entropy_triton import chunk_loss_and_grad_triton

    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype=dtype, device=device)
    targets = torch.randint(0, vocab, (rows,), generator=gen).to(device)
    targets[0] = logits[0].float().argmax()  # a target at the row's maximum
    scale = 1.0 / (3 * rows)
    loss, grad = chunk_loss_and_grad_triton(logits, targets, scale)
    ref_loss, ref_grad = _chunk_loss_and_grad(logits, targets, scale)
    assert loss.dtype == torch.float32 and grad.dtype == dtype and grad.shape == logits.shape
    torch.testing.assert_close(loss, ref_loss.float(), rtol=1e-5, atol=1e-5)
    # fp32 math on both sides; the gradient differs by at most one rounding of the output dtype
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=ulp, atol=scale * 1e-6)
    assert math.isclose(float(grad.float().sum()), 0.0, abs_tol=rows * scale * 1e-2)


def check_bad_target_gives_nan_loss(device):
    from moetrain.kernels.cross_entropy_triton import chunk_loss_and_grad_triton

    logits = torch.randn(2, 100, device=device)
    loss, _ = chunk_loss_and_grad_triton(logits, torch.tensor([3, 100], device=device), 1.0)
    assert torch.isnan(loss)


@needs_interpreter
def test_cross_entropy_triton_under_interpreter():
    """Runs this file's `interpreted` tests in a fresh process with TRITON_INTERPRET=1."""
    run_interpreted_tests(__file__)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), SHAPES)
def test_chunk_matches_torch_interpreted(rows, vocab, dtype):
    check_against_torch_chunk(rows, vocab, dtype, "cpu")


@interpreted
def test_bad_target_interpreted():
    check_bad_target_gives_nan_loss("cpu")


@pytest.mark.gpu
@needs_cuda_and_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), [*SHAPES, (4096, 50304)])
def test_chunk_matches_torch_cuda(rows, vocab, dtype):
    check_against_torch_chunk(rows, vocab, dtype, "cuda")


@pytest.mark.gpu
@needs_cuda_and_triton
def test_bad_target_cuda():
    check_bad_target_gives_nan_loss("cuda")
