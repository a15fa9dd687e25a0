"""Dispatchers turn tokens into expert-ordered rows and back.

Letters: T tokens, K top-k, D model dim, N rows handed to the experts, e local experts.

    rows_ND, offsets_e, handle = dispatcher.dispatch(x_TD, routing)
    y_ND = experts(rows_ND, offsets_e)
    y_TD = dispatcher.combine(y_ND, handle)

`offsets_e` holds each local expert's cumulative END row (int32, on device), the layout
`torch._grouped_mm` takes; rows past `offsets_e[-1]` are padding the experts may leave unwritten.
`combine` weights each route's result by its router weight and sums a token's K results; a route
that was dropped contributes zero. The MoE layer only sees this interface: expert parallelism swaps
in dispatchers that move rows between ranks (moetrain.parallel), without touching model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moetrain.moe.payload import check_payload, fp8_round_trip
from moetrain.moe.router import RoutingResult


class Dispatcher(Protocol):
    def dispatch(
        self, x_TD: torch.Tensor, routing: RoutingResult
    ) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, y_ND: torch.Tensor, handle: Any) -> torch.Tensor: ...


@dataclass
class LocalHandle:
    order_N: torch.Tensor  # flat (token, k) route index of each expert-ordered row
    inverse_order_TK: torch.Tensor  # position in the expert-ordered rows of each (token, k) route
    weights_TK: torch.Tensor


class LocalDispatcher:
    """All experts on this device. A stable sort of the T*K routes by expert id gives the row
    order (ties keep token order, so the result is deterministic); one gather builds the rows.
    `payload="fp8"`: nothing leaves the device, so only the FP8 rounding of the rows is applied
    (before the K-fold gather: T rows quantized, not T*K), which keeps a run's numerics the same
    with and without expert parallelism."""

    def __init__(self, payload: str = "bf16") -> None:
        self.payload = check_payload(payload)

    def dispatch(
        self, x_TD: torch.Tensor, routing: RoutingResult
    ) -> tuple[torch.Tensor, torch.Tensor, LocalHandle]:
        num_tokens, top_k = routing.expert_ids_TK.shape
        if self.payload == "fp8":
            x_TD = fp8_round_trip(x_TD)
        order_N = torch.argsort(routing.expert_ids_TK.reshape(-1), stable=True)
        inverse_N = torch.argsort(order_N)  # a permutation's inverse; cheaper than index_put
        rows_ND = gather_routes(x_TD, order_N, inverse_N, top_k)
        offsets_e = routing.tokens_per_expert_E.cumsum(0).to(torch.int32)
        handle = LocalHandle(order_N, inverse_N.view(num_tokens, top_k), routing.weights_TK)
        return rows_ND, offsets_e, handle

    def combine(self, y_ND: torch.Tensor, handle: LocalHandle) -> torch.Tensor:
        y_TKD = permute_rows(y_ND, handle.inverse_order_TK.reshape(-1), handle.order_N)
        num_tokens, top_k = handle.inverse_order_TK.shape
        return weighted_sum_of_routes(y_TKD.view(num_tokens, top_k, -1), handle.weights_TK)


class _PermuteRows(torch.autograd.Function):
    """out = x[index] for a permutation `index`; backward is the gather by its inverse (no
    scatter, no atomics, unlike the generic index backward, which sorts)."""

    @staticmethod
    def forward(ctx, x_ND, index_N, inverse_N):  # type: ignore[override]
        ctx.save_for_backward(inverse_N)
        return x_ND[index_N]

    @staticmethod
    def backward(ctx, grad_ND):  # type: ignore[override]
        (inverse_N,) = ctx.saved_tensors
        return grad_ND[inverse_N], None, None


class _GatherRoutes(torch.autograd.Function):
    """rows[n] = x[order[n] // K]: each token copied to its K routes. Backward sums the K route
    gradients of each token: one gather by the inverse order, then a sum over K."""

    @staticmethod
    def forward(ctx, x_TD, order_N, inverse_N, top_k: int):  # type: ignore[override]
        ctx.save_for_backward(inverse_N)
        ctx.top_k = top_k
        return x_TD[order_N // top_k]

    @staticmethod
    def backward(ctx, grad_ND):  # type: ignore[override]
        (inverse_N,) = ctx.saved_tensors
        grad_TKD = grad_ND[inverse_N].view(-1, ctx.top_k, grad_ND.shape[-1])
        return grad_TKD.sum(dim=1), None, None, None


def permute_rows(
    x_ND: torch.Tensor, index_N: torch.Tensor, inverse_N: torch.Tensor
) -> torch.Tensor:
    return _PermuteRows.apply(x_ND, index_N, inverse_N)


def gather_routes(
    x_TD: torch.Tensor, order_N: torch.Tensor, inverse_N: torch.Tensor, top_k: int
) -> torch.Tensor:
    """Expert-ordered rows of the K-times repeated tokens (see `_GatherRoutes`)."""
    return _GatherRoutes.apply(x_TD, order_N, inverse_N, top_k)


def weighted_sum_of_routes(y_TKD: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """sum_k w[t, k] * y[t, k, :] in y's dtype. Elementwise, not a batched product: with K of 2-8
    a bmm runs tiny, slow GEMMs; this is two memory passes, fused into one under compile."""
    return (y_TKD * weights_TK.to(y_TKD.dtype).unsqueeze(-1)).sum(dim=1)
