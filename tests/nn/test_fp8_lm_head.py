"""The LM head's FP8 products (`precision.lm_head=fp8_rowwise`, moetrain.nn.loss): the emulation
against the dequantized products it stands for and against fp32; on the H200 the tensor cores
against the emulation, with no host sync."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetrain.kernels import quant
from moetrain.nn.fp8 import fp8_unsupported_reason
from moetrain.nn.loss import FP8HeadProducts, chunked_linear_cross_entropy

HAS_FP8_GPU = torch.cuda.is_available() and fp8_unsupported_reason(torch.device("cuda")) is None
EMULATED = FP8HeadProducts(emulate=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def dq(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The fp32 value the FP8 kernels see for x scaled along `dim`."""
    return quant.dequantize_fp8_rowwise(*quant.quantize_fp8_rowwise(x, dim=dim), dim=dim)


def problem(tokens, d, vocab, *, seed, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, d, generator=gen)
    w = torch.randn(vocab, d, generator=gen) / d**0.25  # logits of a few units: a peaked softmax
    t = torch.randint(0, vocab, (tokens,), generator=gen)
    return h.to(dtype=dtype, device=device), w.to(dtype=dtype, device=device), t.to(device)


def run(h, w, t, **kw):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = chunked_linear_cross_entropy(h, w, t, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def test_emulated_fp8_head_is_the_dequantized_products():
    """Per chunk: logits from h and w quantized along D; the input gradient from the logits'
    gradient quantized along V and w along V (per column); the weight gradient from the
    unquantized h and the logits' gradient. Four chunks, the last one short."""
    h, w, t = problem(200, 64, 208, seed=0)
    loss, gh, gw = run(h, w, t, chunk_size=64, products=EMULATED)
    logits = (dq(h) @ dq(w).T).requires_grad_()
    want_loss = F.cross_entropy(logits, t)
    (g_logits,) = torch.autograd.grad(want_loss, logits)
    want_gh = torch.cat([dq(g) @ dq(w, dim=0) for g in g_logits.split(64)])
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh, want_gh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, g_logits.T @ h, rtol=1e-5, atol=1e-7)


def test_emulated_fp8_head_is_close_to_fp32():
    h, w, t = problem(256, 128, 512, seed=1)
    got = run(h, w, t, chunk_size=100, products=EMULATED)
    want = run(h, w, t, chunk_size=100)
    assert 1e-5 < abs(got[0] - want[0]) / want[0] < 1e-2  # the loss
    for a, b in zip(got[1:], want[1:], strict=True):
        assert 1e-4 < rel(a, b) < 6e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU of compute capability 9.x or 10.x")
@pytest.mark.parametrize("fast_accum", [True, False])
def test_fp8_head_on_tensor_cores_matches_its_emulation_without_host_sync(fast_accum):
    """bf16 at a real vocabulary (50304): torch._scaled_mm and the Triton quantizers against
    the emulation on the same operands, and close to the bf16 head; no host sync."""
    h, w, t = problem(8192, 1024, 50304, seed=3, dtype=torch.bfloat16, device="cuda")
    run(
        h, w, t, products=FP8HeadProducts(emulate=False, fast_accum=fast_accum)
    )  # warm-up: Triton compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = run(h, w, t, products=FP8HeadProducts(emulate=False, fast_accum=fast_accum))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    emulated = run(h, w, t, products=EMULATED)
    bf16 = run(h, w, t)
    assert abs(got[0] - emulated[0]) / emulated[0] < 1e-3
    assert abs(got[0] - bf16[0]) / bf16[0] < 1e-2
    for a, b, c in zip(got[1:], emulated[1:], bf16[1:], strict=True):
        assert torch.isfinite(a).all()
        assert rel(a, b) < 2e-2  # accumulation order, the bf16 roundings of logits and gradient
        assert rel(a, c) < 8e-2
