"""Token <-> expert-ordered row movements of the LocalDispatcher, with plain-torch references.

Letters: T tokens, K top-k, N = T*K rows, D model dim. `order_N` (int64) is a permutation of
range(N): row n of the expert-ordered rows holds route order_N[n], i.e. token order_N[n] // K and
slot order_N[n] % K. `inverse_TK` (int64, (T, K)) is its inverse: inverse_TK.view(-1)[order_N[n]]
== n, so token t's k-th route sits in row inverse_TK[t, k].

    rows_ND = gather_routes(x_TD, order_N, inverse_TK)   # rows[n] = x[order[n] // K]
    out_TD = sum_routes(y_ND, order_N, inverse_TK)        # sum_k y[inverse[t, k]]

Each backward is the other op, a gather too (no scatter, no atomics): the gather's is
grad_x[t] = sum_k grad_rows[inverse[t, k]], the sum's grad_y[n] = g[order[n] // K]. The sum
combines rows the experts already weighted. Sums over K accumulate in float32 (at least) and
come back in the rows' dtype. On CUDA with Triton the public functions run `gather_triton`'s
ops, which need only `inverse_TK` (then a full permutation: unmapped rows stay unwritten);
elsewhere the references, with the same backward formulas and saved tensors.
"""

from __future__ import annotations

import torch

from moetrain.kernels import gather_triton


def _acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32, or float64 when an input is float64 (the tests' exact references)."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


# --- references --------------------------------------------------------------------------------


def gather_routes_reference(
    x_TD: torch.Tensor, order_N: torch.Tensor, inverse_TK: torch.Tensor
) -> torch.Tensor:
    """rows[n] = x[order[n] // K]."""
    return x_TD[order_N // inverse_TK.shape[1]]


def gather_routes_backward_reference(grad_ND: torch.Tensor, inverse_TK: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """grad_x[t] = sum_k grad_rows[inverse[t, k]], accumulated in float32, in grad's dtype."""
    return grad_ND[inverse_TK].to(_acc_dtype(grad_ND)).sum(1).to(grad_ND.dtype)


def weighted_sum_reference(y_TKD: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """sum_k w[t, k] * y[t, k, :] of already gathered routes, accumulated in float32 (at least),
    in y's dtype."""
    acc = _acc_dtype(y_TKD, weights_TK)
    return (y_TKD.to(acc) * weights_TK.to(acc).unsqueeze(-1)).sum(1).to(y_TKD.dtype)


# --- public, differentiable --------------------------------------------------------------------


class _GatherRoutesReference(torch.autograd.Function):
    """The reference with the kernels' backward (a gather by `inverse_TK`, no index_put) and
    their saved tensors, so CPU and GPU runs hold the same activation memory."""

    @staticmethod
    def forward(ctx, x_TD, order_N, inverse_TK):  # type: ignore[override]
        ctx.save_for_backward(inverse_TK)
        return gather_routes_reference(x_TD, order_N, inverse_TK)

    @staticmethod
    def backward(ctx, grad_ND):  # type: ignore[override]
        (inverse_TK,) = ctx.saved_tensors
        return gather_routes_backward_reference(grad_ND.contiguous(), inverse_TK), None, None


class _SumRoutesReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND, order_N, inverse_TK):  # type: ignore[override]
        ctx.save_for_backward(order_N, inverse_TK)
        return gather_routes_backward_reference(y_ND, inverse_TK)

    @staticmethod
    def backward(ctx, grad_TD):  # type: ignore[override]
        order_N, inverse_TK = ctx.saved_tensors
        return gather_routes_reference(grad_TD, order_N, inverse_TK), None, None


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and gather_triton.triton_available()


def gather_routes(
    x_TD: torch.Tensor, order_N: torch.Tensor, inverse_TK: torch.Tensor
) -> torch.Tensor:
    """Expert-ordered rows of the K-times repeated tokens: rows[n] = x[order[n] // K]."""
    if _use_triton(x_TD):
        return gather_triton.gather_routes_triton(x_TD, inverse_TK)
    return _GatherRoutesReference.apply(x_TD, order_N, inverse_TK)


def sum_routes(y_ND: torch.Tensor, order_N: torch.Tensor, inverse_TK: torch.Tensor) -> torch.Tensor:
    """Each token's K expert results summed (fp32 accumulation, in y's dtype); the backward
    saves only the permutations."""
    if _use_triton(y_ND):
        return gather_triton.sum_routes_triton(y_ND, inverse_TK)
    return _SumRoutesReference.apply(y_ND, order_N, inverse_TK)
