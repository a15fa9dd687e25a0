"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and returned in x's dtype.

The autograd function saves only x in its own dtype and the fp32 reciprocal RMS per row, and
recomputes the normalized row in backward (plain autograd of the fp32 formula would save 8 bytes
an element instead of 2 for bf16). `rms_norm_reference` is the plain formula, the tests' twin.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    acc = _compute_dtype(x)
    y = F.rms_norm(x.to(acc), (x.shape[-1],), eps=eps)
    return (y * weight.to(acc)).to(x.dtype)


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):  # type: ignore[override]
        acc = _compute_dtype(x)
        x_f = x.to(acc)
        rstd = torch.rsqrt(x_f.square().mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x_f * rstd * weight.to(acc)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        acc = _compute_dtype(x)
        x_hat = x.to(acc) * rstd
        g = grad_y.to(acc)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (g * x_hat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            gw = g * weight.to(acc)
            # d/dx of x * rstd(x): rstd * (gw - x_hat * mean(gw * x_hat))
            grad_x = (rstd * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, differentiable in x and weight (see the module docstring)."""
    return _RMSNormFn.apply(x, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
