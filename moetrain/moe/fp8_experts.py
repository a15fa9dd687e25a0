"""The SwiGLU experts' whole MLP in FP8 row-scaled precision, as one op: quantizations fused into
the kernels that produce the rows.

Letters: N rows (grouped by expert), D model dim, F expert hidden, e local experts.

    h_N2F = x_ND @ w_up_eD2F          FP8: x's rows quantized by the dispatcher
                                      (`gather_fp8_rows`), or here
    a_NF  = w_N * silu(gate) * up     the SwiGLU kernel writes a's rows in FP8 only
    y_ND  = a_NF @ w_down_eFD         FP8
backward:
    ga_NF = gy_ND @ w_down^T          FP8: gy quantized here
    dh_N2F = swiglu backward          the SwiGLU backward kernel also writes dh's rows in FP8,
                                      and a again in bf16 (for gw_down)
    gx_ND = dh_N2F @ w_up^T           FP8
    gw_up = x^T dh, gw_down = a^T gy  bf16 (`torch._grouped_mm`)

Composed of per-product ops, the SwiGLU output and its gradient would be written in bf16 and read
back by a separate quantization pass; one op with its own backward lets the SwiGLU kernels emit
the FP8 rows. The results equal the composition `fp8_grouped_mm`, `swiglu`, `fp8_grouped_mm` (bit
for bit in the CPU emulation; on the GPU up to the SwiGLU kernels' shared rounding). Saved for the
backward: x and h (the SwiGLU backward writes a again instead of keeping N x F a layer). Like
`fp8_grouped_mm`, two opaque torch.library ops with a registered autograd formula (no graph break,
CUDA-graphable); their arguments travel as one `FP8ExpertsInputs`.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch

from moetrain.kernels.swiglu import swiglu_fp8, swiglu_fp8_backward
from moetrain.moe.experts import grouped_mm_weight_grad
from moetrain.moe.fp8_ops import quantized_weight, scaled_grouped_mm
from moetrain.nn.fp8 import quantize_rows, quantize_rows_opaque


class FP8ExpertsInputs(NamedTuple):
    """The fused MLP's arguments, in the order of its op's schema. w_N: float32 row weights or
    None. x_q_ND, x_scale_N: `quantize_rows(x_ND)` computed by the caller (the dispatcher), or
    None. emulate: fp32 math instead of the tensor cores. use_fast_accum: see fp8_ops."""

    x_ND: torch.Tensor
    w_up_eD2F: torch.Tensor
    w_down_eFD: torch.Tensor
    offs_e: torch.Tensor
    w_N: torch.Tensor | None
    x_q_ND: torch.Tensor | None
    x_scale_N: torch.Tensor | None
    emulate: bool
    use_fast_accum: bool


def fp8_swiglu_experts(inputs: FP8ExpertsInputs) -> torch.Tensor:
    """y = swiglu(x @ w_up, w_N) @ w_down per expert group, the forward and input-gradient
    products in FP8; differentiable in x, both weights and w_N (not in x's FP8 rows)."""
    x_ND, w_N = inputs.x_ND.contiguous(), inputs.w_N
    if w_N is not None and w_N.dtype != torch.float32:
        w_N = w_N.float()
    y_ND, _ = _forward(*inputs._replace(x_ND=x_ND, w_N=w_N))
    return y_ND


@torch.library.custom_op("moetrain::fp8_swiglu_experts", mutates_args=())
def _forward(
    x_ND: torch.Tensor,
    w_up_eD2F: torch.Tensor,
    w_down_eFD: torch.Tensor,
    offs_e: torch.Tensor,
    w_N: torch.Tensor | None,
    x_q_ND: torch.Tensor | None,
    x_scale_N: torch.Tensor | None,
    emulate: bool,
    use_fast_accum: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h): the MLP's output and the activation its backward reads (with x)."""
    mm = partial(
        scaled_grouped_mm, offs_e=offs_e, out_dtype=x_ND.dtype, emulate=emulate,
        use_fast_accum=use_fast_accum,
    )  # fmt: skip
    x_fp8 = quantize_rows(x_ND) if x_q_ND is None else (x_q_ND, x_scale_N)
    h_N2F = mm(*x_fp8, *quantized_weight(w_up_eD2F, "D"))
    del x_fp8
    y_ND = mm(*swiglu_fp8(h_N2F, w_N), *quantized_weight(w_down_eFD, "D"))
    return y_ND, h_N2F


@_forward.register_fake
def _(*args):
    a = FP8ExpertsInputs(*args)
    n = a.x_ND.shape[0]
    return a.x_ND.new_empty((n, a.w_down_eFD.shape[2])), a.x_ND.new_empty((n, a.w_up_eD2F.shape[2]))


@torch.library.custom_op("moetrain::fp8_swiglu_experts_backward", mutates_args=())
def _backward_op(
    grad_y_ND: torch.Tensor,
    h_N2F: torch.Tensor,
    x_ND: torch.Tensor,
    w_up_eD2F: torch.Tensor,
    w_down_eFD: torch.Tensor,
    offs_e: torch.Tensor,
    w_N: torch.Tensor | None,
    emulate: bool,
    use_fast_accum: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad x, grad w_up, grad w_down, grad w_N: empty without row weights). Each temporary goes
    as soon as it is read: the peak is one layer's backward."""
    mm = partial(
        scaled_grouped_mm, offs_e=offs_e, out_dtype=x_ND.dtype, emulate=emulate,
        use_fast_accum=use_fast_accum,
    )  # fmt: skip
    grad_y_ND = grad_y_ND.to(x_ND.dtype).contiguous()
    grad_a_NF = mm(*quantize_rows(grad_y_ND), *quantized_weight(w_down_eFD, "F"))
    grad_h_N2F, grad_h_q, grad_h_scale, grad_w_N, a_NF = swiglu_fp8_backward(h_N2F, grad_a_NF, w_N)
    del grad_a_NF
    grad_w_down = grouped_mm_weight_grad(a_NF, grad_y_ND, offs_e).to(w_down_eFD.dtype)
    del grad_y_ND, a_NF
    grad_x_ND = mm(grad_h_q, grad_h_scale, *quantized_weight(w_up_eD2F, "F"))
    grad_w_up = grouped_mm_weight_grad(x_ND, grad_h_N2F, offs_e).to(w_up_eD2F.dtype)
    if grad_w_N is None:
        grad_w_N = x_ND.new_empty((0,), dtype=torch.float32)
    return grad_x_ND, grad_w_up, grad_w_down, grad_w_N


@_backward_op.register_fake
def _(grad_y_ND, h_N2F, x_ND, w_up_eD2F, w_down_eFD, offs_e, w_N, *_):
    grad_w_N = x_ND.new_empty((0,), dtype=torch.float32) if w_N is None else torch.empty_like(w_N)
    return (
        torch.empty_like(x_ND),
        torch.empty_like(w_up_eD2F),
        torch.empty_like(w_down_eFD),
        grad_w_N,
    )


def _setup(ctx, inputs, output) -> None:
    a = FP8ExpertsInputs(*inputs)
    _, h_N2F = output
    ctx.mark_non_differentiable(h_N2F)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(h_N2F, a.x_ND, a.w_up_eD2F, a.w_down_eFD, a.offs_e, a.w_N)
    ctx.flags = a.emulate, a.use_fast_accum


def _backward(ctx, grad_y_ND, _grad_h):
    h_N2F, x_ND, w_up_eD2F, w_down_eFD, offs_e, w_N = saved = ctx.saved_tensors
    if grad_y_ND is None:  # y unused: nothing flows back
        grad_y_ND = x_ND.new_zeros((x_ND.shape[0], w_down_eFD.shape[2]))
    grad_x, grad_w_up, grad_w_down, grad_w_N = _backward_op(grad_y_ND, *saved, *ctx.flags)
    grad_w_N = grad_w_N if w_N is not None else None
    return grad_x, grad_w_up, grad_w_down, None, grad_w_N, None, None, None, None


_forward.register_autograd(_backward, setup_context=_setup)


def gather_fp8_rows(x_TD: torch.Tensor, token_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of the rows x_TD[token_N] in row-scaled FP8: the T rows quantized, then their
    bytes and scales gathered (bit for bit the quantization of the gathered rows). The quantizer
    is the op's own, compiled or not, so the bits are its. Not differentiable."""
    q_TD, scale_T = quantize_rows_opaque(x_TD.detach())
    q_ND = q_TD.view(torch.uint8)[token_N].view(q_TD.dtype)
    return q_ND, scale_T[token_N]
