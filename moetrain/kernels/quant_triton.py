"""Triton row-scaled FP8 quantization kernels, bit-identical to the torch references in `quant`.

Along the last dim, amax, scale and cast are fused: the input is read once. Along another dim
(per-column scales of a weight) one kernel holds whole column blocks where that fills the GPU,
else a split amax (an integer atomic max: exact in any order, as non-negative floats order like
their bits) then the cast. MXFP8 has no kernel (an emulation on every GPU we have).

Bit-exactness rests on IEEE round-to-nearest divisions (`tl.math.div_rn`; Triton's `/` is
approximate), a single multiply per element, and an fp32 -> e4m3 conversion rounding to nearest
even: the GPU's `cvt.rn.satfinite` (default on sm89+) or integer bit arithmetic (`software_cast`;
default under TRITON_INTERPRET=1, whose fp8 cast does not round to nearest even). The interpreter
flushes bf16 subnormals, so an all-tiny bf16 block can differ there. Without Triton the module
imports, `triton_available()` is False and the entry points raise.
"""

from __future__ import annotations

import torch

from moetrain.kernels.quant import AMAX_EPS, FP8_E4M3_MAX
from moetrain.kernels.triton_support import interpreting as _interpreting
from moetrain.kernels.triton_support import jit as _jit
from moetrain.kernels.triton_support import tl, triton
from moetrain.kernels.triton_support import triton_available as triton_available

# Per-column scaling takes one program a column block of a matrix when that gives at least this
# many programs (two waves of 132 SMs), columns are at most this long and the matrices fit a CUDA
# grid's second dimension; otherwise a split amax over row blocks and a cast.
COLUMN_PROGRAMS_MIN = 256
COLUMN_ROWS_MAX = 16384
_GRID_Y_MAX = 65535
# The one-pass kernel's (rows, columns, warps); a tile of at least M rows holds the whole column
# block in registers (one read).
COLUMN_TILE = (2048, 16, 4)

# Kernels may only read globals that are constexpr.
_constexpr = tl.constexpr if triton is not None else (lambda value: value)
_EPS = _constexpr(AMAX_EPS)
_FP8_MAX = _constexpr(FP8_E4M3_MAX)


# --- kernels -----------------------------------------------------------------------------------


@_jit
def _finite_abs(x):
    a = tl.abs(x)
    return tl.where(a < float("inf"), a, 0.0)  # NaN and +-inf are left out of amax


@_jit
def _e4m3_code(c):
    """fp32 already clamped to +-448 -> e4m3fn code (int32), round to nearest even, integer ops only."""
    bits = c.to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF
    e = a >> 23
    # normal e4m3 (|c| >= 2^-6, fp32 exponent field >= 121): keep 3 of 23 mantissa bits
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960  # 960 = (127 - 7) << 3 rebiases
    # subnormal e4m3: round the 24-bit significand to a multiple of 2^-9
    shift = tl.minimum(tl.maximum(141 - e, 21), 31)
    mant = (a & 0x7FFFFF) | 0x800000
    sub = (mant + ((1 << (shift - 1)) - 1) + ((mant >> shift) & 1)) >> shift
    code = tl.where(e >= 121, normal, sub)
    return code | tl.where(bits < 0, 0x80, 0)


@_jit
def _store_e4m3(q_ptr, offsets, v, mask, SOFTWARE_CAST: tl.constexpr):
    """Saturate to +-448 and store as e4m3; NaN becomes 0x7F. q_ptr is uint8 when SOFTWARE_CAST."""
    c = tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX)
    if SOFTWARE_CAST:
        code = tl.where(v != v, 0x7F, _e4m3_code(c))
        tl.store(q_ptr + offsets, code.to(tl.uint8), mask=mask)
    else:
        c = tl.where(v != v, float("nan"), c)  # min/max drop NaN on the GPU; put it back
        tl.store(q_ptr + offsets, c.to(tl.float8e4nv), mask=mask)


@_jit
def _scales_from_amax(amax):
    """(multiplier 448 / amax, stored scale amax / 448), both correctly rounded."""
    amax = tl.maximum(amax, _EPS)
    fp8_max = tl.full(amax.shape, _FP8_MAX, tl.float32)
    return tl.math.div_rn(fp8_max, amax), tl.math.div_rn(amax, fp8_max)


@_jit
def _store_column_tile(
    q_ptr, x, inv, offsets, base, rows, cols, M, mask,
    SOFTWARE_CAST: tl.constexpr, TRANSPOSED: tl.constexpr,
):  # fmt: skip
    """x * inv (one inverse scale a column) in e4m3, at x's `offsets` in a (B, M, N) q, or
    transposed into a (B, N, M) q: the column kernels' store."""
    if TRANSPOSED:
        q_offsets = base + cols.to(tl.int64)[None, :] * M + rows[:, None]
    else:
        q_offsets = offsets
    _store_e4m3(q_ptr, q_offsets, x * inv[None, :], mask, SOFTWARE_CAST)


@_jit
def _rowwise_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    R,
    K,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_K_BLOCKS: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr,
):
    """One scale per row of a contiguous (R, K) matrix. With one K block the row is read once;
    longer rows are read twice (amax, then cast), the second time mostly from L2."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    row_start = rows.to(tl.int64) * K
    cols = tl.arange(0, BLOCK_K)
    if NUM_K_BLOCKS == 1:
        mask = row_mask[:, None] & (cols[None, :] < K)
        offsets = row_start[:, None] + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        inv, scale = _scales_from_amax(tl.max(_finite_abs(x), axis=1))
        _store_e4m3(q_ptr, offsets, x * inv[:, None], mask, SOFTWARE_CAST)
    else:
        amax = tl.zeros([BLOCK_R], dtype=tl.float32)
        for kb in range(NUM_K_BLOCKS):  # constexpr trip count (runtime bounds trip the interpreter)
            k = kb * BLOCK_K + cols
            mask = row_mask[:, None] & (k[None, :] < K)
            offsets = row_start[:, None] + k[None, :]
            x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(_finite_abs(x), axis=1))
        inv, scale = _scales_from_amax(amax)
        for kb in range(NUM_K_BLOCKS):
            k = kb * BLOCK_K + cols
            mask = row_mask[:, None] & (k[None, :] < K)
            offsets = row_start[:, None] + k[None, :]
            x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            _store_e4m3(q_ptr, offsets, x * inv[:, None], mask, SOFTWARE_CAST)
    tl.store(scale_ptr + rows, scale, mask=row_mask)


@_jit
def _column_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    M,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_M_BLOCKS: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    """One scale per column of each (M, N) matrix of a contiguous (B, M, N) tensor, one program
    a column block of one matrix (grid (column block, matrix)). With one M block the block stays
    in registers for amax and cast; otherwise it is read twice, the second time mostly from L2.
    q is (B, M, N), or (B, N, M) when TRANSPOSED."""
    batch = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    base = batch.to(tl.int64) * M * N
    if NUM_M_BLOCKS == 1:
        rows = tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_mask[None, :]
        offsets = base + rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        inv, scale = _scales_from_amax(tl.max(_finite_abs(x), axis=0))
        _store_column_tile(
            q_ptr, x, inv, offsets, base, rows, cols, M, mask, SOFTWARE_CAST, TRANSPOSED
        )
    else:
        amax = tl.zeros([BLOCK_N], dtype=tl.float32)
        for mb in range(NUM_M_BLOCKS):  # constexpr trip count (runtime bounds trip the interpreter)
            rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
            mask = (rows < M)[:, None] & col_mask[None, :]
            x = tl.load(
                x_ptr + base + rows.to(tl.int64)[:, None] * N + cols[None, :],
                mask=mask,
                other=0.0,
            )
            amax = tl.maximum(amax, tl.max(_finite_abs(x.to(tl.float32)), axis=0))
        inv, scale = _scales_from_amax(amax)
        for mb in range(NUM_M_BLOCKS):
            rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
            mask = (rows < M)[:, None] & col_mask[None, :]
            offsets = base + rows.to(tl.int64)[:, None] * N + cols[None, :]
            x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            _store_column_tile(
                q_ptr, x, inv, offsets, base, rows, cols, M, mask, SOFTWARE_CAST, TRANSPOSED
            )
    tl.store(scale_ptr + batch * N + cols, scale, mask=col_mask)


@_jit
def _column_amax_kernel(
    x_ptr,
    amax_bits_ptr,
    M,
    N,
    ROWS_PER_PROGRAM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Partial amax over ROWS_PER_PROGRAM rows of a contiguous (B, M, N) tensor, per column."""
    batch = tl.program_id(0)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    base = batch.to(tl.int64) * M * N
    row0 = tl.program_id(1) * ROWS_PER_PROGRAM
    amax = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(0, ROWS_PER_PROGRAM, BLOCK_M):
        rows = row0 + i + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_mask[None, :]
        offsets = base + rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(_finite_abs(x), axis=0))
    bits = amax.to(tl.int32, bitcast=True)
    tl.atomic_max(amax_bits_ptr + batch * N + cols, bits, mask=col_mask)


@_jit
def _column_cast_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    amax_bits_ptr,
    M,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTWARE_CAST: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    """Scale and cast a (B, M, N) tensor by its per-column amax; q is (B, M, N), or (B, N, M)
    when TRANSPOSED (the tile is stored transposed: no copy of x in that layout)."""
    batch = tl.program_id(0)
    pid_m = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    amax_bits = tl.load(amax_bits_ptr + batch * N + cols, mask=col_mask, other=0)
    inv, scale = _scales_from_amax(amax_bits.to(tl.float32, bitcast=True))
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (rows < M)[:, None] & col_mask[None, :]
    base = batch.to(tl.int64) * M * N
    offsets = base + rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    _store_column_tile(q_ptr, x, inv, offsets, base, rows, cols, M, mask, SOFTWARE_CAST, TRANSPOSED)
    # One row block writes the scales. A branch, not `mask=col_mask & (pid_m == 0)`: Triton
    # 3.9's interpreter types that mask as an integer and refuses it.
    if pid_m == 0:
        tl.store(scale_ptr + batch * N + cols, scale, mask=col_mask)


# --- entry points ------------------------------------------------------------------------------


def _check_device(x: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("Triton is not installed: use moetrain.kernels.quant instead")
    if not x.is_cuda and not _interpreting():
        raise ValueError(
            f"Triton quantization needs a CUDA tensor (or TRITON_INTERPRET=1), got {x.device}"
        )


def _default_software_cast(x: torch.Tensor) -> bool:
    if not x.is_cuda:
        return True
    return torch.cuda.get_device_capability(x.device) < (8, 9)


def _q_arg(q: torch.Tensor, software_cast: bool) -> torch.Tensor:
    return q.view(torch.uint8) if software_cast else q


def quantize_fp8_rowwise_triton(
    x: torch.Tensor,
    dim: int = -1,
    *,
    transposed: bool = False,
    software_cast: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `quant.quantize_fp8_rowwise`: same outputs, bit for bit, for any `dim`.

    Non-contiguous inputs are copied to contiguous first. `transposed=True` (dim must be -2)
    writes q in the layout of `x.mT`, contiguous: `quantize_fp8_rowwise(x.mT, dim=-1)` without
    the bf16 transposed copy.
    """
    _check_device(x)
    if software_cast is None:
        software_cast = _default_software_cast(x)
    dim = dim % x.dim()
    if transposed and (x.dim() < 2 or dim != x.dim() - 2):
        raise ValueError(f"transposed quantization scales along dim -2, got dim {dim} of {x.dim()}")
    x = x.contiguous()
    q_shape = (*x.shape[:-2], x.shape[-1], x.shape[-2]) if transposed else x.shape
    q = torch.empty(q_shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale_shape = x.shape[:dim] + x.shape[dim + 1 :]
    scale = torch.empty(scale_shape, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return q, scale
    if dim == x.dim() - 1:
        k = x.shape[-1]
        r = x.numel() // k
        block_k = triton.next_power_of_2(k) if k <= 8192 else 4096
        block_r = max(1, min(64, 8192 // block_k))
        grid = (triton.cdiv(r, block_r),)
        _rowwise_kernel[grid](
            x, _q_arg(q, software_cast), scale, r, k,
            BLOCK_R=block_r, BLOCK_K=block_k, NUM_K_BLOCKS=triton.cdiv(k, block_k),
            SOFTWARE_CAST=software_cast, num_warps=8 if block_r * block_k >= 4096 else 4,
        )  # fmt: skip
        return q, scale
    b = x.shape[:dim].numel()
    m = x.shape[dim]
    n = x.shape[dim + 1 :].numel()
    tile_m, tile_n, warps = COLUMN_TILE
    tile_m = min(tile_m, triton.next_power_of_2(m))  # a tile taller than M: one M block
    if (
        b * triton.cdiv(n, tile_n) >= COLUMN_PROGRAMS_MIN
        and m <= COLUMN_ROWS_MAX
        and b <= _GRID_Y_MAX
    ):
        # enough column blocks to fill the GPU (expert weights): one kernel, one HBM pass
        grid = (triton.cdiv(n, tile_n), b)
        _column_kernel[grid](
            x, _q_arg(q, software_cast), scale, m, n, BLOCK_M=tile_m, BLOCK_N=tile_n,
            NUM_M_BLOCKS=triton.cdiv(m, tile_m), SOFTWARE_CAST=software_cast,
            TRANSPOSED=transposed, num_warps=warps,
        )  # fmt: skip
        return q, scale
    amax_bits = torch.zeros((b, n), dtype=torch.int32, device=x.device)
    block_n = min(128, triton.next_power_of_2(n))
    block_m = max(1, min(64, 4096 // block_n))
    rows_per_program = max(block_m, min(1024, triton.next_power_of_2(m)))
    grid = (b, triton.cdiv(m, rows_per_program), triton.cdiv(n, block_n))
    _column_amax_kernel[grid](
        x, amax_bits, m, n, ROWS_PER_PROGRAM=rows_per_program, BLOCK_M=block_m, BLOCK_N=block_n
    )
    if transposed:  # square tiles: 64-byte runs of q along M, 128-byte runs of x along N
        block_m, block_n = min(64, triton.next_power_of_2(m)), min(64, triton.next_power_of_2(n))
    grid = (b, triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _column_cast_kernel[grid](
        x, _q_arg(q, software_cast), scale, amax_bits, m, n,
        BLOCK_M=block_m, BLOCK_N=block_n, SOFTWARE_CAST=software_cast, TRANSPOSED=transposed,
    )  # fmt: skip
    return q, scale
