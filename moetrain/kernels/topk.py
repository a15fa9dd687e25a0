"""The router's expert choice: top-k experts per token and routes per expert, in one Triton pass.

Letters: T tokens, E experts, K top-k. `route_topk(scores_TE, k)` returns `ids_TK` (int64, each
token's K highest-scoring experts, highest first, as `torch.topk`) and `counts_E` (int64, routes
per expert). Each program holds BLOCK_T whole rows, takes K arg-maxes (masking each winner) and
adds its per-expert tally with one integer atomic per expert (exact in any order:
deterministic). Ties go to the lower expert index. On CUDA with Triton the op is
`moetrain::route_topk` (a `triton_op`); elsewhere the reference (`torch.topk` and a
scatter-add). No gradient: the router gathers its weights from the scores afterwards.
"""

from __future__ import annotations

import torch

from moetrain.kernels.triton_support import interpreting as _interpreting
from moetrain.kernels.triton_support import jit as _jit
from moetrain.kernels.triton_support import tl, triton

MAX_EXPERTS = 1024  # whole rows live in registers; more experts take the reference


def route_topk_reference(scores_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids_TK = scores_TE.topk(k, dim=-1).indices
    flat = ids_TK.reshape(-1)
    counts_E = torch.zeros(scores_TE.shape[1], dtype=torch.int64, device=flat.device)
    return ids_TK, counts_E.scatter_add_(0, flat, torch.ones_like(flat))


@_jit
def _route_topk_kernel(
    scores_ptr, ids_ptr, counts_ptr, T, E,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    token_ok = tokens < T
    mask = token_ok[:, None] & (experts[None, :] < E)
    offs = tokens.to(tl.int64)[:, None] * E + experts[None, :]
    s = tl.load(scores_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    tally = tl.zeros([BLOCK_E], dtype=tl.int32)
    for k in tl.static_range(K):
        best = tl.argmax(s, axis=1)  # first index among equal maxima
        tl.store(ids_ptr + tokens.to(tl.int64) * K + k, best.to(tl.int64), mask=token_ok)
        won = (experts[None, :] == best[:, None]) & token_ok[:, None]
        tally += tl.sum(won.to(tl.int32), axis=0)
        s = tl.where(won, float("-inf"), s)
    tl.atomic_add(counts_ptr + experts, tally, mask=(experts < E) & (tally > 0))


def _launch(scores_TE: torch.Tensor, k: int, ids_TK, counts32_E, wrap=None) -> None:
    T, E = scores_TE.shape
    block_e = triton.next_power_of_2(E)
    block_t = max(1, min(64, 4096 // block_e))
    kernel = wrap(_route_topk_kernel) if wrap else _route_topk_kernel
    kernel[(triton.cdiv(T, block_t),)](
        scores_TE, ids_TK, counts32_E, T, E, K=k, BLOCK_T=block_t, BLOCK_E=block_e, num_warps=4
    )


def _register_op() -> None:
    from torch.library import triton_op, wrap_triton

    @triton_op("moetrain::route_topk", mutates_args=())
    def route_topk_op(scores_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        scores_TE = scores_TE.contiguous()
        T, E = scores_TE.shape
        ids_TK = scores_TE.new_empty((T, k), dtype=torch.int64)
        counts32_E = scores_TE.new_zeros((E,), dtype=torch.int32)
        if T:
            _launch(scores_TE, k, ids_TK, counts32_E, wrap=wrap_triton)
        return ids_TK, counts32_E.to(torch.int64)


if triton is not None:
    _register_op()


def route_topk(scores_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_TK, counts_E) of the module docstring; `scores_TE` is detached first."""
    T, E = scores_TE.shape
    if not 1 <= k <= E:
        raise ValueError(f"route_topk: k must be in [1, {E}], got {k}")
    fast = triton is not None and E <= MAX_EXPERTS and scores_TE.dtype == torch.float32
    if fast and (scores_TE.is_cuda or _interpreting()):
        return torch.ops.moetrain.route_topk(scores_TE.detach(), k)
    return route_topk_reference(scores_TE.detach(), k)
