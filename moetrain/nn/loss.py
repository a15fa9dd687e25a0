"""Language-model loss: LM head + cross-entropy, chunked so the full logits never exist at once.

`chunked_linear_cross_entropy(h_TD, w_VD, targets_T)` equals
`F.cross_entropy((h_TD @ w_VD.T).float(), targets_T)` (mean over tokens). For each chunk of
tokens it forms the fp32 logits, the loss and, while the logits are at hand, the gradients of h
and w; backward only scales them. Peak extra memory: one chunk of logits and a head gradient,
never T x V logits. The head's gradient accumulates in the GEMM (addmm; the first chunk writes).
The chunk's loss and softmax-minus-onehot: kernels/cross_entropy_triton.py on CUDA with Triton,
else its twin `_chunk_loss_and_grad` (compiled on CUDA).

The two token-side products (logits h @ w^T, input gradient grad @ w) run on `products`, the
LM head's backend the precision plan installs (`precision.lm_head`): `BF16HeadProducts` in the
inputs' dtype, or `FP8HeadProducts`, FP8 row-scaled (`nn.fp8.scaled_mm`) with the weight quantized
once a call in both layouts, on tensor cores or `emulate`d in fp32; the weight gradient stays in
the inputs' dtype either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from moetrain.kernels import cross_entropy_triton
from moetrain.nn.fp8 import quantize_rows, quantize_rows_of_transpose, scaled_mm


def _chunk_loss_and_grad(logits_CV: torch.Tensor, t_C: torch.Tensor, scale: float):
    """Summed cross-entropy of one chunk and d(scale * loss)/d(logits) = scale * (softmax -
    onehot), in the logits' dtype; math in fp32 (fp64 for fp64 inputs)."""
    acc_dtype = torch.promote_types(logits_CV.dtype, torch.float32)
    logits = logits_CV.to(acc_dtype)
    lse_C = torch.logsumexp(logits, dim=-1)
    loss = (lse_C - logits.gather(1, t_C[:, None]).squeeze(1)).sum()
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (vocab[None, :] == t_C[:, None]).to(acc_dtype)
    grad_CV = ((logits - lse_C[:, None]).exp() - onehot) * scale
    return loss, grad_CV.to(logits_CV.dtype)


_compiled_chunk = None


def _compiled_torch_chunk():
    global _compiled_chunk
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(_chunk_loss_and_grad, dynamic=False)
    return _compiled_chunk


def _chunk_fn(device: torch.device, dtype: torch.dtype):
    """(logits_CV, t_C, scale) -> (loss_sum, grad_CV) for logits of `dtype` on `device`."""
    if device.type != "cuda":
        return _chunk_loss_and_grad
    if cross_entropy_triton.triton_available() and dtype in cross_entropy_triton.KERNEL_DTYPES:
        return cross_entropy_triton.chunk_loss_and_grad_triton
    return _compiled_torch_chunk()


class HeadProducts(Protocol):
    """The head's token-side products: `prepare(w_VD, need_h)` readies the weight once a call
    (for the input gradient too if `need_h`), `logits` (h @ w^T) and `grad_h` (grad @ w) take
    what it returned with each chunk and return `dtype`."""

    name: str

    def prepare(self, w_VD: torch.Tensor, need_h: bool) -> Any: ...

    def logits(self, w: Any, h_CD: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...

    def grad_h(self, w: Any, grad_CV: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...


class BF16HeadProducts:
    """The head's products in the inputs' dtype."""

    name = "bf16"

    def prepare(self, w_VD: torch.Tensor, need_h: bool) -> torch.Tensor:
        return w_VD

    def logits(self, w_VD: torch.Tensor, h_CD: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return h_CD @ w_VD.T

    def grad_h(self, w_VD: torch.Tensor, grad_CV: torch.Tensor, dtype: torch.dtype):
        return grad_CV @ w_VD


BF16_HEAD_PRODUCTS = BF16HeadProducts()


@dataclass(frozen=True)
class FP8HeadProducts:
    """FP8 row-scaled products: the weight quantized per vocabulary row along D (logits) and per
    column along V (input gradient), once for all chunks; `fast_accum`: the kernels' fast
    accumulation (precision.fp8_fast_accum); D and V multiples of 16."""

    emulate: bool
    fast_accum: bool = True
    name = "fp8_rowwise"

    def prepare(self, w_VD: torch.Tensor, need_h: bool):
        w_rows = quantize_rows(w_VD)  # per vocabulary row, along D
        return w_rows, quantize_rows_of_transpose(w_VD) if need_h else None  # along V

    def logits(self, w, h_CD: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return scaled_mm(*quantize_rows(h_CD), *w[0], dtype, self.emulate, self.fast_accum)

    def grad_h(self, w, grad_CV: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return scaled_mm(*quantize_rows(grad_CV), *w[1], dtype, self.emulate, self.fast_accum)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD, w_VD, targets_T, chunk_size: int, products: HeadProducts):  # type: ignore[override]
        num_tokens = h_TD.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc_dtype = torch.promote_types(h_TD.dtype, torch.float32)  # fp32, or fp64 in tests
        grad_h_TD = torch.empty_like(h_TD) if need_h else None
        grad_w_VD = None
        if need_w:  # written by the first chunk's GEMM; zeros only if there is no chunk
            grad_w_VD = torch.empty_like(w_VD) if num_tokens else torch.zeros_like(w_VD)
        loss_sum = torch.zeros((), dtype=acc_dtype, device=h_TD.device)
        chunk_loss_and_grad = _chunk_fn(h_TD.device, h_TD.dtype)  # the logits' device and dtype
        w = products.prepare(w_VD, need_h)
        for start in range(0, num_tokens, chunk_size):
            h_CD = h_TD[start : start + chunk_size]
            logits_CV = products.logits(w, h_CD, h_TD.dtype)
            loss, grad_CV = chunk_loss_and_grad(
                logits_CV, targets_T[start : start + chunk_size], 1.0 / num_tokens
            )
            del logits_CV
            loss_sum += loss
            if need_h:
                grad_h_TD[start : start + chunk_size] = products.grad_h(w, grad_CV, h_TD.dtype)
            if need_w and start == 0:  # the first chunk writes, no zero-filled buffer to read
                torch.mm(grad_CV.T, h_CD, out=grad_w_VD)
            elif need_w:  # accumulated in the weight's dtype inside the GEMM (beta = 1)
                grad_w_VD.addmm_(grad_CV.T, h_CD)
        ctx.save_for_backward(grad_h_TD, grad_w_VD)
        return loss_sum / num_tokens

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        grad_h_TD, grad_w_VD = ctx.saved_tensors
        grad_h = grad_h_TD * grad_loss.to(grad_h_TD.dtype) if grad_h_TD is not None else None
        grad_w = grad_w_VD * grad_loss.to(grad_w_VD.dtype) if grad_w_VD is not None else None
        return grad_h, grad_w, None, None, None


def chunked_linear_cross_entropy(
    h_TD: torch.Tensor,
    w_VD: torch.Tensor,
    targets_T: torch.Tensor,
    chunk_size: int = 4096,
    *,
    products: HeadProducts = BF16_HEAD_PRODUCTS,
) -> torch.Tensor:
    """Mean cross-entropy of the logits h_TD @ w_VD.T against targets_T, as an fp32 scalar, with
    the head's two token-side products on `products`."""
    return _ChunkedLinearCrossEntropy.apply(h_TD, w_VD, targets_T, chunk_size, products)


def linear_cross_entropy_reference(
    h_TD: torch.Tensor, w_VD: torch.Tensor, targets_T: torch.Tensor
) -> torch.Tensor:
    """The slow twin: materialize all logits in fp32."""
    return F.cross_entropy((h_TD @ w_VD.T).float(), targets_T)
