"""FP8 quantizers: the torch references against hand-derived values and error bounds, and the
Triton kernels against the references bit for bit (Triton's CPU interpreter when Triton is
installed but no GPU is present; on CUDA under `pytest -m gpu`)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import (
    TRITON_INSTALLED,
    interpreted,
    needs_cuda_and_triton,
    needs_interpreter,
    run_interpreted_tests,
)

from moetrain.kernels import quant
from moetrain.kernels.quant import (
    dequantize_fp8_rowwise,
    dequantize_mxfp8,
    mx_scale_to_float,
    quantize_fp8_rowwise,
    quantize_mxfp8,
)

NAN, INF = float("nan"), float("inf")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a.cpu()), bits(b.cpu()))


def random_input(shape, dtype=torch.float32, seed=0, device="cpu"):
    """Gaussian rows whose magnitudes span 1e-3 .. 1e3 along the last dim, and a few edge values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[-1])
    return x.to(dtype).to(device)


def with_edge_values(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    edge = [448.0, -448.0, 500.0, INF, -INF, NAN, 0.0, -0.0, 2.0**-9, -(2.0**-10), 3e-3]
    x.view(-1)[: len(edge)] = torch.tensor(edge, dtype=x.dtype)
    return x


# --- row-scaled FP8: reference ----------------------------------------------------------------


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
@pytest.mark.parametrize(
    "shape,dim", [((64, 256), -1), ((96, 80), 0), ((4, 64, 48), -2), ((4, 64, 48), -1)]
)
def test_rowwise_scales_and_errors(shape, dim, scale):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * scale
    q, s = quantize_fp8_rowwise(x, dim)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and q.is_contiguous()
    expected_scale_shape = list(x.shape)
    del expected_scale_shape[dim]
    assert s.dtype == torch.float32 and list(s.shape) == expected_scale_shape
    amax = x.abs().amax(dim)
    torch.testing.assert_close(s, amax / quant.FP8_E4M3_MAX, rtol=1e-7, atol=0)
    # the element at amax lands exactly on +-448
    assert torch.equal(q.float().abs().amax(dim), torch.full_like(s, quant.FP8_E4M3_MAX))
    x_dq = dequantize_fp8_rowwise(q, s, dim)
    rel = (x_dq - x).norm() / x.norm()
    assert 0.01 < rel < 0.04
    # e4m3 rounds to 3 mantissa bits: at most 1/16 relative error in its normal range (>= 2^-6)
    normal = x.abs() >= 2.0**-6 * s.unsqueeze(dim % x.dim())
    elementwise = ((x_dq - x).abs() / x.abs())[normal]
    assert elementwise.max() <= 0.0625 + 1e-6


def test_rowwise_edge_values_by_hand():
    x = torch.tensor(
        [
            # amax 448: scale 1, so representable values come back exactly; ties round to even
            [448.0, -448.0, 224.0, 0.0, -0.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 1.0625, 1.1875],
            # infinities saturate, NaN stays NaN, and amax (2.0) ignores them
            [INF, -INF, 1.0, NAN, 2.0, -2.0, 0.5, 0.0, 0.0, 0.0],
            [0.0] * 10,  # all zero: scale = eps / 448, q = 0
            [NAN, INF, NAN, -INF, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # nothing finite but zeros
        ]
    )
    q, s = quantize_fp8_rowwise(x)
    qf = q.float()
    assert s[0] == 1.0
    expected_row0 = [448.0, -448.0, 224.0, 0.0, -0.0, 2.0**-9, 0.0, 2.0**-8, 1.0, 1.25]
    assert torch.equal(qf[0], torch.tensor(expected_row0))
    assert bits(q)[0, 4] == 0x80  # -0 keeps its sign
    torch.testing.assert_close(s[1], torch.tensor(2.0 / 448.0), rtol=0, atol=0)
    assert qf[1, :3].tolist() == [448.0, -448.0, 224.0]
    assert torch.isnan(qf[1, 3]) and bits(q)[1, 3] == 0x7F
    assert qf[1, 4:7].tolist() == [448.0, -448.0, 112.0]
    for row in (2, 3):
        torch.testing.assert_close(s[row], torch.tensor(quant.AMAX_EPS / 448.0), rtol=1e-7, atol=0)
    assert torch.equal(qf[2], torch.zeros(10))
    assert bits(q)[3, :4].tolist() == [0x7F, 0x7E, 0x7F, 0xFE]  # NaN, 448, NaN, -448


def test_rowwise_bf16_input_same_as_its_fp32_copy():
    x = random_input((32, 128), torch.bfloat16)
    q, s = quantize_fp8_rowwise(x)
    q32, s32 = quantize_fp8_rowwise(x.float())
    assert_same_bits(q, q32)
    assert_same_bits(s, s32)


# --- MXFP8: reference -------------------------------------------------------------------------


def one_block(values, fill=0.0):
    block = torch.full((32,), fill)
    block[: len(values)] = torch.tensor(values)
    return block


def test_mxfp8_worked_examples():
    blocks = torch.stack(
        [
            one_block([1.0, -0.5, 0.25, 2.0**-12, 0.1]),  # amax 1 -> X = 0 - 8 -> byte 119
            one_block([448.0, -3.0, 0.0]),  # amax 448 -> X = 8 - 8 = 0 -> byte 127
            one_block([500.0, 480.0, 460.0, -600.0]),  # amax 600 -> X = 9 - 8 = 1 -> byte 128
            one_block([0.75, 0.375]),  # floor(log2 0.75) = -1 -> X = -9 -> byte 118
            one_block([]),  # all zero -> the smallest scale, byte 0
            one_block([2.0**-130, 2.0**-140]),  # fp32 subnormal amax -> clamped to byte 0
            one_block([2.0**100, 1.0]),  # X = 100 - 8 -> byte 219
            one_block([1.0, NAN]),  # NaN -> NaN scale 0xFF, NaN elements
            one_block([1.0, -INF]),  # inf: the shared exponent overflows -> NaN scale
        ]
    )
    q, s = quantize_mxfp8(blocks.reshape(1, -1))
    assert s.dtype == torch.uint8 and s.shape == (1, 9)
    assert s[0].tolist() == [119, 127, 128, 118, 0, 0, 219, 255, 255]
    qf = q.float().reshape(9, 32)
    # amax 1: elements are x * 2^8, exact where e4m3 can hold them (2^-12 * 256 = 2^-4)
    assert qf[0, :4].tolist() == [256.0, -128.0, 64.0, 2.0**-4]
    assert qf[0, 4] == 26.0  # 25.6 rounds to the e4m3 grid (step 2 in [16, 32))
    assert qf[1, :3].tolist() == [448.0, -3.0, 0.0]
    # x / 2: 250 -> 256, 240 -> 240, 230 -> 224 (ties and steps of 16), -300 -> -288
    assert qf[2, :4].tolist() == [256.0, 240.0, 224.0, -288.0]
    assert qf[3, :2].tolist() == [384.0, 192.0]
    assert torch.equal(qf[4], torch.zeros(32))
    assert qf[6, :2].tolist() == [256.0, 0.0]  # 1.0 / 2^92 underflows to zero
    assert torch.isnan(qf[7]).all() and torch.isnan(qf[8]).all()
    # saturation: amax in [256, 512) * 2^X maps to [256, 512); beyond 448 clamps
    q_sat, s_sat = quantize_mxfp8(one_block([480.0, 460.0, 449.0, -470.0]).reshape(1, 32))
    assert s_sat.item() == 127
    assert q_sat.float()[0, :4].tolist() == [448.0, 448.0, 448.0, -448.0]


def test_mx_scale_to_float():
    s = torch.tensor([0, 1, 119, 127, 128, 254, 255], dtype=torch.uint8)
    f = mx_scale_to_float(s)
    assert f[:-1].tolist() == [2.0**-127, 2.0**-126, 2.0**-8, 1.0, 2.0, 2.0**127]
    assert torch.isnan(f[-1])


@pytest.mark.parametrize("magnitude", [1e-30, 1e-3, 1.0, 1e4, 1e30])
def test_mxfp8_random_blocks(magnitude):
    x = torch.randn(8, 16, 256, generator=torch.Generator().manual_seed(2)) * magnitude
    q, s = quantize_mxfp8(x)
    assert q.shape == x.shape and s.shape == (8, 16, 8)
    scale = mx_scale_to_float(s)
    # power of two, and the block's amax lands in [256, 512) in element units
    assert torch.equal(torch.frexp(scale).mantissa, torch.full_like(scale, 0.5))
    amax_elem = x.reshape(8, 16, 8, 32).abs().amax(-1) / scale
    assert ((amax_elem >= 256) & (amax_elem < 512)).all()
    x_dq = dequantize_mxfp8(q, s)
    rel = (x_dq.double() - x.double()).norm() / x.double().norm()
    assert 0.01 < rel < 0.05


def test_mxfp8_needs_whole_blocks():
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        quantize_mxfp8(torch.randn(4, 48))


# --- Triton kernels == reference, bit for bit --------------------------------------------------

TRITON_CASES = [
    # (shape, dim, dtype): last dim, long rows (two passes), per-column (dim 0), 3-D weights
    ((64, 256), -1, torch.bfloat16),
    ((37, 100), -1, torch.float32),
    ((3, 9000), -1, torch.float32),
    ((96, 80), 0, torch.bfloat16),
    ((3, 64, 48), -2, torch.float32),
    ((3, 64, 48), -1, torch.bfloat16),
    ((7, 33, 5), 1, torch.float32),  # odd sizes, a middle dim
    ((300,), 0, torch.bfloat16),  # 1-D: a single scale
]


@needs_interpreter
def test_triton_kernels_under_interpreter():
    """Runs this file's `interpreted` tests in a fresh process with TRITON_INTERPRET=1."""
    run_interpreted_tests(__file__, timeout=120)


@pytest.fixture
def interpreter():
    from moetrain.kernels import quant_triton

    return quant_triton


@interpreted
@pytest.mark.parametrize("shape,dim,dtype", TRITON_CASES)
def test_triton_rowwise_matches_reference_interpreted(interpreter, shape, dim, dtype):
    x = with_edge_values(random_input(shape, dtype, seed=3))
    q_ref, s_ref = quantize_fp8_rowwise(x, dim)
    q, s = interpreter.quantize_fp8_rowwise_triton(x, dim)
    assert_same_bits(q, q_ref)
    assert_same_bits(s, s_ref)


@interpreted
@pytest.mark.parametrize(
    "shape,dtype",
    [((3, 64, 48), torch.bfloat16), ((70, 33), torch.float32), ((2, 5, 130), torch.float32)],
)
def test_triton_transposed_matches_reference_interpreted(interpreter, shape, dtype):
    """q written in x.mT's layout equals the reference run on the transposed copy."""
    x = with_edge_values(random_input(shape, dtype, seed=7))
    q_ref, s_ref = quantize_fp8_rowwise(x.mT, -1)
    q, s = interpreter.quantize_fp8_rowwise_triton(x, -2, transposed=True)
    assert q.is_contiguous() and q.shape == x.mT.shape
    assert_same_bits(q, q_ref)
    assert_same_bits(s, s_ref)


@interpreted
@pytest.mark.parametrize(
    "one_pass,tile", [(False, None), (True, (32, 16, 4)), (True, (4096, 16, 4))]
)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", [(3, 64, 48), (2, 130, 70), (70, 33)])
def test_triton_column_kernels_match_reference_interpreted(
    interpreter, monkeypatch, shape, transposed, one_pass, tile
):
    """Per-column scales by either kernel choice (one pass a column block, or split amax + cast),
    q in x's layout or transposed. The one-pass kernel steps down the columns in several tiles
    (32 x 16), or holds a whole column block at once (a tile taller than M)."""
    monkeypatch.setattr(interpreter, "COLUMN_PROGRAMS_MIN", 0 if one_pass else 10**9)
    monkeypatch.setattr(interpreter, "COLUMN_TILE", tile or (32, 16, 4))
    x = with_edge_values(random_input(shape, torch.bfloat16, seed=9))
    want = quantize_fp8_rowwise(x.mT, -1) if transposed else quantize_fp8_rowwise(x, -2)
    got = interpreter.quantize_fp8_rowwise_triton(x, -2, transposed=transposed)
    for a, b in zip(got, want, strict=True):
        assert_same_bits(a, b)


@interpreted
def test_triton_e4m3_rounding_every_tie_interpreted(interpreter):
    """Every e4m3 value, every midpoint between neighbours (ties), and one fp32 ulp either side,
    in rows whose amax is 448 so that the scale is exactly 1 and q is the plain conversion."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = codes[torch.isfinite(codes)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat(
        [grid, mids, torch.nextafter(mids, grid[1:]), torch.nextafter(mids, grid[:-1])]
    )
    vals = torch.cat([vals, torch.zeros(-vals.numel() % 255)]).reshape(-1, 255)
    x = torch.cat([vals, torch.full((vals.shape[0], 1), 448.0)], dim=1)
    q_ref, s_ref = quantize_fp8_rowwise(x)
    assert torch.equal(s_ref, torch.ones_like(s_ref))
    assert_same_bits(interpreter.quantize_fp8_rowwise_triton(x)[0], q_ref)


def test_triton_module_imports_without_triton():
    from moetrain.kernels import quant_triton

    assert quant_triton.triton_available() == TRITON_INSTALLED


# --- GPU: the compiled kernels ----------------------------------------------------------------

gpu = needs_cuda_and_triton
GPU_CASES = [
    ((4096, 2048), -1, torch.bfloat16),
    ((1000, 1000), -1, torch.float32),
    ((64, 20000), -1, torch.bfloat16),  # two-pass rows
    ((8192, 512), 0, torch.bfloat16),  # per-column scales, reduction over rows
    ((8, 1024, 512), -2, torch.bfloat16),  # expert weights (e, K, N), per-column along K
    ((8, 1024, 512), -1, torch.bfloat16),
    ((7, 33, 5), 1, torch.float32),  # odd sizes, a middle dim
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("software_cast", [False, True])
@pytest.mark.parametrize("shape,dim,dtype", GPU_CASES)
def test_triton_rowwise_matches_reference_cuda(shape, dim, dtype, software_cast):
    from moetrain.kernels.quant_triton import quantize_fp8_rowwise_triton

    x = with_edge_values(random_input(shape, dtype, seed=5, device="cuda"))
    q_ref, s_ref = quantize_fp8_rowwise(x, dim)
    q_cpu, s_cpu = quantize_fp8_rowwise(x.cpu(), dim)
    assert_same_bits(q_ref, q_cpu)  # the reference itself agrees across devices
    assert_same_bits(s_ref, s_cpu)
    q, s = quantize_fp8_rowwise_triton(x, dim, software_cast=software_cast)
    assert_same_bits(q, q_ref)
    assert_same_bits(s, s_ref)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("software_cast", [False, True])
@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((64, 1024, 1024), torch.bfloat16),
        ((8, 512, 1000), torch.bfloat16),
        ((300, 70), torch.float32),
    ],
)
@pytest.mark.parametrize(
    "one_pass,tile", [(False, None), (True, None), (True, (4096, 16, 8))], ids=str
)
def test_triton_transposed_matches_reference_cuda(
    monkeypatch, shape, dtype, software_cast, one_pass, tile
):
    """Split kernels, the one-pass kernel at its tile, and the one-pass kernel holding whole
    column blocks in registers."""
    from moetrain.kernels import quant_triton

    monkeypatch.setattr(quant_triton, "COLUMN_PROGRAMS_MIN", 0 if one_pass else 10**9)
    if tile is not None:
        monkeypatch.setattr(quant_triton, "COLUMN_TILE", tile)
    x = with_edge_values(random_input(shape, dtype, seed=8, device="cuda"))
    q_ref, s_ref = quantize_fp8_rowwise(x.mT, -1)
    q, s = quant_triton.quantize_fp8_rowwise_triton(
        x, -2, transposed=True, software_cast=software_cast
    )
    assert q.is_contiguous() and q.shape == x.mT.shape
    assert_same_bits(q, q_ref)
    assert_same_bits(s, s_ref)
    q, s = quant_triton.quantize_fp8_rowwise_triton(x, -2, software_cast=software_cast)
    assert_same_bits(q, quantize_fp8_rowwise(x, -2)[0])


@pytest.mark.gpu
@gpu
def test_triton_e4m3_rounding_every_tie_cuda():
    from moetrain.kernels.quant_triton import quantize_fp8_rowwise_triton

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = codes[torch.isfinite(codes)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat(
        [grid, mids, torch.nextafter(mids, grid[1:]), torch.nextafter(mids, grid[:-1])]
    )
    vals = torch.cat([vals, torch.zeros(-vals.numel() % 255)]).reshape(-1, 255)
    x = torch.cat([vals, torch.full((vals.shape[0], 1), 448.0)], dim=1).cuda()
    q_ref = quantize_fp8_rowwise(x)[0]
    for software_cast in (False, True):
        assert_same_bits(quantize_fp8_rowwise_triton(x, software_cast=software_cast)[0], q_ref)


def test_constants_are_consistent():
    assert quant.FP8_E4M3_MAX == torch.finfo(torch.float8_e4m3fn).max
    assert quant.E4M3_EMAX == math.floor(math.log2(quant.FP8_E4M3_MAX))
