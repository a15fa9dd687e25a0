"""Grouped-GEMM backends against the fp32 loop over experts: forward and both gradients, with an
expert that gets no rows and padding rows past the last offset (the CPU runs the emulations;
the FP8 tensor-core path runs under `pytest -m gpu` on compute capability 9.x / 10.x)."""

from __future__ import annotations

import pytest
import torch

from moetrain.kernels import quant
from moetrain.moe.experts import BF16GroupedGemm, grouped_mm_reference
from moetrain.moe.grouped_gemm import FP8RowwiseEmulatedGroupedGemm
from moetrain.moe.mxfp8 import MXFP8EmulatedGroupedGemm
from moetrain.nn.fp8 import fp8_unsupported_reason
from moetrain.parallel.precision import make_grouped_gemm


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def problem(counts, num_rows, d, f, *, dtype=torch.float32, device="cpu", seed=0):
    """Rows grouped by expert (the first sum(counts) rows) plus padding rows, and a loss weight."""
    gen = torch.Generator().manual_seed(seed)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(num_rows, d, generator=gen)
    w = torch.randn(len(counts), d, f, generator=gen) / d**0.5
    g = torch.randn(int(offs[-1]), f, generator=gen)
    to = dict(dtype=dtype, device=device)
    return x.to(**to), w.to(**to), offs.to(device), g.to(**to)


def run(gemm, x, w, offs, g):
    """Output rows within groups, and the gradients of sum(y * g) over them."""
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    n = g.shape[0]
    y = gemm(x, w, offs)
    (y[:n].float() * g.float()).sum().backward()
    return y[:n].detach().float(), x.grad[:n].float(), w.grad.float()


COUNTS = [100, 0, 250, 40, 170, 90]  # expert 1 gets no rows
NUM_ROWS, D, F = 700, 128, 96  # 50 padding rows past the last offset


def test_reference_loop_matches_torch_grouped_mm():
    x, w, offs, g = problem(COUNTS, NUM_ROWS, D, F)
    n = g.shape[0]
    y = torch._grouped_mm(x, w, offs=offs)
    y_ref = grouped_mm_reference(x, w, offs)
    torch.testing.assert_close(y[:n], y_ref[:n], rtol=1e-5, atol=1e-5)
    assert torch.equal(y_ref[n:], torch.zeros_like(y_ref[n:]))
    for got, want in zip(
        run(BF16GroupedGemm(), x, w, offs, g), run(grouped_mm_reference, x, w, offs, g), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "mxfp8"])
def test_emulated_low_precision_close_to_fp32(recipe):
    x, w, offs, g = problem(COUNTS, NUM_ROWS, D, F, seed=1)
    gemm = make_grouped_gemm(recipe, "cpu")
    assert gemm.emulated and "emulation" in gemm.name
    y, gx, gw = run(gemm, x, w, offs, g)
    y_ref, gx_ref, gw_ref = run(grouped_mm_reference, x, w, offs, g)
    for got, want in ((y, y_ref), (gx, gx_ref), (gw, gw_ref)):
        assert rel(got, want) < 5e-2
    assert torch.equal(gw[1], torch.zeros_like(gw[1]))  # the expert without rows
    if recipe == "fp8_rowwise":  # the weight gradient is computed in high precision on purpose
        torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-5)
    else:
        assert rel(gw, gw_ref) > 1e-3  # MXFP8 quantizes it too


def test_fp8_emulation_is_the_dequantized_product():
    """Scales wired to the right dims: per row of x along D, per output column of w along D."""
    x, w, offs, _ = problem(COUNTS, NUM_ROWS, D, F, seed=2)
    n = int(offs[-1])
    y = FP8RowwiseEmulatedGroupedGemm()(x, w, offs)
    x_dq = quant.dequantize_fp8_rowwise(*quant.quantize_fp8_rowwise(x, dim=-1), dim=-1)
    w_dq = quant.dequantize_fp8_rowwise(*quant.quantize_fp8_rowwise(w, dim=1), dim=1)
    torch.testing.assert_close(
        y[:n], grouped_mm_reference(x_dq, w_dq, offs)[:n], rtol=1e-5, atol=1e-5
    )


def test_mxfp8_emulation_is_the_dequantized_product():
    x, w, offs, _ = problem(COUNTS, NUM_ROWS, D, F, seed=3)
    n = int(offs[-1])
    y = MXFP8EmulatedGroupedGemm()(x, w, offs)
    x_dq = quant.dequantize_mxfp8(*quant.quantize_mxfp8(x))
    w_dq = quant.dequantize_mxfp8(*quant.quantize_mxfp8(w.mT)).mT  # blocks along D
    torch.testing.assert_close(
        y[:n], grouped_mm_reference(x_dq, w_dq, offs)[:n], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "mxfp8"])
def test_padding_rows_do_not_leak(recipe):
    """Padding rows may hold garbage (even NaN): rows within groups and all gradients stay finite
    and unchanged."""
    x, w, offs, g = problem(COUNTS, NUM_ROWS, D, F, seed=4)
    n = g.shape[0]
    gemm = make_grouped_gemm(recipe, "cpu")
    clean = run(gemm, x, w, offs, g)
    x_garbage = x.clone()
    x_garbage[n:] = float("nan")
    x_garbage[n + 1 :] = 1e30
    dirty = run(gemm, x_garbage, w, offs, g)
    for a, b in zip(clean, dirty, strict=True):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_weights_are_quantized_at_every_call():
    """No cache: a write that autograd's version counter does not see (a Triton kernel's raw
    pointers, a collective into a bucket that `.data` views) shows in the very next product."""
    x, w, offs, _ = problem(COUNTS, NUM_ROWS, D, F, seed=5)
    n = int(offs[-1])
    gemm = FP8RowwiseEmulatedGroupedGemm()
    y1 = gemm(x, w, offs)
    version = w._version
    w.data.mul_(2.0)  # through .data: the version counter stays
    assert w._version == version
    y2 = gemm(x, w, offs)
    torch.testing.assert_close(y2[:n], 2 * y1[:n])  # power-of-two change: same fp8 codes


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown recipe"):
        make_grouped_gemm("fp4", "cpu")
    with pytest.raises(ValueError, match="fp8_rowwise is unavailable: device meta is not a CUDA"):
        make_grouped_gemm("fp8_rowwise", "meta")  # neither the CPU's emulation nor FP8 kernels
    x, w, offs, _ = problem([3, 5], 8, 64, 32)
    for gemm in (BF16GroupedGemm(), FP8RowwiseEmulatedGroupedGemm(), MXFP8EmulatedGroupedGemm()):
        with pytest.raises(ValueError, match="int32"):
            gemm(x, w, offs.long())
        with pytest.raises(ValueError, match=r"expected x \(N, D\)"):
            gemm(x[:, :32], w, offs)
    with pytest.raises(ValueError, match="multiples of 32"):
        MXFP8EmulatedGroupedGemm()(x[:, :48], w[:, :48], offs)
    assert fp8_unsupported_reason(torch.device("cpu")) is not None


def test_float64_inputs_use_the_loop():
    x, w, offs, g = problem([5, 0, 7], 16, 64, 32, dtype=torch.float64, seed=6)
    for gemm in (BF16GroupedGemm(), FP8RowwiseEmulatedGroupedGemm(), MXFP8EmulatedGroupedGemm()):
        y, gx, gw = run(gemm, x, w, offs, g)
        y_ref, gx_ref, gw_ref = run(grouped_mm_reference, x, w, offs, g)
        assert rel(y, y_ref) < 5e-2 and rel(gx, gx_ref) < 5e-2 and rel(gw, gw_ref) < 5e-2


# --- GPU ---------------------------------------------------------------------------------------

HAS_FP8_GPU = torch.cuda.is_available() and fp8_unsupported_reason(torch.device("cuda")) is None
GPU_COUNTS = [1500, 0, 2500, 700, 1300, 17, 1000, 976]  # 8 uneven groups, one empty: 7993 rows
GPU_ROWS, GPU_D, GPU_F = 8192, 1024, 512


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU of compute capability 9.x or 10.x")
def test_fp8_rowwise_cuda_close_to_bf16():
    x, w, offs, g = problem(
        GPU_COUNTS, GPU_ROWS, GPU_D, GPU_F, dtype=torch.bfloat16, device="cuda", seed=7
    )
    gemm = make_grouped_gemm("fp8_rowwise", "cuda")
    assert not gemm.emulated and gemm.name == "fp8_rowwise"
    got = run(gemm, x, w, offs, g)
    bf16 = run(BF16GroupedGemm(), x, w, offs, g)
    for a, b in zip(got, bf16, strict=True):
        assert rel(a, b) < 5e-2
    empty = got[2][1]
    assert torch.equal(empty, torch.zeros_like(empty)), "empty expert's weight gradient not zero"
    # the hardware path and its emulation differ only in accumulation order and bf16 rounding
    emulated = run(FP8RowwiseEmulatedGroupedGemm(), x, w, offs, g)
    for a, b in zip(got, emulated, strict=True):
        assert rel(a, b) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU of compute capability 9.x or 10.x")
def test_fp8_rowwise_cuda_has_no_host_sync():
    x, w, offs, g = problem(
        GPU_COUNTS, GPU_ROWS, GPU_D, GPU_F, dtype=torch.bfloat16, device="cuda", seed=8
    )
    gemm = make_grouped_gemm("fp8_rowwise", "cuda")
    run(gemm, x, w, offs, g)  # warm-up: Triton compiles
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = gemm(x, w, offs)
        y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.grad is not None and w.grad is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mxfp8_emulation_cuda_matches_cpu():
    x, w, offs, g = problem(GPU_COUNTS, GPU_ROWS, 256, 128, seed=9)
    cpu = run(MXFP8EmulatedGroupedGemm(), x, w, offs, g)
    cuda = run(MXFP8EmulatedGroupedGemm(), x.cuda(), w.cuda(), offs.cuda(), g.cuda())
    for a, b in zip(cuda, cpu, strict=True):
        assert rel(a.cpu(), b) < 1e-4  # same quantized operands, fp32 math on either device


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FP8_GPU, reason="needs a CUDA GPU of compute capability 9.x or 10.x")
def test_fp8_rowwise_cuda_compiled_matches_eager():
    """What a compiled block runs: the FP8 grouped product traced whole (Inductor's fused
    quantizations, no graph break) against eager (Triton quantizers): output and both gradients."""
    x, w, offs, g = problem(
        GPU_COUNTS, GPU_ROWS, GPU_D, GPU_F, dtype=torch.bfloat16, device="cuda", seed=10
    )
    gemm = make_grouped_gemm("fp8_rowwise", "cuda")
    compiled = torch.compile(lambda a, b, o: gemm(a, b, o), fullgraph=True)
    for got, want in zip(run(compiled, x, w, offs, g), run(gemm, x, w, offs, g), strict=True):
        assert rel(got, want) < 1e-2
