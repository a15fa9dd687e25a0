"""Triton kernels for the experts' SwiGLU, as `torch.library.triton_op`s (formulas and plain-torch
references: `moetrain.kernels.swiglu`).

h_N2F = [gate | up] on the last dim. Forward and backward touch each (n, j) once, in fp32,
rounded once at the store (Inductor's backward writes the (N, 2F) gradient as a `cat` that
re-loads both halves for every element). Optional fp32 row weights w_N (the router weights,
which GroupedExperts applies here rather than after the linear down projection) scale each output
row; the backward also returns dw[n], a row sum of values it already holds.

Each program takes a tile of BLOCK_N rows x BLOCK_F columns (whole rows up to MAX_BLOCK_F):
contiguous columns give 16-byte vector accesses without a per-element division by F. Masked
column tails, int64 row offsets; wider rows give each column block's part of dw, which the op
sums. exp and the division are CUDA's fast approximations (one ulp of the output dtype from the
references). Registered like `gather_triton` (`triton_op` + `wrap_triton`, `register_autograd`,
saving h and w alone); without Triton nothing is registered.
"""

from __future__ import annotations

import torch

from moetrain.kernels.quant_triton import _finite_abs, _scales_from_amax, _store_e4m3
from moetrain.kernels.triton_support import interpreting as _interpreting
from moetrain.kernels.triton_support import jit as _jit
from moetrain.kernels.triton_support import tl, triton
from moetrain.kernels.triton_support import triton_available as triton_available

MAX_BLOCK_F = 512  # widest column block of one program; wider rows take several programs
MAX_QUANTIZED_F = 4096  # widest row the fused FP8 quantization takes (one tile a row)
BACKWARD_QUANTIZING_TILE = 1024  # elements a program in the fused FP8 backward
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@_jit
def _swiglu_forward_kernel(
    h_ptr, w_ptr, out_ptr, q_ptr, scale_ptr, N, F, stride_h,
    HAS_WEIGHTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
    EVEN_F: tl.constexpr, QUANTIZE: tl.constexpr, SOFTWARE_CAST: tl.constexpr,
    STORE_OUT: tl.constexpr = True,
):  # fmt: skip
    """out[n, j] = silu(h[n, j]) * h[n, F + j] (times w[n] with weights) on one tile, rounded to
    h's dtype. QUANTIZE (the tile then spans whole rows) also writes the rows of out, as rounded,
    in row-scaled FP8: q and one fp32 scale a row, the bits `quant.quantize_fp8_rowwise(out)`
    gives; without STORE_OUT only those."""
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = rows[:, None] < N if EVEN_F else (rows[:, None] < N) & (cols[None, :] < F)
    gate_ptr = h_ptr + rows[:, None] * stride_h + cols[None, :]
    gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + F, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    if HAS_WEIGHTS:
        out = out * tl.load(w_ptr + rows, mask=rows < N, other=0.0)[:, None]
    out_offsets = rows[:, None] * F + cols[None, :]
    out = out.to(h_ptr.dtype.element_ty)
    if STORE_OUT:
        tl.store(out_ptr + out_offsets, out, mask=mask)
    if QUANTIZE:  # masked columns hold silu(0) * 0 = 0: they leave amax alone
        out = out.to(tl.float32)
        inv, scale = _scales_from_amax(tl.max(_finite_abs(out), axis=1))
        _store_e4m3(q_ptr, out_offsets, out * inv[:, None], mask, SOFTWARE_CAST)
        tl.store(scale_ptr + rows, scale, mask=rows < N)


@_jit
def _swiglu_backward_kernel(
    h_ptr, grad_ptr, w_ptr, dh_ptr, dw_ptr, q_ptr, scale_ptr, out_ptr, N, F, stride_h,
    stride_grad, HAS_WEIGHTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
    EVEN_F: tl.constexpr, QUANTIZE: tl.constexpr, SOFTWARE_CAST: tl.constexpr,
    STORE_OUT: tl.constexpr = False,
):  # fmt: skip
    """dh[n, j] = dgate, dh[n, F + j] = dup on one tile. With weights grad is scaled by w[n]
    first and the tile's part of dw[n] lands in dw[n, program_id(1)] (fp32; the op sums them).
    QUANTIZE (whole rows a tile) also writes dh's rows in row-scaled FP8 (one scale a row over
    both halves). STORE_OUT also writes the forward's output again, the forward kernel's bits."""
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = rows[:, None] < N if EVEN_F else (rows[:, None] < N) & (cols[None, :] < F)
    gate_ptr = h_ptr + rows[:, None] * stride_h + cols[None, :]
    gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + F, mask=mask, other=0.0).to(tl.float32)
    grad_ptrs = grad_ptr + rows[:, None] * stride_grad + cols[None, :]
    grad = tl.load(grad_ptrs, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-gate))
    grad_w = grad
    if HAS_WEIGHTS:
        w = tl.load(w_ptr + rows, mask=rows < N, other=0.0)[:, None]
        grad_w = grad * w
    if STORE_OUT:  # written as in the forward kernel, for the same bits
        out = gate / (1.0 + tl.exp(-gate)) * up
        if HAS_WEIGHTS:
            out = out * w
        out = out.to(h_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * F + cols[None, :], out, mask=mask)
    dgate = grad_w * up * s * (1.0 + gate * (1.0 - s))
    dup = grad_w * gate * s
    dh_offsets = rows[:, None] * (2 * F) + cols[None, :]
    dgate = dgate.to(h_ptr.dtype.element_ty)
    dup = dup.to(h_ptr.dtype.element_ty)
    tl.store(dh_ptr + dh_offsets, dgate, mask=mask)
    tl.store(dh_ptr + dh_offsets + F, dup, mask=mask)
    if QUANTIZE:  # masked columns are 0 (gate, up and grad load as 0)
        dgate = dgate.to(tl.float32)
        dup = dup.to(tl.float32)
        amax = tl.maximum(tl.max(_finite_abs(dgate), axis=1), tl.max(_finite_abs(dup), axis=1))
        inv, scale = _scales_from_amax(amax)
        _store_e4m3(q_ptr, dh_offsets, dgate * inv[:, None], mask, SOFTWARE_CAST)
        _store_e4m3(q_ptr, dh_offsets + F, dup * inv[:, None], mask, SOFTWARE_CAST)
        tl.store(scale_ptr + rows, scale, mask=rows < N)
    if HAS_WEIGHTS:  # after the stores: the row sum's barrier then holds no store back
        dot = tl.sum(grad * gate * s * up, axis=1)
        tl.store(dw_ptr + rows * tl.num_programs(1) + tl.program_id(1), dot, mask=rows < N)


def launch_config(F: int, max_block_f: int = MAX_BLOCK_F, tile: int = 4096) -> dict:
    """The row (up to `max_block_f` columns) and enough rows to fill `tile` elements (8 rows
    from F = 512, at most 64), four warps."""
    block_f = min(triton.next_power_of_2(max(F, 1)), max_block_f)
    block_n = max(1, min(64, tile // block_f))
    return dict(BLOCK_N=block_n, BLOCK_F=block_f, EVEN_F=F % block_f == 0, num_warps=4)


def _grid(N: int, F: int, cfg: dict) -> tuple[int, int]:
    return triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(F, cfg["BLOCK_F"])


def quantizing_config(F: int, tile: int = 2048, num_warps: int = 4) -> dict:
    """Whole rows a tile (fused FP8 quantization needs each row's amax): up to
    `MAX_QUANTIZED_F` columns, rows to fill `tile` elements. The backward keeps dgate and dup
    live until the row's amax is known and takes `BACKWARD_QUANTIZING_TILE`."""
    if F > MAX_QUANTIZED_F:
        raise ValueError(f"fused FP8 quantization takes rows of at most {MAX_QUANTIZED_F}, got {F}")
    block_f = triton.next_power_of_2(max(F, 1))
    return dict(
        BLOCK_N=max(1, min(64, tile // block_f)), BLOCK_F=block_f, EVEN_F=F == block_f,
        num_warps=num_warps,
    )  # fmt: skip


def _quantized_outputs(q, scale):
    """(kernel flags, q pointer, scale pointer) for an optional (q, scale) pair."""
    if q is None:
        return dict(QUANTIZE=False, SOFTWARE_CAST=False), None, None
    from moetrain.kernels.quant_triton import _default_software_cast, _q_arg

    software_cast = _default_software_cast(q)
    return dict(QUANTIZE=True, SOFTWARE_CAST=software_cast), _q_arg(q, software_cast), scale


def launch_forward(h_N2F, out_NF, w_N=None, config=None, wrap=None, q_NF=None, scale_N=None):
    """out_NF = silu(gate) * up (times w_N[n] per row when given); with q_NF and scale_N also
    out's rows in row-scaled FP8 (the config must then be `quantizing_config`), and out_NF may
    be None to write only those. `wrap` is `wrap_triton` inside an op; the benchmark's sweep
    launches raw kernels."""
    N, F = h_N2F.shape[0], h_N2F.shape[1] // 2
    flags, q, scale = _quantized_outputs(q_NF, scale_N)
    if out_NF is None and q is None:
        raise ValueError("launch_forward: nothing to write (no out_NF and no q_NF)")
    cfg = config or (quantizing_config(F) if flags["QUANTIZE"] else launch_config(F))
    kernel = wrap(_swiglu_forward_kernel) if wrap else _swiglu_forward_kernel
    out = q if out_NF is None else out_NF  # dummy pointers when unused
    w = out if w_N is None else w_N
    kernel[_grid(N, F, cfg)](
        h_N2F, w, out, out if q is None else q, out if scale is None else scale,
        N, F, h_N2F.stride(0), HAS_WEIGHTS=w_N is not None, STORE_OUT=out_NF is not None,
        **flags, **cfg,
    )  # fmt: skip


def launch_backward(
    h_N2F, grad_NF, dh_N2F, w_N=None, dw_NB=None, config=None, wrap=None, q_N2F=None,
    scale_N=None, out_NF=None,
):  # fmt: skip
    """dh_N2F = [dgate | dup] of swiglu at h_N2F for the incoming grad_NF; with row weights
    w_N, dw_NB[n, b] is column block b's part of the weight's gradient (B = the grid's column
    blocks, `num_column_blocks`); with q_N2F and scale_N also dh's rows in row-scaled FP8; with
    out_NF also the forward's output again (bit for bit `launch_forward`'s)."""
    N, F = grad_NF.shape
    flags, q, scale = _quantized_outputs(q_N2F, scale_N)
    if config is None and flags["QUANTIZE"]:
        config = quantizing_config(F, tile=BACKWARD_QUANTIZING_TILE)
    cfg = config or launch_config(F)
    kernel = wrap(_swiglu_backward_kernel) if wrap else _swiglu_backward_kernel
    w, dw = (dh_N2F, dh_N2F) if w_N is None else (w_N, dw_NB)  # dummy pointers when unused
    kernel[_grid(N, F, cfg)](
        h_N2F, grad_NF, w, dh_N2F, dw, dh_N2F if q is None else q,
        dh_N2F if scale is None else scale, dh_N2F if out_NF is None else out_NF,
        N, F, h_N2F.stride(0), grad_NF.stride(0), HAS_WEIGHTS=w_N is not None,
        STORE_OUT=out_NF is not None, **flags, **cfg,
    )  # fmt: skip


def num_column_blocks(F: int, config=None) -> int:
    """Programs along a row: the column blocks the weighted backward sums dw over."""
    return _grid(1, F, config or launch_config(F))[1]


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """t checked, and contiguous in its last dim (the kernels take any row stride)."""
    if t.device.type == "cpu" and not _interpreting():
        raise ValueError(f"{name}: Triton needs a CUDA tensor (or TRITON_INTERPRET=1)")
    if t.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"{name}: expected bf16, fp16 or fp32, got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor, got shape {tuple(t.shape)}")
    return t if t.stride(1) == 1 else t.contiguous()


def _row_weights(name: str, w_N: torch.Tensor | None, N: int) -> torch.Tensor | None:
    if w_N is None:
        return None
    if w_N.dtype != torch.float32 or w_N.shape != (N,):
        raise ValueError(f"{name}: row weights must be float32 of shape ({N},), got {w_N.dtype} {tuple(w_N.shape)}")  # fmt: skip
    return w_N.contiguous()


def _register_ops() -> None:
    from torch.library import triton_op, wrap_triton

    @triton_op("moetrain::swiglu", mutates_args=())
    def swiglu(h_N2F: torch.Tensor, w_N: torch.Tensor | None) -> torch.Tensor:
        """silu(gate) * up of h = [gate | up] (times w_N[n] per row when given), (N, F), in
        h's dtype."""
        h_N2F = _rows("swiglu", h_N2F)
        if h_N2F.shape[1] % 2:
            raise ValueError(f"swiglu: h's last dim must be even, got {h_N2F.shape[1]}")
        w_N = _row_weights("swiglu", w_N, h_N2F.shape[0])
        out_NF = h_N2F.new_empty((h_N2F.shape[0], h_N2F.shape[1] // 2))
        if out_NF.numel():
            launch_forward(h_N2F, out_NF, w_N, wrap=wrap_triton)
        return out_NF

    @triton_op("moetrain::swiglu_backward", mutates_args=())
    def swiglu_backward(
        h_N2F: torch.Tensor, grad_NF: torch.Tensor, w_N: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([dgate | dup], (N, 2F), in h's dtype; the fp32 gradient of the row weights, (N,),
        or an empty tensor without weights)."""
        h_N2F, grad_NF = _rows("swiglu_backward", h_N2F), _rows("swiglu_backward", grad_NF)
        N, F = grad_NF.shape
        w_N = _row_weights("swiglu_backward", w_N, N)
        dh_N2F = h_N2F.new_empty(h_N2F.shape)
        dw_NB = None if w_N is None else grad_NF.new_empty((N, num_column_blocks(F)), dtype=torch.float32)  # fmt: skip
        if dh_N2F.numel():
            launch_backward(h_N2F, grad_NF, dh_N2F, w_N, dw_NB, wrap=wrap_triton)
        elif dw_NB is not None:
            dw_NB.zero_()  # F = 0: empty sums
        dw_N = grad_NF.new_empty((0,), dtype=torch.float32) if dw_NB is None else dw_NB.sum(1)
        return dh_N2F, dw_N

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, grad_NF):
        h_N2F, w_N = ctx.saved_tensors
        dh_N2F, dw_N = torch.ops.moetrain.swiglu_backward(h_N2F, grad_NF, w_N)
        return dh_N2F, (dw_N if w_N is not None else None)

    swiglu.register_autograd(backward, setup_context=setup)


if triton is not None:
    _register_ops()


def swiglu_fp8_triton(
    h_N2F: torch.Tensor, w_N: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): the rows of `swiglu` (rounded to h's dtype) in row-scaled FP8, one pass that
    writes nothing else. Not differentiable (the FP8 experts' op calls it from its own
    forward)."""
    h_N2F = _rows("swiglu_fp8", h_N2F)
    N, F = h_N2F.shape[0], h_N2F.shape[1] // 2
    w_N = _row_weights("swiglu_fp8", w_N, N)
    q_NF = torch.empty((N, F), dtype=torch.float8_e4m3fn, device=h_N2F.device)
    scale_N = torch.empty((N,), dtype=torch.float32, device=h_N2F.device)
    if q_NF.numel():
        launch_forward(h_N2F, None, w_N, q_NF=q_NF, scale_N=scale_N)
    return q_NF, scale_N


def swiglu_fp8_backward_triton(
    h_N2F: torch.Tensor, grad_NF: torch.Tensor, w_N: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(dh, q, scale, dw, out): the SwiGLU backward, dh's rows in row-scaled FP8 and the
    forward's output written again (`swiglu(h, w)`, bit for bit), one pass; dw is the row
    weights' fp32 gradient, or None without them."""
    h_N2F, grad_NF = _rows("swiglu_fp8_backward", h_N2F), _rows("swiglu_fp8_backward", grad_NF)
    N, F = grad_NF.shape
    w_N = _row_weights("swiglu_fp8_backward", w_N, N)
    dh_N2F = h_N2F.new_empty(h_N2F.shape)
    out_NF = h_N2F.new_empty((N, F))
    q_N2F = torch.empty(h_N2F.shape, dtype=torch.float8_e4m3fn, device=h_N2F.device)
    scale_N = torch.empty((N,), dtype=torch.float32, device=h_N2F.device)
    dw_NB = None if w_N is None else grad_NF.new_zeros((N, 1), dtype=torch.float32)
    if dh_N2F.numel():
        launch_backward(
            h_N2F, grad_NF, dh_N2F, w_N, dw_NB, q_N2F=q_N2F, scale_N=scale_N, out_NF=out_NF
        )
    dw_N = None if dw_NB is None else dw_NB.view(N)
    return dh_N2F, q_N2F, scale_N, dw_N, out_NF


def supports(h_N2F: torch.Tensor) -> bool:
    """Whether the Triton op can take h (Triton installed, a kernel dtype)."""
    return triton_available() and h_N2F.dtype in _KERNEL_DTYPES


def swiglu_triton(h_N2F: torch.Tensor, w_N: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up (times the float32 row weights w_N when given), differentiable in h and
    w_N (op `moetrain::swiglu`)."""
    if triton is None:
        raise RuntimeError("Triton is not installed: use moetrain.kernels.swiglu instead")
    return torch.ops.moetrain.swiglu(h_N2F, w_N)
