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
without them). `handle.rows_fp8`: the rows already in row-scaled FP8, or (None, None); `payload`:
what the rows travel as (moe/payload.py; the precision plan installs it). The MoE layer
sees only this interface; expert parallelism swaps in dispatchers that move rows between ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moetrain.kernels.gather import gather_routes, sum_routes
from moetrain.moe.experts import NO_FP8_ROWS, FP8Rows
from moetrain.moe.payload import BF16_PAYLOAD, Payload
from moetrain.moe.router import RoutingResult


class DispatchHandle(Protocol):
    # the router weight of each row, for the experts to apply; None: combine applies them
    row_weights_N: torch.Tensor | None
    # the rows in row-scaled FP8 (q e4m3, fp32 scale per row), exactly `quantize_rows(rows)`;
    # (None, None): the experts quantize the rows themselves if they need to
    rows_fp8: FP8Rows


class Dispatcher(Protocol):
    payload: Payload  # what the dispatched rows travel as (precision.dispatch)

    def dispatch(
        self, x_TD: torch.Tensor, routing: RoutingResult
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]: ...

    def combine(self, y_ND: torch.Tensor, handle: Any) -> torch.Tensor: ...


@dataclass
class LocalHandle:
    order_N: torch.Tensor  # flat (token, k) route index of each expert-ordered row
    inverse_order_TK: torch.Tensor  # position in the expert-ordered rows of each (token, k) route
    row_weights_N: torch.Tensor  # router weight of each row (the experts apply it)
    rows_fp8: FP8Rows = NO_FP8_ROWS  # `quantized_rows`'


def no_quantized_rows(x_TD: torch.Tensor, order_N: torch.Tensor, top_k: int) -> FP8Rows:
    return NO_FP8_ROWS


class LocalDispatcher:
    """All experts on this device. A stable sort of the T*K routes by expert id gives the row
    order (deterministic); the rows move by kernels/gather.py. The experts apply the router
    weights, so `combine` keeps no (T*K, D) expert outputs for its backward. The payload's
    `round_trip` applies only its rounding (to the T token rows, before the K-fold gather), so
    numerics do not depend on expert parallelism. `quantized_rows` (the experts' GEMM's, set
    with it: `GroupedGemm.quantized_rows`) gives the handle's `rows_fp8` from the T token rows
    and the row order: for FP8 experts the T rows quantized once and gathered as bytes, bit for
    bit the quantization of the T*K rows."""

    def __init__(
        self,
        payload: Payload = BF16_PAYLOAD,
        quantized_rows: Callable[[torch.Tensor, torch.Tensor, int], FP8Rows] = no_quantized_rows,
    ) -> None:
        self.payload = payload
        self.quantized_rows = quantized_rows

    def dispatch(
        self, x_TD: torch.Tensor, routing: RoutingResult
    ) -> tuple[torch.Tensor, torch.Tensor, LocalHandle]:
        num_tokens, top_k = routing.expert_ids_TK.shape
        x_TD = self.payload.round_trip(x_TD)
        num_experts = routing.tokens_per_expert_E.shape[0]
        order_N = sort_routes(routing.expert_ids_TK.reshape(-1), num_experts)
        inverse_TK = inverse_permutation(order_N).view(num_tokens, top_k)
        rows_ND = gather_routes(x_TD, order_N, inverse_TK)
        offsets_e = routing.tokens_per_expert_E.cumsum(0).to(torch.int32)
        row_weights_N = gather_rows(routing.weights_TK.reshape(-1), order_N, inverse_TK.view(-1))
        rows_fp8 = self.quantized_rows(x_TD, order_N, top_k)
        return rows_ND, offsets_e, LocalHandle(order_N, inverse_TK, row_weights_N, rows_fp8)

    def combine(self, y_ND: torch.Tensor, handle: LocalHandle) -> torch.Tensor:
        return sum_routes(y_ND, handle.order_N, handle.inverse_order_TK)


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
