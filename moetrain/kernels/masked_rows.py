"""The expert-parallel dispatchers' row movements, where index -1 is "no row", with the plain-torch
references they are tested against.

Letters: T tokens, K top-k, R rows of a send / receive buffer, M gathered rows, D model dim.

    out_MD = masked_gather(src_RD, index_M, back_R)            # src[index[m]], 0 for -1
    send_RD = gather_tokens(x_TD, token_of_row_R, send_row_TK)  # x[token_of_row[r]], 0 for -1
    y_TD = weighted_route_sum(src_RD, route_row_TK, weights_TK, row_route_R)
                                              # sum_k w[t, k] src[route_row[t, k]], -1 skipped

Each backward is a gather, no scatter-add: `masked_gather`'s is the gather by `back_R` (back[r]:
the position that read row r, or -1), `gather_tokens`' the K-sum by `send_row_TK`,
`weighted_route_sum`'s grad_src[r] = w * g[t] of the route in row r (`row_route_R`, flat t*K + k,
or -1: zero) and grad_w[t, k] = <src[route_row[t, k]], g[t]>. Every output row is written: a row
nobody reads or writes is zero. Sums over K and over D accumulate in float32 (at least) and come
back in the rows' dtype (weights: theirs).

The references append one zero row and index it with -1 (Python's last row): the sink-row layout
the dispatchers had before these kernels. On CUDA with Triton (or under TRITON_INTERPRET=1) the
public functions run `masked_rows_triton`'s ops: one pass per movement, no concatenated copy, the
weights applied inside the K-sum. The gathers are bit-exact copies either way; the sums agree up to
the order of fp32 additions (within one rounding of the rows' dtype).
"""

from __future__ import annotations

import torch

from moetrain.kernels import masked_rows_triton  # noqa: F401 - registers the ops
from moetrain.kernels.gather import weighted_sum_reference
from moetrain.kernels.triton_support import interpreting, triton_available


def _with_zero_row(src: torch.Tensor) -> torch.Tensor:
    return torch.cat([src, src.new_zeros(1, *src.shape[1:])])


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


# --- references --------------------------------------------------------------------------------


class _MaskedGatherReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src_RD, index_M, back_R):  # type: ignore[override]
        ctx.save_for_backward(back_R)
        return _with_zero_row(src_RD)[index_M]

    @staticmethod
    def backward(ctx, grad_MD):  # type: ignore[override]
        (back_R,) = ctx.saved_tensors
        return _with_zero_row(grad_MD)[back_R], None, None


class _GatherTokensReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, token_of_row_R, send_row_TK):  # type: ignore[override]
        ctx.save_for_backward(send_row_TK)
        return _with_zero_row(x_TD)[token_of_row_R]

    @staticmethod
    def backward(ctx, grad_RD):  # type: ignore[override]
        (send_row_TK,) = ctx.saved_tensors
        grad_TD = _with_zero_row(grad_RD)[send_row_TK].to(_acc(grad_RD)).sum(1)
        return grad_TD.to(grad_RD.dtype), None, None


class _WeightedRouteSumReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src_RD, route_row_TK, weights_TK, row_route_R):  # type: ignore[override]
        ctx.save_for_backward(src_RD, route_row_TK, weights_TK, row_route_R)
        return weighted_sum_reference(_with_zero_row(src_RD)[route_row_TK], weights_TK)

    @staticmethod
    def backward(ctx, grad_TD):  # type: ignore[override]
        src_RD, route_row_TK, weights_TK, row_route_R = ctx.saved_tensors
        acc = torch.promote_types(_acc(src_RD), weights_TK.dtype)
        g_T1D = grad_TD.to(acc).unsqueeze(1)
        grad_y_TKD = (weights_TK.to(acc).unsqueeze(-1) * g_T1D).to(src_RD.dtype)
        grad_src = _with_zero_row(grad_y_TKD.flatten(0, 1))[row_route_R]
        y_TKD = _with_zero_row(src_RD)[route_row_TK]
        grad_w = (y_TKD.to(acc) * g_T1D).sum(-1).to(weights_TK.dtype)
        return grad_src, None, grad_w, None


# --- public, differentiable --------------------------------------------------------------------


def _use_triton(t: torch.Tensor) -> bool:
    return triton_available() and (t.is_cuda or interpreting()) and t.dtype in _TRITON_DTYPES


_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def masked_gather(src_RD: torch.Tensor, index_M: torch.Tensor, back_R: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """out[m] = src[index[m]] (zero where index[m] == -1); `back_R` is the inverse map (the
    position that read each src row, or -1), the backward's gather."""
    if _use_triton(src_RD):
        return torch.ops.moetrain.masked_gather(src_RD, index_M, back_R)
    return _MaskedGatherReference.apply(src_RD, index_M, back_R)


def gather_tokens(
    x_TD: torch.Tensor, token_of_row_R: torch.Tensor, send_row_TK: torch.Tensor
) -> torch.Tensor:
    """send[r] = x[token_of_row[r]] (zero where -1); `send_row_TK` is the row of each route (-1:
    dropped), whose K-sum is the backward."""
    if _use_triton(x_TD):
        return torch.ops.moetrain.spread_tokens(x_TD, token_of_row_R, send_row_TK)
    return _GatherTokensReference.apply(x_TD, token_of_row_R, send_row_TK)


def weighted_route_sum(
    src_RD: torch.Tensor,
    route_row_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    row_route_R: torch.Tensor,
) -> torch.Tensor:
    """y[t] = sum_k w[t, k] src[route_row[t, k]] over the routes with a row (fp32 accumulation,
    in src's dtype); `row_route_R` is the route (t * K + k) of each src row, or -1."""
    if _use_triton(src_RD):
        return torch.ops.moetrain.weighted_route_sum(src_RD, route_row_TK, weights_TK, row_route_R)
    return _WeightedRouteSumReference.apply(src_RD, route_row_TK, weights_TK, row_route_R)


def references():
    """The reference implementations by public name (for tests and benchmarks)."""
    return {
        "masked_gather": _MaskedGatherReference.apply,
        "gather_tokens": _GatherTokensReference.apply,
        "weighted_route_sum": _WeightedRouteSumReference.apply,
    }
