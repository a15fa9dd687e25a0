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

from moetrain.moe.router import RoutingResult


class Dispatcher(Protocol):
    def dispatch(
        self, x_TD: torch.Tensor, routing: RoutingResult
    ) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, y_ND: torch.Tensor, handle: Any) -> torch.Tensor: ...


@dataclass
class LocalHandle:
    inverse_order_TK: torch.Tensor  # position in the expert-ordered rows of each (token, k) route
    weights_TK: torch.Tensor


class LocalDispatcher:
    """All experts on this device. A stable sort of the T*K routes by expert id gives the row
    order (ties keep token order, so the result is deterministic); one gather builds the rows."""

    def dispatch(
        self, x_TD: torch.Tensor, routing: RoutingResult
    ) -> tuple[torch.Tensor, torch.Tensor, LocalHandle]:
        num_tokens, top_k = routing.expert_ids_TK.shape
        order_N = torch.argsort(routing.expert_ids_TK.reshape(-1), stable=True)
        rows_ND = x_TD[order_N // top_k]
        offsets_e = routing.tokens_per_expert_E.cumsum(0).to(torch.int32)
        inverse_order_TK = torch.empty_like(order_N)
        inverse_order_TK[order_N] = torch.arange(order_N.numel(), device=order_N.device)
        handle = LocalHandle(inverse_order_TK.view(num_tokens, top_k), routing.weights_TK)
        return rows_ND, offsets_e, handle

    def combine(self, y_ND: torch.Tensor, handle: LocalHandle) -> torch.Tensor:
        return weighted_sum_of_routes(y_ND[handle.inverse_order_TK], handle.weights_TK)


def weighted_sum_of_routes(y_TKD: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """sum_k w[t, k] * y[t, k, :] as one batched product, in y's dtype (deterministic; no
    scatter-add atomics)."""
    return torch.bmm(weights_TK.to(y_TKD.dtype).unsqueeze(1), y_TKD).squeeze(1)
