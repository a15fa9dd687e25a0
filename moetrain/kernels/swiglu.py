"""SwiGLU of the fused expert projection, with plain-torch references.

F hidden size; h_N2F holds [gate | up] on its last dim (gate = h[:, :F], up = h[:, F:]), and
optional row weights w_N (float32: the router weight of each expert row) scale the output:

    out_NF = w * silu(gate) * up                               # swiglu(h_N2F, w_N); w = 1 without
    dgate = w grad * up * s * (1 + gate * (1 - s)),  s = sigmoid(gate)
    dup   = w grad * gate * s                                  # grad_h = [dgate | dup]
    dw    = sum_j grad * silu(gate) * up                       # per row

Math in float32 (float64 for float64 inputs), rounded once to h's dtype; dw stays float32. On
CUDA with Triton `swiglu` runs `swiglu_triton`'s op, elsewhere an autograd Function of the
references; both save h (and w) alone for the backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetrain.kernels import quant, swiglu_triton


def _halves(h_N2F: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up in float32, or float64 for float64 inputs."""
    acc = torch.promote_types(h_N2F.dtype, torch.float32)
    return h_N2F.to(acc).chunk(2, dim=-1)


def swiglu_reference(h_N2F: torch.Tensor, w_N: torch.Tensor | None = None) -> torch.Tensor:
    """w * silu(gate) * up, (N, F), in h's dtype."""
    gate_NF, up_NF = _halves(h_N2F)
    out_NF = F.silu(gate_NF) * up_NF
    if w_N is not None:
        out_NF = out_NF * w_N.to(out_NF.dtype)[:, None]
    return out_NF.to(h_N2F.dtype)


def weighted_swiglu_backward_reference(
    h_N2F: torch.Tensor, grad_NF: torch.Tensor, w_N: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([dgate | dup] in h's dtype, dw in w's dtype or None without weights)."""
    gate_NF, up_NF = _halves(h_N2F)
    grad_NF = grad_NF.to(gate_NF.dtype)
    s_NF = torch.sigmoid(gate_NF)
    dw_N = None
    if w_N is not None:
        dw_N = (grad_NF * gate_NF * s_NF * up_NF).sum(-1).to(w_N.dtype)
        grad_NF = grad_NF * w_N.to(grad_NF.dtype)[:, None]
    dgate_NF = grad_NF * up_NF * s_NF * (1 + gate_NF * (1 - s_NF))
    dup_NF = grad_NF * gate_NF * s_NF
    return torch.cat([dgate_NF, dup_NF], dim=-1).to(h_N2F.dtype), dw_N


def swiglu_backward_reference(h_N2F: torch.Tensor, grad_NF: torch.Tensor) -> torch.Tensor:
    """[dgate | dup], (N, 2F), in h's dtype (no row weights)."""
    return weighted_swiglu_backward_reference(h_N2F, grad_NF, None)[0]


class _SwiGLUReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_N2F, w_N):  # type: ignore[override]
        ctx.save_for_backward(h_N2F, w_N)
        return swiglu_reference(h_N2F, w_N)

    @staticmethod
    def backward(ctx, grad_NF):  # type: ignore[override]
        h_N2F, w_N = ctx.saved_tensors
        return weighted_swiglu_backward_reference(h_N2F, grad_NF, w_N)


def _check(h_N2F: torch.Tensor, w_N: torch.Tensor | None) -> None:
    if h_N2F.dim() != 2 or h_N2F.shape[1] % 2:
        raise ValueError(f"swiglu: h must be 2-D (N, 2F) with an even last dim, got {tuple(h_N2F.shape)}")  # fmt: skip
    if h_N2F.shape[1] > 1 and h_N2F.stride(1) != 1:
        raise ValueError(f"swiglu: h must be contiguous in its last dim, got strides {h_N2F.stride()}")  # fmt: skip
    if w_N is not None and w_N.shape != h_N2F.shape[:1]:
        raise ValueError(f"swiglu: row weights of shape {tuple(w_N.shape)} for {h_N2F.shape[0]} rows")  # fmt: skip


def swiglu(h_N2F: torch.Tensor, w_N: torch.Tensor | None = None) -> torch.Tensor:
    """w * silu(gate) * up of h_N2F = [gate | up], (N, F), differentiable in h and w (optional
    row weights, (N,))."""
    _check(h_N2F, w_N)
    if h_N2F.is_cuda and swiglu_triton.supports(h_N2F):
        if w_N is not None and w_N.dtype != torch.float32:  # the kernels read float32 weights
            w_N = w_N.float()
        return swiglu_triton.swiglu_triton(h_N2F, w_N)
    return _SwiGLUReference.apply(h_N2F, w_N)


def swiglu_fp8(
    h_N2F: torch.Tensor, w_N: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) = `quant.quantize_fp8_rowwise(swiglu(h, w))` without writing the bf16 rows:
    one Triton pass on CUDA (rows up to `swiglu_triton.MAX_QUANTIZED_F`), the references
    elsewhere. Not differentiable."""
    _check(h_N2F, w_N)
    if _fused_fp8(h_N2F):
        return swiglu_triton.swiglu_fp8_triton(h_N2F, None if w_N is None else w_N.float())
    return quant.quantize_fp8_rowwise(swiglu_reference(h_N2F, w_N))


def swiglu_fp8_backward(
    h_N2F: torch.Tensor, grad_NF: torch.Tensor, w_N: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(dh, q, scale, dw, out): the SwiGLU backward, (q, scale) = quantize_fp8_rowwise(dh), and
    the forward's output again, bit for bit `swiglu(h, w)` (for a caller that did not keep it);
    dw is None without row weights. One Triton pass on CUDA, the references elsewhere. Not
    differentiable."""
    _check(h_N2F, w_N)
    if _fused_fp8(h_N2F):
        w32_N = None if w_N is None else w_N.float()
        dh_N2F, q_N2F, scale_N, dw_N, out_NF = swiglu_triton.swiglu_fp8_backward_triton(
            h_N2F, grad_NF, w32_N
        )
        return dh_N2F, q_N2F, scale_N, None if dw_N is None else dw_N.to(w_N.dtype), out_NF
    dh_N2F, dw_N = weighted_swiglu_backward_reference(h_N2F, grad_NF, w_N)
    return dh_N2F, *quant.quantize_fp8_rowwise(dh_N2F), dw_N, swiglu_reference(h_N2F, w_N)


def _fused_fp8(h_N2F: torch.Tensor) -> bool:
    return (
        h_N2F.is_cuda
        and swiglu_triton.supports(h_N2F)
        and h_N2F.shape[1] // 2 <= swiglu_triton.MAX_QUANTIZED_F
    )
