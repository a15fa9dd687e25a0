"""Attention's qk-norm and RoPE fused in one Triton kernel each way, as `torch.library.triton_op`s
`moetrain::qk_norm_rope` and `moetrain::qk_norm_rope_backward` (plain-torch twin:
`moetrain.nn.attention.qk_norm_rope_reference`).

Letters: B batch, S sequence, N heads, H head dim, D = N*H, M = B*S rows, C = D/2 rotation pairs,
P programs. x_BSD is a q or k projection; the RMSNorm runs over the whole row (all heads), then
each head's halves [a | b] rotate by the angle of the row's position s (its index along S), with
the fp32 tables cos_SH, sin_SH of `RotaryEmbedding` (S, H/2):

    a', b' = (x * rstd * weight) at columns n*H + i and n*H + H/2 + i     # pair c = n*H/2 + i
    y_a = a' cos - b' sin,  y_b = b' cos + a' sin                         # fp32, rounded once

The backward rotates grad_y back (g_a = gy_a cos + gy_b sin, g_b = gy_b cos - gy_a sin) and runs
the RMSNorm backward on g: grad_x = rstd * (gw - x_hat * mean(gw *
x_hat)), gw = g * weight, x_hat = x * rstd; grad_weight = sum over rows of g * x_hat.

Inductor's version rounds q to bf16 between norm and RoPE and splits each direction into several
kernels (58 us forward; 61 + 2 x 36 us backward per layer of `small`, M = 16384, D = 1024, bf16,
on an H200). Each program here holds a 2-D tile of BLOCK_M rows x BLOCK_C pairs, whole rows up to
MAX_D (TILE elements a tile, 16 a thread). The forward reads x once and writes y
and the row's fp32 rstd (4 bytes an element for bf16: 67 MB, ~14 us at 4.8 TB/s for q at D =
1024, as much again for k); the backward reads grad_y and x once and writes grad_x (6 bytes: 100
MB, ~21 us each for q and k), walking TILES_PER_PROGRAM tiles with an fp32 grad_weight
accumulator that lands in row p of a (P, D) buffer the op sums (2 MB; no atomics, deterministic).
The tables (256 KB each at S = 2048) are re-read per head from L1/L2, not from memory. Measured
in the `small` step on the H200: 31 us forward and 37 us backward per tensor (about half of the
bandwidth; 136 against 191 us a layer before). A pair's columns are contiguous within a half head, so
with H/2 a multiple of 8 loads and stores are 16-byte vectors. Row offsets are int64; pair tails
(C not a power of two) are masked.

The kernels call no other jitted function (torch's mutation analysis of user kernels gives up on
calls and would mark every argument as written). Autograd saves x, weight, rstd and the tables,
not y. Without Triton the module imports and registers nothing.
"""

from __future__ import annotations

import functools

import torch

from moetrain.kernels.triton_support import interpreting as _interpreting
from moetrain.kernels.triton_support import jit as _jit
from moetrain.kernels.triton_support import tl, triton
from moetrain.kernels.triton_support import triton_available as triton_available

MAX_D = 8192  # longest row one program holds in registers; longer rows take the torch path
TILE = 2048  # elements of a tensor a program holds at once: 16 a thread, ~90 registers on sm_90
WARPS_PER_SM = 16  # the grid: four programs of four warps an SM (or two of 8, one of 16)
_INTERPRETER_PROGRAMS = 2  # the interpreter runs programs in turn: two still test the partials
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@_jit
def _qk_norm_rope_forward_kernel(
    x_ptr, weight_ptr, cos_ptr, sin_ptr, y_ptr, rstd_ptr,
    num_rows, seq_len, D, stride_x, stride_table, eps,
    HALF_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, EVEN_C: tl.constexpr,
):  # fmt: skip
    """y and rstd of BLOCK_M rows."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < num_rows
    pairs = tl.arange(0, BLOCK_C)
    pair_mask = pairs < D // 2
    freq = pairs % HALF_H
    col_a = (pairs // HALF_H) * (2 * HALF_H) + freq  # b sits HALF_H columns later
    mask = row_mask[:, None] if EVEN_C else row_mask[:, None] & pair_mask[None, :]
    a_ptrs = x_ptr + rows[:, None] * stride_x + col_a[None, :]
    a = tl.load(a_ptrs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(a_ptrs + HALF_H, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(a * a + b * b, axis=1) / D + eps)
    w_a = tl.load(weight_ptr + col_a, mask=pair_mask, other=0.0).to(tl.float32)
    w_b = tl.load(weight_ptr + col_a + HALF_H, mask=pair_mask, other=0.0).to(tl.float32)
    a = a * rstd[:, None] * w_a[None, :]
    b = b * rstd[:, None] * w_b[None, :]
    table = (rows % seq_len)[:, None] * stride_table + freq[None, :]
    cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + table, mask=mask, other=0.0)
    y_ptrs = y_ptr + rows[:, None] * D + col_a[None, :]
    tl.store(y_ptrs, (a * cos - b * sin).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptrs + HALF_H, (b * cos + a * sin).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@_jit
def _qk_norm_rope_backward_kernel(
    grad_y_ptr, x_ptr, weight_ptr, rstd_ptr, cos_ptr, sin_ptr, grad_x_ptr, partial_ptr,
    num_rows, seq_len, D, stride_grad_y, stride_x, stride_table,
    HALF_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr, EVEN_C: tl.constexpr,
):  # fmt: skip
    """grad_x of TILES_PER_PROGRAM tiles of BLOCK_M rows; the tiles' grad_weight in partial[p]."""
    pid = tl.program_id(0)
    pairs = tl.arange(0, BLOCK_C)
    pair_mask = pairs < D // 2
    freq = pairs % HALF_H
    col_a = (pairs // HALF_H) * (2 * HALF_H) + freq
    w_a = tl.load(weight_ptr + col_a, mask=pair_mask, other=0.0).to(tl.float32)
    w_b = tl.load(weight_ptr + col_a + HALF_H, mask=pair_mask, other=0.0).to(tl.float32)
    grad_w_a = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    grad_w_b = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    first_row = pid * (TILES_PER_PROGRAM * BLOCK_M)
    for tile in range(TILES_PER_PROGRAM):
        rows = (first_row + tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < num_rows
        mask = row_mask[:, None] if EVEN_C else row_mask[:, None] & pair_mask[None, :]
        gy_ptrs = grad_y_ptr + rows[:, None] * stride_grad_y + col_a[None, :]
        gy_a = tl.load(gy_ptrs, mask=mask, other=0.0).to(tl.float32)
        gy_b = tl.load(gy_ptrs + HALF_H, mask=mask, other=0.0).to(tl.float32)
        x_ptrs = x_ptr + rows[:, None] * stride_x + col_a[None, :]
        x_a = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        x_b = tl.load(x_ptrs + HALF_H, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        table = (rows % seq_len)[:, None] * stride_table + freq[None, :]
        cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + table, mask=mask, other=0.0)
        g_a = gy_a * cos + gy_b * sin  # the transposed rotation
        g_b = gy_b * cos - gy_a * sin
        x_a = x_a * rstd[:, None]  # x_hat
        x_b = x_b * rstd[:, None]
        gw_a = g_a * w_a[None, :]
        gw_b = g_b * w_b[None, :]
        mean = tl.sum(gw_a * x_a + gw_b * x_b, axis=1) / D
        grad_a = rstd[:, None] * (gw_a - x_a * mean[:, None])
        grad_b = rstd[:, None] * (gw_b - x_b * mean[:, None])
        grad_x_ptrs = grad_x_ptr + rows[:, None] * D + col_a[None, :]
        tl.store(grad_x_ptrs, grad_a.to(grad_x_ptr.dtype.element_ty), mask=mask)
        tl.store(grad_x_ptrs + HALF_H, grad_b.to(grad_x_ptr.dtype.element_ty), mask=mask)
        grad_w_a += g_a * x_a
        grad_w_b += g_b * x_b
    partial_ptrs = partial_ptr + pid * D + col_a
    tl.store(partial_ptrs, tl.sum(grad_w_a, axis=0), mask=pair_mask)
    tl.store(partial_ptrs + HALF_H, tl.sum(grad_w_b, axis=0), mask=pair_mask)


def tiles_per_program(num_rows: int, block_m: int, num_programs: int) -> int:
    """Tiles of `block_m` rows that each of `num_programs` walks to cover `num_rows`, rounded up
    to a power of two (few variants compile). A symbolic row count (torch.compile's dynamic
    shapes) is specialized: the tile count is a constexpr."""
    num_tiles = max(1, triton.cdiv(int(num_rows), block_m))
    return triton.next_power_of_2(triton.cdiv(num_tiles, num_programs))


def num_warps_for(tile_elements: int) -> int:
    """16 elements of a tensor a thread, four warps at least (one row of 8192: 16 warps)."""
    return max(4, min(16, tile_elements // 512))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_programs(D: int, num_rows: int, device: torch.device) -> int:
    """Backward programs: WARPS_PER_SM warps an SM, all resident at once (at ~90 registers a
    thread five programs of four warps fit), so no program waits for a second wave; fewer where
    the rows run out."""
    num_rows = int(num_rows)  # specialized, as in `tiles_per_program`
    cfg = launch_config(D)
    if device.type == "cuda":
        max_programs = WARPS_PER_SM * _sm_count(device.index or 0) // cfg["num_warps"]
    else:
        max_programs = _INTERPRETER_PROGRAMS
    rows = cfg["BLOCK_M"] * tiles_per_program(num_rows, cfg["BLOCK_M"], max_programs)
    return max(1, triton.cdiv(num_rows, rows))


def rows_of(name: str, t: torch.Tensor, D: int) -> torch.Tensor:
    """t as (rows, D), contiguous in its last dim (the kernels take any row stride)."""
    if t.device.type == "cpu" and not _interpreting():
        raise ValueError(f"{name}: Triton needs a CUDA tensor (or TRITON_INTERPRET=1)")
    if t.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name}: expected bf16, fp16 or fp32, got {t.dtype}")
    if D > MAX_D:
        raise ValueError(f"{name}: rows of {D} > MAX_D = {MAX_D} elements")
    t = t.reshape(-1, D)
    return t if t.stride(1) == 1 else t.contiguous()


def launch_config(D: int, tile: int = TILE) -> dict:
    """All D/2 pairs of a row and enough rows to fill `tile` elements (the backward adds
    TILES_PER_PROGRAM)."""
    block_c = triton.next_power_of_2(max(D // 2, 1))
    block_m = max(1, min(64, tile // (2 * block_c)))
    return dict(
        BLOCK_M=block_m, BLOCK_C=block_c, EVEN_C=D == 2 * block_c,
        num_warps=num_warps_for(2 * block_m * block_c),
    )  # fmt: skip


def launch_qk_norm_rope_forward(
    x_MD, weight_D, cos_SH, sin_SH, y_MD, rstd_M, seq_len, head_dim, eps, config=None, wrap=None
):
    """y_MD and rstd_M of x_MD, whose row m sits at position m % seq_len (contiguous tables).
    `wrap` is `wrap_triton` inside an op."""
    num_rows, D = x_MD.shape
    cfg = config or launch_config(D)
    kernel = wrap(_qk_norm_rope_forward_kernel) if wrap else _qk_norm_rope_forward_kernel
    kernel[(triton.cdiv(num_rows, cfg["BLOCK_M"]),)](
        x_MD, weight_D, cos_SH, sin_SH, y_MD, rstd_M,
        num_rows, seq_len, D, x_MD.stride(0), cos_SH.stride(0), eps, HALF_H=head_dim // 2, **cfg,
    )  # fmt: skip


def launch_qk_norm_rope_backward(
    grad_y_MD, x_MD, weight_D, rstd_M, cos_SH, sin_SH, grad_x_MD, partial_PD, seq_len, head_dim,
    config=None, wrap=None,
):  # fmt: skip
    """grad_x_MD and, per program p, partial_PD[p] = its rows' part of grad_weight. One program
    per row of partial_PD."""
    num_rows, D = x_MD.shape
    cfg = config or launch_config(D)
    if "TILES_PER_PROGRAM" not in cfg:
        tiles = tiles_per_program(num_rows, cfg["BLOCK_M"], partial_PD.shape[0])
        cfg = dict(cfg, TILES_PER_PROGRAM=tiles)
    kernel = wrap(_qk_norm_rope_backward_kernel) if wrap else _qk_norm_rope_backward_kernel
    kernel[(partial_PD.shape[0],)](
        grad_y_MD, x_MD, weight_D, rstd_M, cos_SH, sin_SH, grad_x_MD, partial_PD,
        num_rows, seq_len, D, grad_y_MD.stride(0), x_MD.stride(0), cos_SH.stride(0),
        HALF_H=head_dim // 2, **cfg,
    )  # fmt: skip


def _check(name: str, x_BSD: torch.Tensor, cos_SH: torch.Tensor, head_dim: int) -> None:
    if x_BSD.dim() != 3 or head_dim % 2 or x_BSD.shape[-1] % head_dim:
        raise ValueError(f"{name}: x must be (B, S, N * head_dim) with an even head_dim = {head_dim}, got {tuple(x_BSD.shape)}")  # fmt: skip
    if cos_SH.shape[0] < x_BSD.shape[1] or cos_SH.shape[1] != head_dim // 2:
        raise ValueError(f"{name}: tables of shape {tuple(cos_SH.shape)} do not cover S = {x_BSD.shape[1]}, H / 2 = {head_dim // 2}")  # fmt: skip
    if cos_SH.dtype != torch.float32:
        raise TypeError(f"{name}: tables must be float32, got {cos_SH.dtype}")


def _register_ops() -> None:
    from torch.library import triton_op, wrap_triton

    @triton_op("moetrain::qk_norm_rope", mutates_args=())
    def qk_norm_rope(
        x: torch.Tensor, weight: torch.Tensor, cos_SH: torch.Tensor, sin_SH: torch.Tensor,
        head_dim: int, eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(y of x's shape and dtype, fp32 rstd of shape (B, S, 1))."""
        _check("qk_norm_rope", x, cos_SH, head_dim)
        B, S, D = x.shape
        x_MD = rows_of("qk_norm_rope", x, D)
        y = x.new_empty(x.shape)
        rstd = x.new_empty((B, S, 1), dtype=torch.float32)
        if y.numel():
            launch_qk_norm_rope_forward(
                x_MD, weight.contiguous(), cos_SH.contiguous(), sin_SH.contiguous(),
                y.view(-1, D), rstd.view(-1), S, head_dim, eps, wrap=wrap_triton,
            )  # fmt: skip
        return y, rstd

    @triton_op("moetrain::qk_norm_rope_backward", mutates_args=())
    def qk_norm_rope_backward(
        grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
        cos_SH: torch.Tensor, sin_SH: torch.Tensor, head_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(grad_x in x's dtype, grad_weight in weight's dtype)."""
        _check("qk_norm_rope_backward", x, cos_SH, head_dim)
        B, S, D = x.shape
        x_MD = rows_of("qk_norm_rope_backward", x, D)
        grad_y_MD = rows_of("qk_norm_rope_backward", grad_y, D)
        grad_x = x.new_empty(x.shape)
        P = num_programs(D, x_MD.shape[0], x.device)
        partial_PD = x.new_empty((P, D), dtype=torch.float32)
        if x_MD.numel():
            launch_qk_norm_rope_backward(
                grad_y_MD, x_MD, weight.contiguous(), rstd.reshape(-1).contiguous(),
                cos_SH.contiguous(), sin_SH.contiguous(), grad_x.view(-1, D), partial_PD, S,
                head_dim, wrap=wrap_triton,
            )  # fmt: skip
        else:
            partial_PD.zero_()  # no rows: a zero gradient
        return grad_x, partial_PD.sum(0).to(weight.dtype)

    def setup(ctx, inputs, output):
        x, weight, cos_SH, sin_SH, head_dim, _ = inputs
        ctx.head_dim = head_dim
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(x, weight, output[1], cos_SH, sin_SH)

    def backward(ctx, grad_y, _grad_rstd):
        x, weight, rstd, cos_SH, sin_SH = ctx.saved_tensors
        grad_x, grad_weight = torch.ops.moetrain.qk_norm_rope_backward(
            grad_y, x, weight, rstd, cos_SH, sin_SH, ctx.head_dim
        )
        return grad_x, grad_weight, None, None, None, None

    qk_norm_rope.register_autograd(backward, setup_context=setup)


if triton is not None:
    _register_ops()


def supports(x_BSD: torch.Tensor, cos_SH: torch.Tensor) -> bool:
    """Whether the Triton op can take x with these tables (Triton installed, a kernel dtype, rows
    up to MAX_D, fp32 tables covering the sequence)."""
    return (
        triton_available()
        and x_BSD.dtype in KERNEL_DTYPES
        and x_BSD.dim() == 3
        and 0 < x_BSD.shape[-1] <= MAX_D
        and x_BSD.shape[1] <= cos_SH.shape[0]
        and cos_SH.dtype == torch.float32
    )


def qk_norm_rope_triton(
    x_BSD: torch.Tensor, weight: torch.Tensor, eps: float, cos_SH: torch.Tensor,
    sin_SH: torch.Tensor, head_dim: int,
) -> torch.Tensor:  # fmt: skip
    """RMSNorm of each row then RoPE of each head, differentiable in x and weight (op
    `moetrain::qk_norm_rope`)."""
    if triton is None:
        raise RuntimeError("Triton is not installed: use moetrain.nn.attention's path instead")
    return torch.ops.moetrain.qk_norm_rope(x_BSD, weight, cos_SH, sin_SH, head_dim, eps)[0]
