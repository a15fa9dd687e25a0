"""FP8 row-scaled linear layers: e4m3 operands, one fp32 scale per row along each product's
reduction dim, fp32 accumulation, bf16 output, on `torch._scaled_mm` (Hopper / Blackwell).

For y = x w^T with x (M, K) tokens and w (N, K):
    forward       y  = x  @ w^T    x scaled per token along K,   w per output row along K
    input grad    gx = gy @ w      gy scaled per token along N,  w per input column along N
    weight grad   gw = gy^T @ x    in the input precision (bf16), as for the experts
Forward and input gradient use fast accumulation unless `precision.fp8_fast_accum` is off. The
weight gradient stays bf16: in FP8 it needs two transposed quantizations that cost more than the
bf16 product (and fast accumulation doubled its error).

Operands, weights included, are quantized at every call with plain torch ops (kernels/quant.py)
that Inductor fuses; no host state, no host sync, so a compiled FP8 step has no graph break and
can be CUDA-graphed. Eager on a CUDA GPU their Triton twins run (same bits). Emulated (the CPU,
or tests) the quantized operands are dequantized and multiplied in fp32.
"""

from __future__ import annotations

import torch

from moetrain.kernels import quant


def fp8_unsupported_reason(device: torch.device) -> str | None:
    """Why FP8 tensor-core GEMMs (`torch._scaled_mm`, `torch._scaled_grouped_mm`) cannot run on
    `device`, or None if they can: CUDA compute capability 9.x (Hopper) or 10.x (Blackwell)."""
    if device.type != "cuda":
        return f"device {device} is not a CUDA GPU"
    if torch.version.hip is not None:
        return "ROCm is not supported (it would need float8_e4m3fnuz)"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        name = torch.cuda.get_device_name(device)
        return (
            f"FP8 tensor-core GEMMs need compute capability 9.x or 10.x; {name} has {major}.{minor}"
        )
    return None


def triton_quantizes(x: torch.Tensor) -> bool:
    """Whether the Triton quantizers take x: eager on a CUDA GPU with Triton installed."""
    if not x.is_cuda or torch.compiler.is_compiling():
        return False
    from moetrain.kernels import quant_triton

    return quant_triton.triton_available()


def quantize_rows(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """`quant.quantize_fp8_rowwise` (or its Triton twin): (q e4m3fn contiguous, scale fp32)."""
    if triton_quantizes(x):
        from moetrain.kernels import quant_triton

        return quant_triton.quantize_fp8_rowwise_triton(x, dim=dim)
    return quant.quantize_fp8_rowwise(x, dim=dim)


@torch.library.custom_op("moetrain::quantize_fp8_rows", mutates_args=())
def quantize_rows_opaque(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows(x)` (last dim) as an opaque op, so compiled code gets the eager kernel's
    bits (Inductor's fused twin may round the scale's division differently). Not differentiable."""
    return quantize_rows(x)


@quantize_rows_opaque.register_fake
def _(x):
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    return q, x.new_empty(x.shape[:-1], dtype=torch.float32)


def quantize_rows_of_transpose(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows(x.mT)`: q in x.mT's shape, contiguous, one scale per row of x.mT (per column
    of x). Eager on a CUDA GPU one Triton pass writes q transposed, with no bf16 copy of x.mT."""
    if triton_quantizes(x):
        from moetrain.kernels import quant_triton

        return quant_triton.quantize_fp8_rowwise_triton(x, dim=-2, transposed=True)
    return quant.quantize_fp8_rowwise(x.mT, dim=-1)


def scaled_mm(
    a_q_MK: torch.Tensor,
    a_scale_M: torch.Tensor,
    b_q_NK: torch.Tensor,
    b_scale_N: torch.Tensor,
    out_dtype: torch.dtype,
    emulate: bool,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """(a_q * a_scale) @ (b_q * b_scale)^T: both operands row-major with the reduction dim K last,
    one scale per row. FP8 tensor cores, or fp32 math when emulated."""
    if emulate:
        a_MK = quant.dequantize_fp8_rowwise(a_q_MK, a_scale_M)
        b_NK = quant.dequantize_fp8_rowwise(b_q_NK, b_scale_N)
        return (a_MK @ b_NK.T).to(out_dtype)
    out = torch._scaled_mm(
        a_q_MK, b_q_NK.T, a_scale_M[:, None], b_scale_N[None, :], out_dtype=torch.bfloat16,
        use_fast_accum=use_fast_accum,
    )  # fmt: skip
    return out.to(out_dtype)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, emulate, fast_accum, *weights):  # type: ignore[override]
        w_NK = weights[0] if len(weights) == 1 else torch.cat(weights)
        x_MK = x.reshape(-1, x.shape[-1])
        y_MN = scaled_mm(*quantize_rows(x_MK), *quantize_rows(w_NK), x.dtype, emulate, fast_accum)
        ctx.save_for_backward(x, *weights)
        ctx.emulate, ctx.fast_accum = emulate, fast_accum
        return y_MN.view(*x.shape[:-1], w_NK.shape[0])

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        x, *weights = ctx.saved_tensors
        w_NK = weights[0] if len(weights) == 1 else torch.cat(weights)
        x_MK = x.reshape(-1, x.shape[-1])
        g_MN = grad_y.reshape(-1, grad_y.shape[-1])
        # Both gradients, always: dynamo has been seen to read `ctx.needs_input_grad` as False
        # for inputs that need a gradient (pytorch/pytorch#160901), silently dropping it.
        g_q, g_scale = quantize_rows(g_MN)
        grad_x = scaled_mm(
            g_q, g_scale, *quantize_rows(w_NK.T), x.dtype, ctx.emulate, ctx.fast_accum
        )
        grad_w = (g_MN.T.to(x.dtype) @ x_MK).to(w_NK.dtype)
        return grad_x.view(x.shape), None, None, *grad_w.split([w.shape[0] for w in weights])


def fp8_linear(
    x: torch.Tensor, weights: list[torch.Tensor], *, emulate: bool, fast_accum: bool = True
) -> torch.Tensor:
    """x @ cat(weights)^T (nn.Linear weights stacked along their output dim) as described above,
    saving x and the weights themselves. x: (..., K); every weight (N_i, K); K and every N_i
    multiples of 16 (checked by `check_fp8_widths` at start-up)."""
    return _FP8Linear.apply(x, emulate, fast_accum, *weights)


def check_fp8_widths(name: str, **widths: int) -> None:
    """ValueError unless every width is a multiple of 16 (16-byte rows of e4m3 for the kernels)."""
    bad = [f"{k}={v}" for k, v in widths.items() if v % 16]
    if bad:
        raise ValueError(f"{name}: FP8 GEMMs need widths in multiples of 16, got {', '.join(bad)}")
