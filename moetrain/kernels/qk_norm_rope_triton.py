"""Attention's qk-norm and RoPE fused in one Triton kernel each way, as `torch.library.triton_op`s
`moetrain::qkv_norm_rope` and `moetrain::qkv_norm_rope_backward` over the fused projection
qkv = [q | k | v] (plain-torch twin: `moetrain.nn.attention.qk_norm_rope_reference`, per tensor).

Letters: B batch, S sequence, N heads, H head dim, D = N*H (q's width; k and v are kv wide),
M = B*S rows, C = D/2 rotation pairs, P programs. The RMSNorm runs over the whole row of q (all
heads), and of k, then each head's halves [a | b] rotate by the angle of the row's position s (its
index along S, or its entry of an optional int tensor `positions` (B, S): document masking's
positions reset per document), with the fp32 tables cos_SH, sin_SH of `RotaryEmbedding` (S, H/2):

    a', b' = (x * rstd * weight) at columns n*H + i and n*H + H/2 + i     # pair c = n*H/2 + i
    y_a = a' cos - b' sin,  y_b = b' cos + a' sin                         # fp32, rounded once

The backward rotates grad_y back (g_a = gy_a cos + gy_b sin, g_b = gy_b cos - gy_a sin) and runs
the RMSNorm backward on g: grad_x = rstd * (gw - x_hat * mean(gw *
x_hat)), gw = g * weight, x_hat = x * rstd; grad_weight = sum over rows of g * x_hat.

The op reads q and k straight out of the projection's rows and returns q, k and v contiguous
(the k launch copies v's rows on the way); its backward writes the whole (M, D + 2 kv) gradient
of the projection in two launches, so the fused projection's GEMM takes it with no `cat`. Unlike
Inductor's path, q is not rounded to bf16 between norm and RoPE.

Each program holds a tile of BLOCK_M whole rows (up to MAX_D) x BLOCK_C pairs. The forward reads
x once and writes y and the fp32 rstd; the backward walks TILES_PER_PROGRAM tiles with an fp32
grad_weight accumulator landing in row p of a (P, D) buffer the op sums (no atomics,
deterministic). Int64 row offsets; masked pair tails. The kernels call no other jitted function
(docs/design.md). Autograd saves qkv, the weights, rstd and the tables, not q, k or v. Without
Triton the module imports and registers nothing.
"""

from __future__ import annotations

import functools

import torch

from moetrain.kernels.triton_support import interpreting as _interpreting
from moetrain.kernels.triton_support import jit as _jit
from moetrain.kernels.triton_support import tl, triton
from moetrain.kernels.triton_support import triton_available as triton_available

MAX_D = 8192  # longest row one program holds in registers; longer rows take the torch path
TILE = 2048  # elements of a tensor a program holds at once: 16 a thread
# The backward: one row of D = 1024 a tile, eight programs of four warps an SM.
BACKWARD_TILE = 1024
WARPS_PER_SM = 32
_INTERPRETER_PROGRAMS = 2  # the interpreter runs programs in turn: two still test the partials
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@_jit
def _qk_norm_rope_forward_kernel(
    x_ptr, weight_ptr, cos_ptr, sin_ptr, pos_ptr, y_ptr, rstd_ptr, copy_src_ptr, copy_dst_ptr,
    num_rows, seq_len, D, stride_x, stride_table, stride_copy_src, eps,
    HALF_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, EVEN_C: tl.constexpr,
    HAS_COPY: tl.constexpr, HAS_POS: tl.constexpr,
):  # fmt: skip
    """y and rstd of BLOCK_M rows; with HAS_COPY also the same rows of another (rows, D) tensor
    copied to a contiguous one (attention's v, while its rows are at hand). A row's position is
    its index mod seq_len, or with HAS_POS its entry of pos (the table row it reads)."""
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
    if HAS_POS:
        position = tl.load(pos_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    else:
        position = rows % seq_len
    table = position[:, None] * stride_table + freq[None, :]
    cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + table, mask=mask, other=0.0)
    y_ptrs = y_ptr + rows[:, None] * D + col_a[None, :]
    tl.store(y_ptrs, (a * cos - b * sin).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptrs + HALF_H, (b * cos + a * sin).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    if HAS_COPY:
        src_ptrs = copy_src_ptr + rows[:, None] * stride_copy_src + col_a[None, :]
        dst_ptrs = copy_dst_ptr + rows[:, None] * D + col_a[None, :]
        tl.store(dst_ptrs, tl.load(src_ptrs, mask=mask, other=0.0), mask=mask)
        tl.store(dst_ptrs + HALF_H, tl.load(src_ptrs + HALF_H, mask=mask, other=0.0), mask=mask)


@_jit
def _qk_norm_rope_backward_kernel(
    grad_y_ptr, x_ptr, weight_ptr, rstd_ptr, cos_ptr, sin_ptr, pos_ptr, grad_x_ptr, partial_ptr,
    copy_src_ptr, num_rows, seq_len, D, stride_grad_y, stride_x, stride_table, stride_grad_x,
    grad_x_col, stride_copy_src, copy_col,
    HALF_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr, EVEN_C: tl.constexpr, HAS_COPY: tl.constexpr,
    HAS_POS: tl.constexpr,
):  # fmt: skip
    """grad_x of TILES_PER_PROGRAM tiles of BLOCK_M rows, at column grad_x_col of rows of
    stride_grad_x (a slice of attention's qkv gradient); the tiles' grad_weight in partial[p].
    With HAS_COPY the same rows of another (rows, D) tensor land at column copy_col of grad_x's
    rows (v's gradient, so that the whole qkv gradient is written here)."""
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
        if HAS_POS:
            position = tl.load(pos_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        else:
            position = rows % seq_len
        table = position[:, None] * stride_table + freq[None, :]
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
        out_rows = grad_x_ptr + rows[:, None] * stride_grad_x
        grad_x_ptrs = out_rows + grad_x_col + col_a[None, :]
        tl.store(grad_x_ptrs, grad_a.to(grad_x_ptr.dtype.element_ty), mask=mask)
        tl.store(grad_x_ptrs + HALF_H, grad_b.to(grad_x_ptr.dtype.element_ty), mask=mask)
        if HAS_COPY:
            src_ptrs = copy_src_ptr + rows[:, None] * stride_copy_src + col_a[None, :]
            dst_ptrs = out_rows + copy_col + col_a[None, :]
            c_a = tl.load(src_ptrs, mask=mask, other=0.0)
            c_b = tl.load(src_ptrs + HALF_H, mask=mask, other=0.0)
            tl.store(dst_ptrs, c_a.to(grad_x_ptr.dtype.element_ty), mask=mask)
            tl.store(dst_ptrs + HALF_H, c_b.to(grad_x_ptr.dtype.element_ty), mask=mask)
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
    """Backward programs: WARPS_PER_SM warps an SM, all resident at once (at BACKWARD_TILE, 8
    elements a thread, eight programs of four warps fit), so no program waits for a second wave;
    fewer where the rows run out."""
    num_rows = int(num_rows)  # specialized, as in `tiles_per_program`
    cfg = launch_config(D, BACKWARD_TILE)
    if device.type == "cuda":
        max_programs = WARPS_PER_SM * _sm_count(device.index or 0) // cfg["num_warps"]
    else:
        max_programs = _INTERPRETER_PROGRAMS
    rows = cfg["BLOCK_M"] * tiles_per_program(num_rows, cfg["BLOCK_M"], max_programs)
    return max(1, triton.cdiv(num_rows, rows))


def rows_of(name: str, t: torch.Tensor, D: int, max_width: int = MAX_D) -> torch.Tensor:
    """t as (rows, D), contiguous in its last dim (the kernels take any row stride)."""
    if t.device.type == "cpu" and not _interpreting():
        raise ValueError(f"{name}: Triton needs a CUDA tensor (or TRITON_INTERPRET=1)")
    if t.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name}: expected bf16, fp16 or fp32, got {t.dtype}")
    if D > max_width:
        raise ValueError(f"{name}: rows of {D} > {max_width} elements")
    t = t.reshape(-1, D)
    return t if t.stride(1) == 1 else t.contiguous()


def launch_config(D: int, tile: int = TILE) -> dict:
    """All D/2 pairs of a row and enough rows to fill `tile` elements (the backward adds
    TILES_PER_PROGRAM). A symbolic width (torch.compile's dynamic shapes) is specialized: the
    block sizes are constexprs, and sympy arithmetic on the symbol took opcheck minutes."""
    D = int(D)
    block_c = triton.next_power_of_2(max(D // 2, 1))
    block_m = max(1, min(64, tile // (2 * block_c)))
    return dict(
        BLOCK_M=block_m, BLOCK_C=block_c, EVEN_C=D == 2 * block_c,
        num_warps=num_warps_for(2 * block_m * block_c),
    )  # fmt: skip


def launch_qk_norm_rope_forward(
    x_MD, weight_D, cos_SH, sin_SH, y_MD, rstd_M, seq_len, head_dim, eps, config=None, wrap=None,
    copy=None, positions_M=None,
):  # fmt: skip
    """y_MD and rstd_M of x_MD, whose row m sits at position m % seq_len, or positions_M[m]
    (contiguous tables); copy = (src_MD, dst_MD) also copies src's rows to the contiguous dst
    (both D wide). `wrap` is `wrap_triton` inside an op."""
    num_rows, D = x_MD.shape
    cfg = config or launch_config(D)
    kernel = wrap(_qk_norm_rope_forward_kernel) if wrap else _qk_norm_rope_forward_kernel
    src, dst = copy if copy is not None else (y_MD, y_MD)  # dummy pointers when unused
    pos = positions_M if positions_M is not None else rstd_M
    kernel[(triton.cdiv(num_rows, cfg["BLOCK_M"]),)](
        x_MD, weight_D, cos_SH, sin_SH, pos, y_MD, rstd_M, src, dst,
        num_rows, seq_len, D, x_MD.stride(0), cos_SH.stride(0), src.stride(0), eps,
        HALF_H=head_dim // 2, HAS_COPY=copy is not None, HAS_POS=positions_M is not None, **cfg,
    )  # fmt: skip


def launch_qk_norm_rope_backward(
    grad_y_MD, x_MD, weight_D, rstd_M, cos_SH, sin_SH, grad_x_MC, partial_PD, seq_len, head_dim,
    config=None, wrap=None, grad_x_col=0, copy=None, positions_M=None,
):  # fmt: skip
    """grad_x into columns [grad_x_col, grad_x_col + D) of the rows of grad_x_MC and, per
    program p, partial_PD[p] = its rows' part of grad_weight (one program per row of
    partial_PD); copy = (src_MD, col) also copies src's rows to columns [col, col + D) of
    grad_x_MC; positions_M as in the forward."""
    num_rows, D = x_MD.shape
    cfg = config or launch_config(D, BACKWARD_TILE)
    if "TILES_PER_PROGRAM" not in cfg:
        tiles = tiles_per_program(num_rows, cfg["BLOCK_M"], partial_PD.shape[0])
        cfg = dict(cfg, TILES_PER_PROGRAM=tiles)
    kernel = wrap(_qk_norm_rope_backward_kernel) if wrap else _qk_norm_rope_backward_kernel
    src, copy_col = copy if copy is not None else (grad_y_MD, 0)  # a dummy pointer when unused
    pos = positions_M if positions_M is not None else rstd_M
    kernel[(partial_PD.shape[0],)](
        grad_y_MD, x_MD, weight_D, rstd_M, cos_SH, sin_SH, pos, grad_x_MC, partial_PD, src,
        num_rows, seq_len, D, grad_y_MD.stride(0), x_MD.stride(0), cos_SH.stride(0),
        grad_x_MC.stride(0), grad_x_col, src.stride(0), copy_col,
        HALF_H=head_dim // 2, HAS_COPY=copy is not None, HAS_POS=positions_M is not None, **cfg,
    )  # fmt: skip


def _check(
    name: str, qkv: torch.Tensor, cos_SH: torch.Tensor, head_dim: int, kv_width: int,
    positions: torch.Tensor | None,
) -> tuple[int, int]:  # fmt: skip
    """(q width, kv width) of a valid (B, S, q + 2 kv) projection."""
    if positions is not None and (positions.shape != qkv.shape[:2] or positions.dtype not in (torch.int32, torch.int64)):  # fmt: skip
        raise ValueError(f"{name}: positions must be int32 or int64 of shape {tuple(qkv.shape[:2])}, got {positions.dtype} {tuple(positions.shape)}")  # fmt: skip
    if qkv.dim() != 3 or head_dim % 2 or kv_width <= 0 or kv_width % head_dim:
        raise ValueError(f"{name}: qkv must be (B, S, q + 2 kv) with kv = {kv_width} a multiple of an even head_dim = {head_dim}, got {tuple(qkv.shape)}")  # fmt: skip
    q_width = qkv.shape[-1] - 2 * kv_width
    if q_width <= 0 or q_width % head_dim or max(q_width, kv_width) > MAX_D:
        raise ValueError(f"{name}: q width {q_width} must be a positive multiple of head_dim = {head_dim}, at most MAX_D = {MAX_D}")  # fmt: skip
    if cos_SH.shape[0] < qkv.shape[1] or cos_SH.shape[1] != head_dim // 2:
        raise ValueError(f"{name}: tables of shape {tuple(cos_SH.shape)} do not cover S = {qkv.shape[1]}, H / 2 = {head_dim // 2}")  # fmt: skip
    if cos_SH.dtype != torch.float32:
        raise TypeError(f"{name}: tables must be float32, got {cos_SH.dtype}")
    return q_width, kv_width


def _register_ops() -> None:
    from torch.library import triton_op, wrap_triton

    @triton_op("moetrain::qkv_norm_rope", mutates_args=())
    def qkv_norm_rope(
        qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos_SH: torch.Tensor,
        sin_SH: torch.Tensor, head_dim: int, kv_width: int, eps: float,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """(q, k normed and rotated, v copied: contiguous (B, S, width) in qkv's dtype; fp32
        rstd of q and of k, (B, S, 1)) of the projection qkv = [q | k | v], each row rotated
        by the angle of its index along S, or of its entry of positions (B, S)."""
        D, Dk = _check("qkv_norm_rope", qkv, cos_SH, head_dim, kv_width, positions)
        pos_M = positions.reshape(-1).contiguous() if positions is not None else None
        B, S, C = qkv.shape
        x_MC = rows_of("qkv_norm_rope", qkv, C, 3 * MAX_D)
        q, k, v = (qkv.new_empty((B, S, width)) for width in (D, Dk, Dk))
        rstd_q, rstd_k = (qkv.new_empty((B, S, 1), dtype=torch.float32) for _ in range(2))
        if q.numel():
            cos_SH, sin_SH = cos_SH.contiguous(), sin_SH.contiguous()
            launch_qk_norm_rope_forward(
                x_MC[:, :D], q_weight.contiguous(), cos_SH, sin_SH, q.view(-1, D),
                rstd_q.view(-1), S, head_dim, eps, wrap=wrap_triton, positions_M=pos_M,
            )  # fmt: skip
            launch_qk_norm_rope_forward(
                x_MC[:, D : D + Dk], k_weight.contiguous(), cos_SH, sin_SH, k.view(-1, Dk),
                rstd_k.view(-1), S, head_dim, eps, wrap=wrap_triton,
                copy=(x_MC[:, D + Dk :], v.view(-1, Dk)), positions_M=pos_M,
            )  # fmt: skip
        return q, k, v, rstd_q, rstd_k

    @triton_op("moetrain::qkv_norm_rope_backward", mutates_args=())
    def qkv_norm_rope_backward(
        grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor, qkv: torch.Tensor,
        q_weight: torch.Tensor, k_weight: torch.Tensor, rstd_q: torch.Tensor,
        rstd_k: torch.Tensor, cos_SH: torch.Tensor, sin_SH: torch.Tensor, head_dim: int,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """(grad_qkv, (B, S, q + 2 kv) in qkv's dtype, written whole by the two launches;
        grad_q_weight, grad_k_weight in the weights' dtype)."""
        kv_width = grad_k.shape[-1]
        D, Dk = _check("qkv_norm_rope_backward", qkv, cos_SH, head_dim, kv_width, positions)
        pos_M = positions.reshape(-1).contiguous() if positions is not None else None
        B, S, C = qkv.shape
        x_MC = rows_of("qkv_norm_rope_backward", qkv, C, 3 * MAX_D)
        grad_qkv = qkv.new_empty(qkv.shape)
        grad_MC = grad_qkv.view(-1, C)
        cos_SH, sin_SH = cos_SH.contiguous(), sin_SH.contiguous()
        grads = []
        for col, g, w, rstd, copy in (
            (0, grad_q, q_weight, rstd_q, None),
            (D, grad_k, k_weight, rstd_k, (rows_of("qkv_norm_rope_backward", grad_v, Dk), D + Dk)),
        ):
            width = g.shape[-1]
            P = num_programs(width, x_MC.shape[0], qkv.device)
            partial_PD = qkv.new_empty((P, width), dtype=torch.float32)
            if x_MC.numel():
                launch_qk_norm_rope_backward(
                    rows_of("qkv_norm_rope_backward", g, width), x_MC[:, col : col + width],
                    w.contiguous(), rstd.reshape(-1).contiguous(), cos_SH, sin_SH, grad_MC,
                    partial_PD, S, head_dim, wrap=wrap_triton,
                    grad_x_col=col, copy=copy, positions_M=pos_M,
                )  # fmt: skip
            else:
                partial_PD.zero_()  # no rows: a zero gradient
            grads.append(partial_PD.sum(0).to(w.dtype))
        return grad_qkv, grads[0], grads[1]

    def setup(ctx, inputs, output):
        qkv, q_weight, k_weight, cos_SH, sin_SH, head_dim, _, _, *positions = inputs
        ctx.head_dim = head_dim
        ctx.mark_non_differentiable(output[3], output[4])
        ctx.save_for_backward(
            qkv, q_weight, k_weight, output[3], output[4], cos_SH, sin_SH, *positions
        )

    def backward(ctx, grad_q, grad_k, grad_v, _grad_rstd_q, _grad_rstd_k):
        qkv, q_weight, k_weight, rstd_q, rstd_k, cos_SH, sin_SH, *positions = ctx.saved_tensors
        grad_qkv, grad_wq, grad_wk = torch.ops.moetrain.qkv_norm_rope_backward(
            grad_q, grad_k, grad_v, qkv, q_weight, k_weight, rstd_q, rstd_k, cos_SH, sin_SH,
            ctx.head_dim, *positions,
        )  # fmt: skip
        return grad_qkv, grad_wq, grad_wk, None, None, None, None, None, None

    qkv_norm_rope.register_autograd(backward, setup_context=setup)


if triton is not None:
    _register_ops()


def supports(qkv: torch.Tensor, cos_SH: torch.Tensor, kv_width: int) -> bool:
    """Whether the Triton op can take the projection qkv = [q | k | v] (kv_width wide k and v)
    with these tables (Triton installed, a kernel dtype, q and k rows up to MAX_D, fp32 tables
    covering the sequence)."""
    return (
        triton_available()
        and qkv.dtype in KERNEL_DTYPES
        and qkv.dim() == 3
        and 0 < kv_width <= MAX_D
        and 0 < qkv.shape[-1] - 2 * kv_width <= MAX_D
        and qkv.shape[1] <= cos_SH.shape[0]
        and cos_SH.dtype == torch.float32
    )


def qkv_norm_rope_triton(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
    cos_SH: torch.Tensor, sin_SH: torch.Tensor, head_dim: int, kv_width: int,
    positions_BS: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """q and k of the projection qkv = [q | k | v] (B, S, q + 2 kv), each RMS-normed over its
    row and rotated per head (at positions 0..S-1, or at positions_BS: int, each < the tables'
    length), and v, all contiguous (B, S, width); differentiable in qkv and both weights (op
    `moetrain::qkv_norm_rope`)."""
    if triton is None:
        raise RuntimeError("Triton is not installed: use moetrain.nn.attention's path instead")
    q, k, v, _, _ = torch.ops.moetrain.qkv_norm_rope(
        qkv, q_weight, k_weight, cos_SH, sin_SH, head_dim, kv_width, eps, positions_BS
    )
    return q, k, v
