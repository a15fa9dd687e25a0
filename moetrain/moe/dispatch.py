"""Dispatchers turn tokens into expert-ordered rows and back.

Letters: T tokens, K top-k, D model dim, N rows handed to the experts, e local experts.

    rows_ND, offsets_e, handle = dispatcher.dispatch(x_TD, routing)
    y_ND = experts(rows_ND, offsets_e, handle.row_weights_N, handle.rows_fp8)
    y_TD = dispatcher.combine(y_ND, handle)

`offsets_e` holds each local expert's cumulative END row (int32, on device), as
`torch._grouped_mm` takes it; rows past `offsets_e[-1]` are padding the experts may leave
unwritten. Each route's result is weighted by its router weight and a token's K results summed;
a dropped route contributes zero. With `handle.row_weights_N` the experts apply the weights
(inside the SwiGLU) and `combine` only sums, keeping no expert outputs for its backward
(LocalDispatcher); with None `combine` weights (the EP dispatchers, whose rows cross ranks
without them). `handle.rows_fp8`: the rows already in row-scaled FP8, or None. The MoE layer
sees only this interface; expert parallelism swaps in dispatchers that move rows between ranks.

moe.overlap runs both in halves so compute runs while rows move: `dispatch_begin(x_TD, routing)`
launches the movement, `dispatch_end(pending)` waits for it on the device (and `combine_begin` /
`combine_end` likewise). A dispatcher that moves nothing works in the begin half.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moetrain.kernels.gather import gather_routes, sum_routes
from moetrain.moe.payload import check_payload, fp8_round_trip
from moetrain.moe.router import RoutingResult
from moetrain.nn.fp8 import quantize_rows_opaque


class DispatchHandle(Protocol):
    # the router weight of each row, for the experts to apply; None: combine applies them
    row_weights_N: torch.Tensor | None
    # the rows in row-scaled FP8 (q e4m3, fp32 scale per row), exactly `quantize_rows(rows)`;
    # None: the experts quantize the rows themselves if they need to
    rows_fp8: tuple[torch.Tensor, torch.Tensor] | None


class Dispatcher(Protocol):
    def dispatch(
        self, x_TD: torch.Tensor, routing: RoutingResult
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]: ...

    def combine(self, y_ND: torch.Tensor, handle: Any) -> torch.Tensor: ...

    def dispatch_begin(self, x_TD: torch.Tensor, routing: RoutingResult) -> Any: ...

    def dispatch_end(self, pending: Any) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]: ...

    def combine_begin(self, y_ND: torch.Tensor, handle: Any) -> Any: ...

    def combine_end(self, pending: Any) -> torch.Tensor: ...


@dataclass
class LocalHandle:
    order_N: torch.Tensor  # flat (token, k) route index of each expert-ordered row
    inverse_order_TK: torch.Tensor  # position in the expert-ordered rows of each (token, k) route
    row_weights_N: torch.Tensor  # router weight of each row (the experts apply it)
    rows_fp8: tuple[torch.Tensor, torch.Tensor] | None = None  # with `fp8_rows`


class LocalDispatcher:
    """All experts on this device. A stable sort of the T*K routes by expert id gives the row
    order (deterministic); the rows move by kernels/gather.py. The experts apply the router
    weights, so `combine` keeps no (T*K, D) expert outputs for its backward. `payload="fp8"`
    applies only the FP8 rounding (to the T token rows, before the K-fold gather), so numerics do
    not depend on expert parallelism. `fp8_rows` (FP8 experts): the handle also carries the rows
    in row-scaled FP8, the T token rows quantized once and gathered as bytes, bit for bit the
    quantization of the T*K rows."""

    def __init__(self, payload: str = "bf16", fp8_rows: bool = False) -> None:
        self.payload = check_payload(payload)
        self.fp8_rows = fp8_rows

    def dispatch(
        self, x_TD: torch.Tensor, routing: RoutingResult
    ) -> tuple[torch.Tensor, torch.Tensor, LocalHandle]:
        num_tokens, top_k = routing.expert_ids_TK.shape
        if self.payload == "fp8":
            x_TD = fp8_round_trip(x_TD)
        num_experts = routing.tokens_per_expert_E.shape[0]
        order_N = sort_routes(routing.expert_ids_TK.reshape(-1), num_experts)
        inverse_TK = inverse_permutation(order_N).view(num_tokens, top_k)
        rows_ND = gather_routes(x_TD, order_N, inverse_TK)
        offsets_e = routing.tokens_per_expert_E.cumsum(0).to(torch.int32)
        row_weights_N = gather_rows(routing.weights_TK.reshape(-1), order_N, inverse_TK.view(-1))
        rows_fp8 = gather_fp8_rows(x_TD, order_N // top_k) if self.fp8_rows else None
        return rows_ND, offsets_e, LocalHandle(order_N, inverse_TK, row_weights_N, rows_fp8)

    def combine(self, y_ND: torch.Tensor, handle: LocalHandle) -> torch.Tensor:
        return sum_routes(y_ND, handle.order_N, handle.inverse_order_TK)

    # the halves (moe.overlap): nothing moves, so begin does the work and end hands it over
    def dispatch_begin(self, x_TD, routing):
        return self.dispatch(x_TD, routing)

    def dispatch_end(self, pending):
        return pending

    def combine_begin(self, y_ND, handle):
        return self.combine(y_ND, handle)

    def combine_end(self, pending):
        return pending


def gather_fp8_rows(x_TD: torch.Tensor, token_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of the rows x_TD[token_N] in row-scaled FP8: the T rows quantized, then their
    bytes and scales gathered. The quantizer is the FP8 experts' own, compiled or not, so the
    bits are theirs. Not differentiable."""
    q_TD, scale_T = quantize_rows_opaque(x_TD.detach())
    q_ND = q_TD.view(torch.uint8)[token_N].view(q_TD.dtype)
    return q_ND, scale_T[token_N]


def sort_routes(expert_ids_N: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The stable order of the routes by expert id. The ids are narrowed to the smallest integer
    type that holds them first: a GPU radix sort makes one pass per 8 key bits, so uint8 keys take
    1 pass where int64 ids take 8."""
    key_dtype = torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 2**15 else None
    keys_N = expert_ids_N if key_dtype is None else expert_ids_N.to(key_dtype)
    return torch.argsort(keys_N, stable=True)


def inverse_permutation(order_N: torch.Tensor) -> torch.Tensor:
    """inverse[order[i]] = i: one scatter of distinct indices (deterministic; no sort)."""
    positions_N = torch.arange(order_N.shape[0], device=order_N.device, dtype=order_N.dtype)
    return torch.empty_like(order_N).scatter_(0, order_N, positions_N)


class _GatherRows(torch.autograd.Function):
    """`gather_rows(src, index, back)`: out[m] = src[index[m]], no src row read twice except rows
    whose gradient is dropped (padding, a sink). Backward, a gather: grad_src[r] =
    grad_out[back[r]], back[r] = the position that read row r, or len(index) (a zero row).
    Indexing's own backward would scatter-add (a sort on GPU, serialized on the sink row)."""

    @staticmethod
    def forward(ctx, src, index, back):  # type: ignore[override]
        ctx.save_for_backward(back)
        return src[index]

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        (back,) = ctx.saved_tensors
        padded = torch.cat([grad_out, grad_out.new_zeros(1, *grad_out.shape[1:])])
        return padded[back], None, None


gather_rows = _GatherRows.apply
