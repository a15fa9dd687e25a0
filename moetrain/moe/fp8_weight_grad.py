"""The FP8 weight gradient of a grouped product: gw[i] = a_i^T b_i over each group's rows.

The product is `torch._scaled_grouped_mm`'s 2-D x 2-D case: the jagged dim is K, the rows,
which both operands must hold contiguously (Hopper's FP8 tensor cores take them K-major), with
every group's K a non-empty multiple of 16 and one scale per (group, column) of each operand.
Routing gives groups of any size, so the operands are written transposed into a padded layout
(`quant.padded_group_offsets`: each group starts at a multiple of 16, zeros fill the gap; the
dispatcher's layout is untouched).

b arrives already quantized per row (the input gradient's operand: the output gradient's rows,
or dh's rows from the SwiGLU backward). Its row scales cannot stay with b (they vary along K),
so they move to a:
    gw[i] = sum_r a[r]^T (s[r] q_b[r]) = sum_r (s[r] a[r])^T q_b[r]
a * s is then scaled per (group, column) and quantized (`quant.quantize_group_columns`), and
b's FP8 bytes are only transposed (`quant.transpose_group_rows`), with a unit scale: two passes
instead of two quantizations, and b's bf16 rows are not needed at all.
"""

from __future__ import annotations

import torch

from moetrain.kernels import quant
from moetrain.nn.fp8 import triton_quantizes


def group_operands(
    a_NM: torch.Tensor,
    b_q_NK: torch.Tensor,
    b_scale_N: torch.Tensor,
    offs_e: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a^T q (M, P), its scales (e, M), b^T q (K, P), padded offsets (e,)): the operands of
    `scaled_weight_grad`, Triton kernels on a CUDA GPU, their torch twins elsewhere."""
    offs_pad = quant.padded_group_offsets(offs_e)
    width = quant.padded_group_width(a_NM.shape[0], offs_e.numel())
    if triton_quantizes(a_NM):
        from moetrain.kernels import quant_groups_triton as kernels

        a_q, a_scale = kernels.quantize_group_columns_triton(
            a_NM, offs_e, offs_pad, width, b_scale_N
        )
        b_q = kernels.transpose_group_rows_triton(b_q_NK, offs_e, offs_pad, width)
    else:
        a_q, a_scale = quant.quantize_group_columns(a_NM, offs_e, offs_pad, width, b_scale_N)
        b_q = quant.transpose_group_rows(b_q_NK, offs_e, offs_pad, width)
    return a_q, a_scale, b_q, offs_pad


def scaled_weight_grad(
    a_q_MP: torch.Tensor,
    a_scale_eM: torch.Tensor,
    b_q_KP: torch.Tensor,
    offs_pad_e: torch.Tensor,
    out_dtype: torch.dtype,
    emulate: bool,
    use_fast_accum: bool,
) -> torch.Tensor:
    """(e, M, K): out[i] = (a_q * a_scale[i]) @ b_q^T over group i's columns of the padded
    layout, via FP8 tensor cores or, emulated, in fp32."""
    e, m = a_scale_eM.shape
    k = b_q_KP.shape[0]
    if emulate:
        out = a_q_MP.new_zeros((e, m, k), dtype=torch.float32)
        start = 0
        for i, end in enumerate(offs_pad_e.tolist()):
            a = a_q_MP[:, start:end].float() * a_scale_eM[i][:, None]
            out[i] = a @ b_q_KP[:, start:end].float().T
            start = end
        return out.to(out_dtype)
    ones = torch.ones(e * k, dtype=torch.float32, device=a_q_MP.device)
    out = torch._scaled_grouped_mm(
        a_q_MP, b_q_KP.T, a_scale_eM.reshape(-1), ones, offs=offs_pad_e,
        out_dtype=torch.bfloat16, use_fast_accum=use_fast_accum,
    )  # fmt: skip
    return out.to(out_dtype)


def grouped_weight_grad_fp8(
    a_NM: torch.Tensor,
    b_q_NK: torch.Tensor,
    b_scale_N: torch.Tensor,
    offs_e: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    emulate: bool,
    use_fast_accum: bool,
) -> torch.Tensor:
    """(e, M, K): gw[i] = sum over group i's rows r of a[r]^T (b_scale[r] b_q[r]), in FP8. Rows
    past offs[-1] are left out; an empty group's gradient is zero."""
    a_q, a_scale, b_q, offs_pad = group_operands(a_NM, b_q_NK, b_scale_N, offs_e)
    return scaled_weight_grad(a_q, a_scale, b_q, offs_pad, out_dtype, emulate, use_fast_accum)
