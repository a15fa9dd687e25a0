"""FP8 row-scaled linears (moetrain.nn.fp8) against the dequantized products they stand for, and
against fp32; compiled against eager. The CPU runs the emulation (same quantized operands, fp32
math); the FP8 tensor-core path, compiled, is checked against it under `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from moetrain.kernels import quant
from moetrain.nn.fp8 import check_fp8_widths, fp8_linear, fp8_unsupported_reason


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def dq(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The fp32 value the FP8 kernels see for x scaled along `dim`."""
    return quant.dequantize_fp8_rowwise(*quant.quantize_fp8_rowwise(x, dim=dim), dim=dim)


def problem(tokens: int, k: int, outs: list[int], *, seed: int, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens // 2, k, generator=gen)
    ws = [torch.randn(n, k, generator=gen) / k**0.5 for n in outs]
    g = torch.randn(2, tokens // 2, sum(outs), generator=gen)
    to = dict(dtype=dtype, device=device)
    return x.to(**to), [w.to(**to) for w in ws], g.to(**to)


def run(fn, x, ws, g):
    x = x.detach().clone().requires_grad_()
    ws = [w.detach().clone().requires_grad_() for w in ws]
    y = fn(x, ws)
    (y.float() * g.float()).sum().backward()
    return y.detach().float(), x.grad.float(), *(w.grad.float() for w in ws)


def reference(x, ws):
    return x @ torch.cat(ws).T


@pytest.mark.parametrize("tokens", [96, 90])
def test_emulated_fp8_linear_is_the_dequantized_products(tokens):
    """Forward and input gradient each equal the fp32 product of the operands quantized along
    that product's reduction dim; the weight gradient is the unquantized product."""
    x, ws, g = problem(tokens, 64, [48, 16, 32], seed=0)
    y, gx, *gws = run(lambda a, b: fp8_linear(a, b, emulate=True), x, ws, g)
    w = torch.cat(ws)
    x2, g2 = x.reshape(-1, 64), g.reshape(-1, w.shape[0])
    torch.testing.assert_close(y, (dq(x2) @ dq(w).T).view_as(y), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, (dq(g2) @ dq(w, dim=0)).view_as(gx), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(gws), g2.T @ x2, rtol=1e-5, atol=1e-5)


def test_emulated_fp8_linear_is_close_to_fp32_and_splits_gradients_per_weight():
    x, ws, g = problem(128, 96, [64, 32], seed=1)
    got = run(lambda a, b: fp8_linear(a, b, emulate=True), x, ws, g)
    want = run(reference, x, ws, g)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape
        if i < 2:  # output and input gradient: FP8 rounding is there, and small
            assert 1e-4 < rel(a, b) < 5e-2
        else:  # the weight gradients: fp32 here, exact up to summation order
            assert rel(a, b) < 1e-5


def test_fp8_linear_compiles_without_graph_breaks_and_matches_eager():
    x, ws, g = problem(64, 32, [32, 16], seed=2)
    compiled = torch.compile(lambda a, b: fp8_linear(a, b, emulate=True), fullgraph=True)
    got = run(compiled, x, ws, g)
    want = run(lambda a, b: fp8_linear(a, b, emulate=True), x, ws, g)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_widths_and_devices_are_checked():
    check_fp8_widths("x", a=16, b=2048)
    with pytest.raises(ValueError, match="b=24"):
        check_fp8_widths("x", a=16, b=24)
    assert "not a CUDA GPU" in fp8_unsupported_reason(torch.device("cpu"))


# --- GPU ---------------------------------------------------------------------------------------

HAS_FP8_GPU = torch.cuda.is_available() and fp8_unsupported_reason(torch.device("cuda")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU of compute capability 9.x or 10.x")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp8_linear_on_tensor_cores_matches_its_emulation(compiled):
    """torch._scaled_mm on the H200, eager (Triton quantizers) and compiled (Inductor's fused
    quantization), against the emulation on the same bf16 operands; and close to bf16."""
    x, ws, g = problem(4096, 1024, [1024, 256, 256], seed=3, dtype=torch.bfloat16, device="cuda")
    fn = lambda a, b: fp8_linear(a, b, emulate=False)  # noqa: E731
    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    got = run(fn, x, ws, g)
    emulated = run(lambda a, b: fp8_linear(a, b, emulate=True), x, ws, g)
    bf16 = run(reference, x, ws, g)
    for a, b, c in zip(got, emulated, bf16, strict=True):
        assert rel(a, b) < 1e-2  # accumulation order and the bf16 output rounding
        assert rel(a, c) < 6e-2
