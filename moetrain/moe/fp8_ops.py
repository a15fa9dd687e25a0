"""The FP8 row-scaled grouped product and its registered ops: `scaled_grouped_mm` (one product
on quantized operands), `quantized_weight` (a weight in the layout each product wants) and
`fp8_grouped_mm` (y = x @ w per group, forward and backward as two opaque torch.library ops).

Letters: N rows (grouped by expert), D input (reduction) dim, F output dim, e local experts.

FP8 products go through `torch._scaled_grouped_mm` (torch 2.11 sources): compute capability 9.x
or 10.x only; mat_a e4m3 row-major, mat_b e4m3 column-major (`q.mT` of a contiguous (e, N, K));
K and N multiples of 16, so D and F must be; int32 cumulative end offsets, < 1024 groups; fp32
scales, (M,) per row of mat_a and (e, N) per output column; bf16 output. In the 2-D x 3-D case
(forward, input gradient) any group sizes work, empty included. The 2-D x 2-D case (the weight
gradient) asserts non-empty groups of multiples of 16, which routing does not give: it runs in
BF16 (`grouped_mm_weight_grad`).

The product is two opaque ops with a registered autograd formula, traced by torch.compile without
a graph break; inside them the Triton quantizers run on the GPU. (As an autograd.Function traced
into the graph, its compiled backward returned zero gradients on torch 2.11, likely
pytorch/pytorch#160901.) Emulated (the CPU, or `emulate=True`), the dequantized operands are
multiplied in fp32: equal to the tensor cores up to the order of fp32 accumulation.
"""

from __future__ import annotations

import torch

from moetrain.kernels import quant
from moetrain.moe.experts import grouped_mm, grouped_mm_weight_grad
from moetrain.nn.fp8 import quantize_rows, quantize_rows_of_transpose


def quantized_weight(w_eDF: torch.Tensor, reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_eNK contiguous, scale_eN) with K the reduction dim: "D" for the forward, "F" for the
    input gradient. `q.mT` is the column-major operand `torch._scaled_grouped_mm` wants."""
    if reduction == "D":
        return quantize_rows_of_transpose(w_eDF)  # (e, F, D), one scale per output column
    return quantize_rows(w_eDF, dim=-1)  # (e, D, F), one scale per row of w


def scaled_grouped_mm(
    a_q_MK: torch.Tensor,
    a_scale_M: torch.Tensor,
    b_q_eNK: torch.Tensor,
    b_scale_eN: torch.Tensor,
    offs_e: torch.Tensor,
    out_dtype: torch.dtype,
    emulate: bool,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """out[rows of group i] = (a_q * a_scale) @ (b_q[i] * b_scale[i]).T, via FP8 tensor cores
    or, emulated, in fp32."""
    if emulate:
        a_MK = quant.dequantize_fp8_rowwise(a_q_MK, a_scale_M, dim=-1)
        b_eNK = quant.dequantize_fp8_rowwise(b_q_eNK, b_scale_eN, dim=-1)
        return grouped_mm(a_MK, b_eNK.mT, offs_e).to(out_dtype)
    out_MN = torch._scaled_grouped_mm(
        a_q_MK,
        b_q_eNK.mT,
        a_scale_M,
        b_scale_eN,
        offs=offs_e,
        out_dtype=torch.bfloat16,
        use_fast_accum=use_fast_accum,
    )
    return out_MN.to(out_dtype)


@torch.library.custom_op("moetrain::fp8_grouped_mm", mutates_args=())
def fp8_grouped_mm(
    x_ND: torch.Tensor,
    w_eDF: torch.Tensor,
    offs_e: torch.Tensor,
    emulate: bool,
    use_fast_accum: bool,
) -> torch.Tensor:
    """y = x @ w per group in FP8 (x row-major): tensor cores, or the fp32 emulation."""
    return scaled_grouped_mm(
        *quantize_rows(x_ND, dim=-1), *quantized_weight(w_eDF, "D"), offs_e, x_ND.dtype,
        emulate, use_fast_accum,
    )  # fmt: skip


@fp8_grouped_mm.register_fake
def _(x_ND, w_eDF, offs_e, emulate, use_fast_accum):
    return x_ND.new_empty((x_ND.shape[0], w_eDF.shape[2]))


@torch.library.custom_op("moetrain::fp8_grouped_mm_backward", mutates_args=())
def fp8_grouped_mm_backward(
    grad_y_NF: torch.Tensor,
    x_ND: torch.Tensor,
    w_eDF: torch.Tensor,
    offs_e: torch.Tensor,
    emulate: bool,
    use_fast_accum: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad x in FP8, grad w in the input precision) of `fp8_grouped_mm`."""
    grad_y_NF = grad_y_NF.contiguous()
    grad_x_ND = scaled_grouped_mm(
        *quantize_rows(grad_y_NF, dim=-1), *quantized_weight(w_eDF, "F"), offs_e, x_ND.dtype,
        emulate, use_fast_accum,
    )  # fmt: skip
    grad_w_eDF = grouped_mm_weight_grad(x_ND, grad_y_NF.to(x_ND.dtype), offs_e).to(w_eDF.dtype)
    return grad_x_ND, grad_w_eDF


@fp8_grouped_mm_backward.register_fake
def _(grad_y_NF, x_ND, w_eDF, offs_e, emulate, use_fast_accum):
    return torch.empty_like(x_ND), torch.empty_like(w_eDF)


def _setup(ctx, inputs, output) -> None:
    x_ND, w_eDF, offs_e, emulate, use_fast_accum = inputs
    ctx.save_for_backward(x_ND, w_eDF, offs_e)
    ctx.emulate, ctx.use_fast_accum = emulate, use_fast_accum


def _backward(ctx, grad_y_NF):
    x_ND, w_eDF, offs_e = ctx.saved_tensors
    grad_x_ND, grad_w_eDF = fp8_grouped_mm_backward(
        grad_y_NF, x_ND, w_eDF, offs_e, ctx.emulate, ctx.use_fast_accum
    )
    return grad_x_ND, grad_w_eDF, None, None, None


fp8_grouped_mm.register_autograd(_backward, setup_context=_setup)
