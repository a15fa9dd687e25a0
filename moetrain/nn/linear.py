"""The dense layers' GEMM backends: what an `Attention` or a `SwiGLU` multiplies its activations
by its nn.Linear weights with (`precision.linear`, resolved by parallel/precision.py).

A backend `gemm` computes `gemm(x, w_NK)` = x @ w^T (`F.linear` without bias) and
`gemm.stacked(x, weights)` = x @ cat(weights)^T, several nn.Linear weights stacked along their
output dim in one GEMM, with the weights themselves saved for the backward (`concat_linear`),
not their concatenation. Letters: N output width, K input width.

- `BF16Linear`: the inputs' dtype (bf16 in training, fp32 on the CPU).
- `FP8Linear`: row-scaled FP8 products (nn/fp8.py), on tensor cores or `emulate`d in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from moetrain.nn.fp8 import fp8_linear


class LinearGemm(Protocol):
    name: str

    def __call__(self, x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor: ...

    def stacked(self, x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor: ...


class _ConcatLinear(torch.autograd.Function):
    """x @ cat(weights).T, saving x and the weights themselves (not their concatenation)."""

    @staticmethod
    def forward(ctx, x, *weights):  # type: ignore[override]
        ctx.save_for_backward(x, *weights)
        return F.linear(x, torch.cat(weights))

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, *weights = ctx.saved_tensors
        grad_x = grad_out @ torch.cat(weights) if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[1:]):
            return grad_x, *(None for _ in weights)
        grad_w = grad_out.reshape(-1, grad_out.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        return grad_x, *grad_w.split([w.shape[0] for w in weights])


def concat_linear(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """One GEMM against several nn.Linear weights stacked along their output dim."""
    return _ConcatLinear.apply(x, *weights)


class BF16Linear:
    """Products in the inputs' dtype: `F.linear`, and `concat_linear` for stacked weights."""

    name = "bf16"

    def __call__(self, x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w_NK)

    def stacked(self, x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        return concat_linear(x, weights)


@dataclass(frozen=True)
class FP8Linear:
    """Row-scaled FP8 forward and input-gradient products, bf16 weight gradient (`fp8_linear`);
    `emulate`: fp32 math instead of the tensor cores; `fast_accum`: precision.fp8_fast_accum.
    Widths must be multiples of 16 (checked at start-up)."""

    emulate: bool
    fast_accum: bool = True
    name = "fp8_rowwise"

    def __call__(self, x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        return self.stacked(x, [w_NK])

    def stacked(self, x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        return fp8_linear(x, weights, emulate=self.emulate, fast_accum=self.fast_accum)
