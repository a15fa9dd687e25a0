"""Triton twins of `quant.quantize_group_columns` and `quant.transpose_group_rows`, bit for bit:
a row-grouped (N, C) tensor laid out transposed and padded, (C, P), for the FP8 weight gradient.

One program per (column block, group) steps down the group's rows, whose bounds it reads from
the offsets on the device (no host sync; the step can be CUDA-graphed). The quantization makes
two passes over the group's block (amax, then scale, cast and the transposed store: the second
read mostly from L2); the byte transpose one. Padding columns are written as zeros; columns past
offs_pad[-1] are not written. Rounding as in `quant_triton` (one multiply an element for the row
scale, one for the column's inverse scale, IEEE divisions, round-to-nearest-even e4m3).
"""

from __future__ import annotations

import torch

from moetrain.kernels.quant_triton import (
    _check_device,
    _default_software_cast,
    _finite_abs,
    _q_arg,
    _scales_from_amax,
    _store_e4m3,
)
from moetrain.kernels.triton_support import jit as _jit
from moetrain.kernels.triton_support import tl, triton

# (rows a step, columns a program, warps): quantization of bf16 rows, byte transpose
QUANT_TILE = (64, 64, 4)
BYTES_TILE = (64, 128, 4)


@_jit
def _group_bounds(offs_ptr, g):
    """(start, end) of group g from cumulative end offsets."""
    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    return start, tl.load(offs_ptr + g)


@_jit
def _group_columns_kernel(
    x_ptr, row_scale_ptr, offs_ptr, offs_pad_ptr, q_ptr, scale_ptr, C, P,
    HAS_ROW_SCALE: tl.constexpr, QUANTIZE: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr, SOFTWARE_CAST: tl.constexpr,
):  # fmt: skip
    """q[c, pad_start + i] for row start + i of group g, c in this program's column block.
    QUANTIZE: x is bf16/fp32, scaled by the row scale (HAS_ROW_SCALE) and the group's column
    amax; otherwise x holds bytes, copied."""
    g = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    start, end = _group_bounds(offs_ptr, g)
    pad_start, pad_end = _group_bounds(offs_pad_ptr, g)
    steps = tl.arange(0, BLOCK_R)
    if QUANTIZE:
        amax = tl.zeros([BLOCK_C], dtype=tl.float32)
        for r in range(start, end, BLOCK_R):
            rows = r + steps
            mask = (rows < end)[:, None] & col_mask[None, :]
            v = tl.load(
                x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=mask, other=0.0
            )
            v = v.to(tl.float32)
            if HAS_ROW_SCALE:
                v = v * tl.load(row_scale_ptr + rows, mask=rows < end, other=0.0)[:, None]
            amax = tl.maximum(amax, tl.max(_finite_abs(v), axis=0))
        inv, scale = _scales_from_amax(amax)
        tl.store(scale_ptr + g * C + cols, scale, mask=col_mask)
    for p in range(pad_start, pad_end, BLOCK_R):
        columns = p + steps  # the padded layout's columns, q's rows here
        rows = start + (columns - pad_start)
        in_group = rows < end
        load_mask = in_group[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=load_mask, other=0)
        q_offsets = cols.to(tl.int64)[None, :] * P + columns[:, None]
        store_mask = (columns < pad_end)[:, None] & col_mask[None, :]
        if QUANTIZE:
            v = x.to(tl.float32)
            if HAS_ROW_SCALE:
                v = v * tl.load(row_scale_ptr + rows, mask=in_group, other=0.0)[:, None]
            _store_e4m3(q_ptr, q_offsets, v * inv[None, :], store_mask, SOFTWARE_CAST)
        else:
            tl.store(q_ptr + q_offsets, x, mask=store_mask)


def _check_groups(x: torch.Tensor, offs_e: torch.Tensor, offs_pad_e: torch.Tensor, width: int):
    _check_device(x)
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D row-grouped tensor, got shape {tuple(x.shape)}")
    if offs_e.dtype != torch.int32 or offs_pad_e.dtype != torch.int32:
        raise ValueError("group offsets must be int32")
    if offs_e.shape != offs_pad_e.shape or offs_e.dim() != 1 or offs_e.numel() > 65535:
        raise ValueError("offs and offs_pad must be 1-D, of equal length (at most 65535 groups)")
    if width % 16:
        raise ValueError(f"the padded width {width} must be a multiple of 16")


def quantize_group_columns_triton(
    x_NC: torch.Tensor,
    offs_e: torch.Tensor,
    offs_pad_e: torch.Tensor,
    width: int,
    row_scale_N: torch.Tensor | None = None,
    *,
    software_cast: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quant.quantize_group_columns`, except that columns past offs_pad[-1] are unwritten."""
    _check_groups(x_NC, offs_e, offs_pad_e, width)
    if software_cast is None:
        software_cast = _default_software_cast(x_NC)
    x_NC = x_NC.contiguous()
    c, e = x_NC.shape[1], offs_e.numel()
    q = torch.empty((c, width), dtype=torch.float8_e4m3fn, device=x_NC.device)
    scale = torch.empty((e, c), dtype=torch.float32, device=x_NC.device)
    if c == 0 or e == 0:
        return q, scale
    row_scale = x_NC if row_scale_N is None else row_scale_N.float().contiguous()
    block_r, block_c, warps = QUANT_TILE
    _group_columns_kernel[(triton.cdiv(c, block_c), e)](
        x_NC, row_scale, offs_e, offs_pad_e, _q_arg(q, software_cast), scale, c, width,
        HAS_ROW_SCALE=row_scale_N is not None, QUANTIZE=True, BLOCK_R=block_r, BLOCK_C=block_c,
        SOFTWARE_CAST=software_cast, num_warps=warps,
    )  # fmt: skip
    return q, scale


def transpose_group_rows_triton(
    q_NC: torch.Tensor, offs_e: torch.Tensor, offs_pad_e: torch.Tensor, width: int
) -> torch.Tensor:
    """`quant.transpose_group_rows`, except that columns past offs_pad[-1] are unwritten."""
    _check_groups(q_NC, offs_e, offs_pad_e, width)
    if q_NC.element_size() != 1:
        raise ValueError(f"transpose_group_rows moves bytes, got {q_NC.dtype}")
    q_NC = q_NC.contiguous()
    c, e = q_NC.shape[1], offs_e.numel()
    out = torch.empty((c, width), dtype=torch.uint8, device=q_NC.device)
    if c and e:
        block_r, block_c, warps = BYTES_TILE
        _group_columns_kernel[(triton.cdiv(c, block_c), e)](
            q_NC.view(torch.uint8), out, offs_e, offs_pad_e, out, out, c, width,
            HAS_ROW_SCALE=False, QUANTIZE=False, BLOCK_R=block_r, BLOCK_C=block_c,
            SOFTWARE_CAST=True, num_warps=warps,
        )  # fmt: skip
    return out.view(q_NC.dtype)
