"""Triton kernels for the expert-parallel dispatchers' row movements, as `torch.library.triton_op`s.

Letters: T tokens, K top-k, R rows of a send / receive buffer, D model dim. Index -1 means "no
row": a gather reads zero for it, a sum skips it (semantics and plain-torch references:
`moetrain.kernels.masked_rows`). Kernels:
- `_gather_kernel`: dst[m] = src[index[m]] (0 where index[m] < 0), every dst row written once;
- `_route_sum_kernel`: dst[t] = sum_k w[t, k] src[index[t, k]] (w = 1 without weights), fp32;
- `_spread_kernel`: dst[index[t, k]] = src[t] for kept routes, then `_zero_rows_kernel` zeroes
  the rows nobody writes (flag < 0): the token rows are read once, not K times;
- `_route_sum_backward_kernel`: grad_src[index[t, k]] = w[t, k] g[t] and
  grad_w[t, k] = <src[index[t, k]], g[t]> in one walk over the tokens.
Unique write targets (the indices are injective on kept routes): no atomics, deterministic. Launch
shapes follow `gather_triton.launch_config`. Without Triton nothing is registered; under
TRITON_INTERPRET=1 the ops run eagerly on CPU tensors.
"""

from __future__ import annotations

import torch

from moetrain.kernels.gather_triton import launch_config
from moetrain.kernels.triton_support import interpreting as _interpreting
from moetrain.kernels.triton_support import jit as _jit
from moetrain.kernels.triton_support import tl, triton

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@_jit
def _gather_kernel(
    src_ptr, index_ptr, dst_ptr, num_rows, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_D_BLOCKS: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    """dst[m] = src[index[m]] for BLOCK_R rows m; zero where index[m] < 0."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < num_rows
    src_row = tl.load(index_ptr + rows, mask=row_mask, other=-1).to(tl.int64)
    read_mask = row_mask & (src_row >= 0)
    dst_start = rows.to(tl.int64) * D
    cols = tl.arange(0, BLOCK_D)
    for db in tl.static_range(NUM_D_BLOCKS):
        c = db * BLOCK_D + cols
        col_mask = c[None, :] < D
        store_mask = row_mask[:, None] if EVEN_D else row_mask[:, None] & col_mask
        load_mask = read_mask[:, None] if EVEN_D else read_mask[:, None] & col_mask
        v = tl.load(src_ptr + src_row[:, None] * D + c[None, :], mask=load_mask, other=0.0)
        tl.store(dst_ptr + dst_start[:, None] + c[None, :], v, store_mask)


@_jit
def _route_sum_kernel(
    src_ptr, index_ptr, weight_ptr, dst_ptr, num_tokens, D, TOP_K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_D_BLOCKS: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    """dst[t] = sum_k w[t, k] * src[index[t, k]] over the k with index >= 0, in fp32."""
    tokens = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    token_mask = tokens < num_tokens
    dst_start = tokens.to(tl.int64) * D
    cols = tl.arange(0, BLOCK_D)
    for db in tl.static_range(NUM_D_BLOCKS):
        c = db * BLOCK_D + cols
        col_mask = c[None, :] < D
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            row = tl.load(index_ptr + tokens * TOP_K + k, mask=token_mask, other=-1).to(tl.int64)
            keep = token_mask & (row >= 0)
            mask = keep[:, None] if EVEN_D else keep[:, None] & col_mask
            v = tl.load(src_ptr + row[:, None] * D + c[None, :], mask=mask, other=0.0)
            if HAS_WEIGHTS:
                w = tl.load(weight_ptr + tokens * TOP_K + k, mask=keep, other=0.0)
                acc += v.to(tl.float32) * w.to(tl.float32)[:, None]
            else:
                acc += v.to(tl.float32)
        out_mask = token_mask[:, None] if EVEN_D else token_mask[:, None] & col_mask
        out = acc.to(dst_ptr.dtype.element_ty)
        tl.store(dst_ptr + dst_start[:, None] + c[None, :], out, out_mask)


@_jit
def _spread_kernel(
    src_ptr, index_ptr, dst_ptr, num_tokens, D, TOP_K: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr, NUM_D_BLOCKS: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    """dst[index[t, k]] = src[t] for BLOCK_R tokens t and every k with index >= 0."""
    tokens = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    token_mask = tokens < num_tokens
    src_start = tokens.to(tl.int64) * D
    cols = tl.arange(0, BLOCK_D)
    for k in tl.static_range(TOP_K):
        row = tl.load(index_ptr + tokens * TOP_K + k, mask=token_mask, other=-1).to(tl.int64)
        keep = token_mask & (row >= 0)
        for db in tl.static_range(NUM_D_BLOCKS):
            c = db * BLOCK_D + cols
            mask = keep[:, None] if EVEN_D else keep[:, None] & (c[None, :] < D)
            v = tl.load(src_ptr + src_start[:, None] + c[None, :], mask=mask, other=0.0)
            tl.store(dst_ptr + row[:, None] * D + c[None, :], v, mask=mask)


@_jit
def _zero_rows_kernel(
    flag_ptr, dst_ptr, num_rows, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_D_BLOCKS: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    """dst[m] = 0 for the rows m with flag[m] < 0 (the others are left as they are)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < num_rows
    empty = row_mask & (tl.load(flag_ptr + rows, mask=row_mask, other=0) < 0)
    dst_start = rows.to(tl.int64) * D
    cols = tl.arange(0, BLOCK_D)
    for db in tl.static_range(NUM_D_BLOCKS):
        c = db * BLOCK_D + cols
        mask = empty[:, None] if EVEN_D else empty[:, None] & (c[None, :] < D)
        zero = tl.zeros([BLOCK_R, BLOCK_D], dtype=dst_ptr.dtype.element_ty)
        tl.store(dst_ptr + dst_start[:, None] + c[None, :], zero, mask)


@_jit
def _route_sum_backward_kernel(
    src_ptr, index_ptr, weight_ptr, grad_ptr, grad_src_ptr, grad_w_ptr, num_tokens, D,
    TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_D_BLOCKS: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    """For each route (t, k) with row = index[t, k] >= 0: grad_src[row] = w[t, k] * g[t] and
    grad_w[t, k] = sum_d src[row, d] g[t, d] (fp32); grad_w is 0 for the others."""
    tokens = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    token_mask = tokens < num_tokens
    g_start = tokens.to(tl.int64) * D
    cols = tl.arange(0, BLOCK_D)
    if NUM_D_BLOCKS == 1:  # the token's gradient row stays in registers for all K routes
        mask = token_mask[:, None] if EVEN_D else token_mask[:, None] & (cols[None, :] < D)
        g = tl.load(grad_ptr + g_start[:, None] + cols[None, :], mask=mask, other=0.0)
        g = g.to(tl.float32)
    for k in tl.static_range(TOP_K):
        row = tl.load(index_ptr + tokens * TOP_K + k, mask=token_mask, other=-1).to(tl.int64)
        keep = token_mask & (row >= 0)
        w = tl.load(weight_ptr + tokens * TOP_K + k, mask=keep, other=0.0).to(tl.float32)
        dot = tl.zeros([BLOCK_R], dtype=tl.float32)
        for db in tl.static_range(NUM_D_BLOCKS):
            c = db * BLOCK_D + cols
            mask = keep[:, None] if EVEN_D else keep[:, None] & (c[None, :] < D)
            if NUM_D_BLOCKS > 1:  # long rows: re-read per route, from L1/L2
                g = tl.load(grad_ptr + g_start[:, None] + c[None, :], mask=mask, other=0.0)
                g = g.to(tl.float32)
            s = tl.load(src_ptr + row[:, None] * D + c[None, :], mask=mask, other=0.0)
            dot += tl.sum(s.to(tl.float32) * g, axis=1)
            grad = (g * w[:, None]).to(grad_src_ptr.dtype.element_ty)
            tl.store(grad_src_ptr + row[:, None] * D + c[None, :], grad, mask)
        tl.store(grad_w_ptr + tokens * TOP_K + k, dot.to(grad_w_ptr.dtype.element_ty), token_mask)


# --- launches ----------------------------------------------------------------------------------


def _grid(n: int, cfg: dict) -> tuple[int]:
    return (triton.cdiv(n, cfg["BLOCK_R"]),)


def launch_gather(src_RD, index_M, dst_MD, wrap=None):
    cfg = launch_config(src_RD.shape[1])
    kernel = wrap(_gather_kernel) if wrap else _gather_kernel
    kernel[_grid(index_M.numel(), cfg)](src_RD, index_M, dst_MD, index_M.numel(), src_RD.shape[1], **cfg)  # fmt: skip


def launch_route_sum(src_RD, index_TK, weights_TK, dst_TD, wrap=None):
    num_tokens, top_k = index_TK.shape
    cfg = launch_config(src_RD.shape[1])
    kernel = wrap(_route_sum_kernel) if wrap else _route_sum_kernel
    has_weights = weights_TK is not None
    kernel[_grid(num_tokens, cfg)](
        src_RD, index_TK, weights_TK if has_weights else index_TK, dst_TD, num_tokens,
        src_RD.shape[1], TOP_K=top_k, HAS_WEIGHTS=has_weights, **cfg,
    )  # fmt: skip


def launch_spread(src_TD, index_TK, flag_R, dst_RD, wrap=None):
    num_tokens, top_k = index_TK.shape
    D = src_TD.shape[1]
    cfg = launch_config(D)
    spread = wrap(_spread_kernel) if wrap else _spread_kernel
    zero = wrap(_zero_rows_kernel) if wrap else _zero_rows_kernel
    if num_tokens:
        spread[_grid(num_tokens, cfg)](src_TD, index_TK, dst_RD, num_tokens, D, TOP_K=top_k, **cfg)
    if flag_R.numel():
        zero[_grid(flag_R.numel(), cfg)](flag_R, dst_RD, flag_R.numel(), D, **cfg)


def launch_route_sum_backward(src_RD, index_TK, weights_TK, grad_TD, row_route_R, grad_src_RD,
                              grad_w_TK, wrap=None):  # fmt: skip
    num_tokens, top_k = index_TK.shape
    D = src_RD.shape[1]
    cfg = launch_config(D)
    kernel = wrap(_route_sum_backward_kernel) if wrap else _route_sum_backward_kernel
    zero = wrap(_zero_rows_kernel) if wrap else _zero_rows_kernel
    if num_tokens:
        kernel[_grid(num_tokens, cfg)](
            src_RD, index_TK, weights_TK, grad_TD, grad_src_RD, grad_w_TK, num_tokens, D,
            TOP_K=top_k, **cfg,
        )  # fmt: skip
    if row_route_R.numel():
        zero[_grid(row_route_R.numel(), cfg)](
            row_route_R, grad_src_RD, row_route_R.numel(), D, **cfg
        )


# --- ops ---------------------------------------------------------------------------------------


def _check(name: str, t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not _interpreting():
        raise ValueError(f"{name}: Triton needs a CUDA tensor (or TRITON_INTERPRET=1)")
    if t.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"{name}: rows must be bf16, fp16 or fp32, got {t.dtype}")


def _register_ops() -> None:
    from torch.library import triton_op, wrap_triton

    @triton_op("moetrain::masked_gather", mutates_args=())
    def masked_gather(src_RD: torch.Tensor, index_M: torch.Tensor, back_R: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """out[m] = src[index[m]], zero where index[m] < 0 (back: the backward's index)."""
        _check("masked_gather", src_RD)
        src_RD, index_M = src_RD.contiguous(), index_M.contiguous()
        out_MD = src_RD.new_empty((index_M.numel(), src_RD.shape[1]))
        if out_MD.numel():
            launch_gather(src_RD, index_M, out_MD, wrap=wrap_triton)
        return out_MD

    @triton_op("moetrain::spread_tokens", mutates_args=())
    def spread_tokens(x_TD: torch.Tensor, token_of_row_R: torch.Tensor, send_row_TK: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """out[send_row[t, k]] = x[t]; rows with token_of_row < 0 are zero."""
        _check("spread_tokens", x_TD)
        x_TD, send_row_TK = x_TD.contiguous(), send_row_TK.contiguous()
        out_RD = x_TD.new_empty((token_of_row_R.numel(), x_TD.shape[1]))
        if out_RD.numel():
            launch_spread(x_TD, send_row_TK, token_of_row_R.contiguous(), out_RD, wrap=wrap_triton)
        return out_RD

    @triton_op("moetrain::masked_route_sum", mutates_args=())
    def masked_route_sum(src_RD: torch.Tensor, index_TK: torch.Tensor) -> torch.Tensor:
        """out[t] = sum_k src[index[t, k]] over index >= 0 (fp32 accumulation)."""
        _check("masked_route_sum", src_RD)
        src_RD, index_TK = src_RD.contiguous(), index_TK.contiguous()
        out_TD = src_RD.new_empty((index_TK.shape[0], src_RD.shape[1]))
        if out_TD.numel():
            launch_route_sum(src_RD, index_TK, None, out_TD, wrap=wrap_triton)
        return out_TD

    @triton_op("moetrain::weighted_route_sum", mutates_args=())
    def weighted_route_sum(src_RD: torch.Tensor, index_TK: torch.Tensor, weights_TK: torch.Tensor, row_route_R: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """out[t] = sum_k w[t, k] src[index[t, k]] over index >= 0 (fp32 accumulation)."""
        _check("weighted_route_sum", src_RD)
        src_RD, index_TK = src_RD.contiguous(), index_TK.contiguous()
        out_TD = src_RD.new_empty((index_TK.shape[0], src_RD.shape[1]))
        if out_TD.numel():
            launch_route_sum(src_RD, index_TK, weights_TK.contiguous(), out_TD, wrap=wrap_triton)
        return out_TD

    @triton_op("moetrain::weighted_route_sum_backward", mutates_args=())
    def weighted_route_sum_backward(src_RD: torch.Tensor, index_TK: torch.Tensor, weights_TK: torch.Tensor, row_route_R: torch.Tensor, grad_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(grad_src, grad_weights) of `weighted_route_sum`."""
        src_RD, index_TK, grad_TD = src_RD.contiguous(), index_TK.contiguous(), grad_TD.contiguous()
        grad_src_RD = torch.empty_like(src_RD)
        grad_w_TK = torch.empty_like(weights_TK, memory_format=torch.contiguous_format)
        if src_RD.shape[1] == 0:
            return grad_src_RD, grad_w_TK.zero_()
        launch_route_sum_backward(
            src_RD, index_TK, weights_TK.contiguous(), grad_TD, row_route_R.contiguous(),
            grad_src_RD, grad_w_TK, wrap=wrap_triton,
        )  # fmt: skip
        return grad_src_RD, grad_w_TK

    def save_back(ctx, inputs, output):
        ctx.save_for_backward(inputs[2])

    def gather_backward(ctx, grad_MD):
        (back_R,) = ctx.saved_tensors
        return torch.ops.moetrain.masked_gather(grad_MD, back_R, back_R), None, None

    def spread_backward(ctx, grad_RD):
        (send_row_TK,) = ctx.saved_tensors
        return torch.ops.moetrain.masked_route_sum(grad_RD, send_row_TK), None, None

    def save_route_sum(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def route_sum_backward(ctx, grad_TD):
        src_RD, index_TK, weights_TK, row_route_R = ctx.saved_tensors
        grad_src, grad_w = torch.ops.moetrain.weighted_route_sum_backward(
            src_RD, index_TK, weights_TK, row_route_R, grad_TD
        )
        return grad_src, None, grad_w, None

    masked_gather.register_autograd(gather_backward, setup_context=save_back)
    spread_tokens.register_autograd(spread_backward, setup_context=save_back)
    weighted_route_sum.register_autograd(route_sum_backward, setup_context=save_route_sum)


if triton is not None:
    _register_ops()
