"""Per-group column quantization and the padded transposed layout of the FP8 weight gradient:
the torch references against row-wise quantization of each group's block, and the Triton
kernels against the references bit for bit (the interpreter without a GPU; CUDA under
`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch
from conftest import interpreted, needs_cuda_and_triton, needs_interpreter, run_interpreted_tests

from moetrain.kernels import quant

INF, NAN = float("inf"), float("nan")


def grouped_rows(counts, padding, cols, *, dtype=torch.bfloat16, seed=0, device="cpu"):
    """Rows grouped by `counts` (cumulative end offsets, int32), `padding` garbage rows past the
    last group, magnitudes spanning 1e-3 .. 1e3 down the rows, a few edge values, and row scales."""
    gen = torch.Generator().manual_seed(seed)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    n = int(offs[-1]) + padding
    x = torch.randn(n, cols, generator=gen) * torch.logspace(-3, 3, n)[:, None]
    x[n - padding :] = 1e30
    edge = [448.0, -500.0, INF, -INF, NAN, 0.0, -0.0, 2.0**-9]
    x[1, : len(edge)] = torch.tensor(edge)
    row_scale = torch.rand(n, generator=gen) * 4
    return x.to(dtype).to(device), offs.to(device), row_scale.to(device)


def layout(offs, n, e):
    return quant.padded_group_offsets(offs), quant.padded_group_width(n, e)


def assert_same_bytes(a, b, end):
    """Equal up to column `end` (the kernels leave the columns past the last group unwritten)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a.view(torch.uint8)[:, :end].cpu(), b.view(torch.uint8)[:, :end].cpu())


COUNTS = [37, 0, 100, 5, 64, 1, 16]  # an empty group, one of a single row, one already aligned


def test_padded_offsets_are_non_empty_multiples_of_16_within_the_bound():
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        counts = torch.randint(0, 50, (9,), generator=gen) * torch.randint(
            0, 2, (9,), generator=gen
        )
        offs = counts.cumsum(0).to(torch.int32)
        pad = quant.padded_group_offsets(offs)
        sizes = torch.diff(pad, prepend=pad.new_zeros(1))
        assert pad.dtype == torch.int32
        assert (sizes % 16 == 0).all() and (sizes >= 16).all() and (sizes >= counts).all()
        assert ((sizes - counts < 16) | (counts == 0)).all()
        assert int(pad[-1]) <= quant.padded_group_width(int(offs[-1]) + 3, 9)
    assert quant.padded_group_width(100, 4) % 16 == 0


@pytest.mark.parametrize("with_row_scale", [False, True])
def test_group_columns_are_each_groups_block_quantized_per_column(with_row_scale):
    """Group g's columns of q are `quantize_fp8_rowwise` of its (x * row_scale) block, transposed;
    the padding is zero; rows past the last group are left out."""
    x, offs, row_scale = grouped_rows(COUNTS, 9, 40, dtype=torch.float32)
    pad, width = layout(offs, x.shape[0], len(COUNTS))
    q, scale = quant.quantize_group_columns(
        x, offs, pad, width, row_scale if with_row_scale else None
    )
    assert q.shape == (40, width) and q.dtype == torch.float8_e4m3fn and scale.shape == (7, 40)
    start = pad_start = 0
    for g, (end, pad_end) in enumerate(zip(offs.tolist(), pad.tolist(), strict=True)):
        count = end - start
        if count:
            block = x[start:end] * (row_scale[start:end, None] if with_row_scale else 1)
            q_ref, s_ref = quant.quantize_fp8_rowwise(block.T)
            got = q.view(torch.uint8)[:, pad_start : pad_start + count]
            assert torch.equal(got, q_ref.view(torch.uint8))
            assert torch.equal(scale[g], s_ref)
        assert not q.view(torch.uint8)[:, pad_start + count : pad_end].any()
        start, pad_start = end, pad_end
    assert not q.view(torch.uint8)[:, pad_start:].any()


def test_transposed_group_rows_move_bytes_into_the_padded_layout():
    x, offs, _ = grouped_rows(COUNTS, 5, 24)
    q = quant.quantize_fp8_rowwise(x)[0]
    pad, width = layout(offs, x.shape[0], len(COUNTS))
    out = quant.transpose_group_rows(q, offs, pad, width)
    assert out.dtype == q.dtype and out.shape == (24, width)
    start = pad_start = 0
    for end, pad_end in zip(offs.tolist(), pad.tolist(), strict=True):
        got = out.view(torch.uint8)[:, pad_start:pad_end]
        assert torch.equal(got[:, : end - start], q.view(torch.uint8)[start:end].T)
        assert not got[:, end - start :].any()
        start, pad_start = end, pad_end


# --- Triton ------------------------------------------------------------------------------------


@needs_interpreter
def test_triton_kernels_under_interpreter():
    """Runs this file's `interpreted` tests in a fresh process with TRITON_INTERPRET=1."""
    run_interpreted_tests(__file__, timeout=120)


def check_kernels(kernels, x, offs, row_scale, **kw):
    pad, width = layout(offs, x.shape[0], offs.numel())
    end = int(pad[-1])
    for rs in (None, row_scale):
        q_ref, s_ref = quant.quantize_group_columns(x, offs, pad, width, rs)
        q, s = kernels.quantize_group_columns_triton(x, offs, pad, width, rs, **kw)
        assert_same_bytes(q, q_ref, end)
        assert torch.equal(s.cpu().view(torch.int32), s_ref.cpu().view(torch.int32))
    rows = quant.quantize_fp8_rowwise(x)[0]
    assert_same_bytes(
        kernels.transpose_group_rows_triton(rows, offs, pad, width),
        quant.transpose_group_rows(rows, offs, pad, width),
        end,
    )


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile", [(16, 16, 4), (64, 64, 4)])
def test_triton_group_kernels_match_reference_interpreted(monkeypatch, dtype, tile):
    """Several row steps a group (16-row tiles) and one (64), odd column counts, empty groups."""
    from moetrain.kernels import quant_groups_triton

    monkeypatch.setattr(quant_groups_triton, "QUANT_TILE", tile)
    monkeypatch.setattr(quant_groups_triton, "BYTES_TILE", tile)
    x, offs, row_scale = grouped_rows(COUNTS, 7, 40, dtype=dtype, seed=2)
    check_kernels(quant_groups_triton, x, offs, row_scale)


@pytest.mark.gpu
@needs_cuda_and_triton
@pytest.mark.parametrize("software_cast", [False, True])
@pytest.mark.parametrize("cols", [2048, 1000])
def test_triton_group_kernels_match_reference_cuda(software_cast, cols):
    """Uneven groups of an olmoe8-sized layer's rows (one empty, one tiny) on the GPU."""
    from moetrain.kernels import quant_groups_triton

    counts = [1500, 0, 2500, 700, 1300, 17, 1000, 976]
    x, offs, row_scale = grouped_rows(counts, 200, cols, seed=3, device="cuda")
    check_kernels(quant_groups_triton, x, offs, row_scale, software_cast=software_cast)
