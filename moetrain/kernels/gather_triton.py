"""Triton kernels for the LocalDispatcher's two data movements, as `torch.library.triton_op`s.

Letters: T tokens, K top-k, N = T*K expert-ordered rows, D model dim. Token t's k-th route sits in
row inverse_TK[t, k], a permutation of range(N) (semantics and plain-torch references:
`moetrain.kernels.gather`).

Two kernels cover both ops and both backwards (one op's forward is the other's backward):
- `_sum_routes_kernel`: out[t] = sum_k src[inverse[t, k]] in fp32 (sum forward, gather backward);
- `_spread_routes_kernel`: rows[inverse[t, k]] = src[t] for every k (gather forward, sum backward).
Both walk tokens, so each token row is read once from memory (the row-order form re-reads it K
times); the writes form a permutation: one writer per element, no atomics, deterministic. Each
program takes BLOCK_R whole rows (wide vector accesses, int64 offsets); rows longer than BLOCK_D
loop over a constexpr number of blocks (runtime bounds trip the interpreter).

The ops are `triton_op` + `wrap_triton` (traced by `torch.compile(fullgraph=True)` without a graph
break) with `register_autograd`. Without Triton nothing is registered. Under TRITON_INTERPRET=1
the ops run eagerly on CPU tensors (their compile path cannot: it would interpret on fakes).
"""

from __future__ import annotations

import torch

from moetrain.kernels.triton_support import interpreting as _interpreting
from moetrain.kernels.triton_support import jit as _jit
from moetrain.kernels.triton_support import tl, triton
from moetrain.kernels.triton_support import triton_available as triton_available

MAX_BLOCK_D = 4096  # longest row block one program holds; longer rows loop over blocks
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --- kernels -----------------------------------------------------------------------------------


@_jit
def _sum_routes_kernel(
    src_ptr, index_ptr, dst_ptr, num_tokens, D, TOP_K: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr, NUM_D_BLOCKS: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    """dst[t] = sum_k src[index[t, k]] for BLOCK_R tokens t."""
    tokens = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    token_mask = tokens < num_tokens
    dst_start = tokens.to(tl.int64) * D
    cols = tl.arange(0, BLOCK_D)
    for db in tl.static_range(NUM_D_BLOCKS):
        c = db * BLOCK_D + cols
        mask = token_mask[:, None] if EVEN_D else token_mask[:, None] & (c[None, :] < D)
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            row = tl.load(index_ptr + tokens * TOP_K + k, mask=token_mask, other=0).to(tl.int64)
            v = tl.load(src_ptr + row[:, None] * D + c[None, :], mask=mask, other=0.0)
            acc += v.to(tl.float32)
        tl.store(dst_ptr + dst_start[:, None] + c[None, :], acc.to(dst_ptr.dtype.element_ty), mask)


@_jit
def _spread_routes_kernel(
    src_ptr, index_ptr, dst_ptr, num_tokens, D, TOP_K: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr, NUM_D_BLOCKS: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    """dst[index[t, k]] = src[t] for BLOCK_R tokens t and every k."""
    tokens = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    token_mask = tokens < num_tokens
    src_start = tokens.to(tl.int64) * D
    cols = tl.arange(0, BLOCK_D)
    if NUM_D_BLOCKS == 1:  # the token's row stays in registers for all K routes
        mask = token_mask[:, None] if EVEN_D else token_mask[:, None] & (cols[None, :] < D)
        v = tl.load(src_ptr + src_start[:, None] + cols[None, :], mask=mask, other=0.0)
    for k in tl.static_range(TOP_K):
        row = tl.load(index_ptr + tokens * TOP_K + k, mask=token_mask, other=0).to(tl.int64)
        for db in tl.static_range(NUM_D_BLOCKS):
            c = db * BLOCK_D + cols
            if NUM_D_BLOCKS > 1:  # long rows: re-read per route, from L1/L2
                mask = token_mask[:, None] if EVEN_D else token_mask[:, None] & (c[None, :] < D)
                v = tl.load(src_ptr + src_start[:, None] + c[None, :], mask=mask, other=0.0)
            tl.store(dst_ptr + row[:, None] * D + c[None, :], v, mask=mask)


# --- launches ----------------------------------------------------------------------------------


def launch_config(D: int, max_block_d: int = MAX_BLOCK_D, tile: int = 4096) -> dict:
    """The whole row in one block up to `max_block_d`, and enough tokens per program to fill a
    tile of `tile` elements; four warps."""
    block_d = min(triton.next_power_of_2(max(D, 1)), max_block_d)
    block_r = max(1, min(64, tile // block_d))
    return dict(
        BLOCK_R=block_r, BLOCK_D=block_d, NUM_D_BLOCKS=triton.cdiv(D, block_d),
        EVEN_D=D % block_d == 0, num_warps=4,
    )  # fmt: skip


def launch_sum_routes(src_ND, inverse_TK, out_TD, config=None, wrap=None):
    """out_TD[t] = sum_k src_ND[inverse_TK[t, k]]. `wrap` is `wrap_triton` inside an op."""
    num_tokens, top_k = inverse_TK.shape
    cfg = dict(config or launch_config(src_ND.shape[1]))
    kernel = wrap(_sum_routes_kernel) if wrap else _sum_routes_kernel
    kernel[(triton.cdiv(num_tokens, cfg["BLOCK_R"]),)](
        src_ND, inverse_TK, out_TD, num_tokens, src_ND.shape[1], TOP_K=top_k, **cfg
    )


def launch_spread_routes(src_TD, inverse_TK, rows_ND, config=None, wrap=None):
    """rows_ND[inverse_TK[t, k]] = src_TD[t] for every k."""
    num_tokens, top_k = inverse_TK.shape
    cfg = dict(config or launch_config(src_TD.shape[1]))
    kernel = wrap(_spread_routes_kernel) if wrap else _spread_routes_kernel
    kernel[(triton.cdiv(num_tokens, cfg["BLOCK_R"]),)](
        src_TD, inverse_TK, rows_ND, num_tokens, src_TD.shape[1], TOP_K=top_k, **cfg
    )


# --- ops ---------------------------------------------------------------------------------------


def _check(name: str, t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not _interpreting():
        raise ValueError(f"{name}: Triton needs a CUDA tensor (or TRITON_INTERPRET=1)")
    if t.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"{name}: rows must be bf16, fp16 or fp32, got {t.dtype}")


def _register_ops() -> None:
    from torch.library import triton_op, wrap_triton

    @triton_op("moetrain::gather_routes", mutates_args=())
    def gather_routes(x_TD: torch.Tensor, inverse_TK: torch.Tensor) -> torch.Tensor:
        """rows[inverse[t, k]] = x[t]: rows[n] = x[order[n] // K]."""
        _check("gather_routes", x_TD)
        x_TD, inverse_TK = x_TD.contiguous(), inverse_TK.contiguous()
        rows_ND = x_TD.new_empty((inverse_TK.numel(), x_TD.shape[1]))
        if rows_ND.numel():
            launch_spread_routes(x_TD, inverse_TK, rows_ND, wrap=wrap_triton)
        return rows_ND

    @triton_op("moetrain::sum_routes", mutates_args=())
    def sum_routes(y_ND: torch.Tensor, inverse_TK: torch.Tensor) -> torch.Tensor:
        """out[t] = sum_k y[inverse[t, k]], fp32 accumulation, in y's dtype."""
        _check("sum_routes", y_ND)
        y_ND, inverse_TK = y_ND.contiguous(), inverse_TK.contiguous()
        out_TD = y_ND.new_empty((inverse_TK.shape[0], y_ND.shape[1]))
        if out_TD.numel():
            launch_sum_routes(y_ND, inverse_TK, out_TD, wrap=wrap_triton)
        return out_TD

    def save_inverse(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    def gather_backward(ctx, grad_ND):
        (inverse_TK,) = ctx.saved_tensors
        return torch.ops.moetrain.sum_routes(grad_ND, inverse_TK), None

    def sum_backward(ctx, grad_TD):
        (inverse_TK,) = ctx.saved_tensors
        return torch.ops.moetrain.gather_routes(grad_TD, inverse_TK), None

    gather_routes.register_autograd(gather_backward, setup_context=save_inverse)
    sum_routes.register_autograd(sum_backward, setup_context=save_inverse)


if triton is not None:
    _register_ops()


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("Triton is not installed: use moetrain.kernels.gather instead")


def gather_routes_triton(x_TD: torch.Tensor, inverse_TK: torch.Tensor) -> torch.Tensor:
    """rows[n] = x[order[n] // K], differentiable in x (op `moetrain::gather_routes`)."""
    _require_triton()
    return torch.ops.moetrain.gather_routes(x_TD, inverse_TK)


def sum_routes_triton(y_ND: torch.Tensor, inverse_TK: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_k y[inverse[t, k]], differentiable in y (op `moetrain::sum_routes`; its
    backward is `moetrain::gather_routes`)."""
    _require_triton()
    return torch.ops.moetrain.sum_routes(y_ND, inverse_TK)
