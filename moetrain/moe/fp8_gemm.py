"""Grouped-GEMM backends for the experts: BF16, FP8 row-scaled (Hopper), MXFP8 (emulation).

Every backend computes `y_NF = grouped_mm(x_ND, w_eDF, offs_e)`: rows of x are grouped by expert,
`offs_e` (int32, on device) holds cumulative END offsets, and rows offs[i-1]:offs[i] are multiplied
by w[i]. Rows past offs[-1] are padding; their output is unspecified. A backend is a callable
object with a `name`, chosen once by `make_grouped_gemm(recipe, device)`.
Letters: N rows, D input (reduction) dim, F output dim, e local experts.

FP8 row-scaled products go through `torch._scaled_grouped_mm`. Its constraints, read from the
torch 2.11 sources (GroupedBlas.cpp, ScaledGroupMM.cu, GroupMMCommon.cuh, _meta_registrations.py):
- CUDA devices of compute capability 9.x or 10.x only (`_scaled_mm_allowed_device(sm90, sm100)`);
  sm89 and sm120 are refused, as is ROCm here (it wants e4m3fnuz).
- mat_a: float8_e4m3fn, row-major (stride(-1) == 1); mat_b: float8_e4m3fn, column-major in its
  last two dims, i.e. `q.mT` of a contiguous (e, N, K) tensor. K and N must be multiples of 16
  (16-byte TMA alignment), so D and F must be too.
- offs: 1-D int32 cumulative end offsets, required when an operand is 2-D; fewer than 1024 groups.
- Scales are float32. 2-D x 3-D: scale_a (M,) contiguous, one per row of mat_a; scale_b (e, N)
  with stride(-1) == 1, one per output column per group. 2-D x 2-D (jagged K): scale_a (e*M,),
  scale_b (e*N,), and a device-side assert requires every group but the last to be non-empty
  with a size that is a multiple of 16 (the jagged dim is the contiguous one of both operands).
- out_dtype must be bf16; bias and scale_result are unsupported; use_fast_accum is allowed.
Group sizes in the 2-D x 3-D case (forward and input gradient) are unconstrained: groups start
at row offsets, and a row of K fp8 bytes keeps 16-byte alignment; empty groups are fine. The
weight gradient is the 2-D x 2-D case, whose group sizes come from the router (any size, empty
experts included): FP8RowwiseGroupedGemm computes it in BF16 with `torch._grouped_mm`.

MXFP8 block-scaled grouped products (E8M0 scales, swizzled layout) are Blackwell-only in torch's
libraries, so the MXFP8 recipe is an emulation (quantize, dequantize, high-precision math) on
every device: it measures the recipe's accuracy, never its speed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from moetrain.kernels import quant
from moetrain.moe.experts import _GROUPED_MM_DTYPES, grouped_mm
from moetrain.nn.fp8 import fp8_unsupported_reason, quantize_rows, quantize_rows_of_transpose


class GroupedGemm(Protocol):
    name: str
    emulated: bool

    def __call__(
        self, x_ND: torch.Tensor, w_eDF: torch.Tensor, offs_e: torch.Tensor
    ) -> torch.Tensor: ...


def _grouped_mm_weight_grad_loop(
    x_ND: torch.Tensor, g_NF: torch.Tensor, offs_e: torch.Tensor
) -> torch.Tensor:
    """grad_w[i] = x_i^T @ g_i, the loop twin of the 2-D x 2-D `torch._grouped_mm`."""
    out_eDF = x_ND.new_zeros(offs_e.numel(), x_ND.shape[1], g_NF.shape[1])
    start = 0
    for expert, end in enumerate(offs_e.tolist()):
        out_eDF[expert] = x_ND[start:end].T @ g_NF[start:end]
        start = end
    return out_eDF


def _grouped_weight_grad(
    x_ND: torch.Tensor, g_NF: torch.Tensor, offs_e: torch.Tensor
) -> torch.Tensor:
    """Sum over each group's rows of x^T g -> (e, D, F). x.T is column-major, the layout whose
    jagged dim carries no alignment or non-empty requirement in the CUDA kernel."""
    if x_ND.dtype in _GROUPED_MM_DTYPES:
        return torch._grouped_mm(x_ND.T, g_NF, offs=offs_e)
    return _grouped_mm_weight_grad_loop(x_ND, g_NF, offs_e)


def _check_inputs(name: str, x_ND: torch.Tensor, w_eDF: torch.Tensor, offs_e: torch.Tensor) -> None:
    """Shape checks only: host-known metadata, no device sync."""
    if x_ND.dim() != 2 or w_eDF.dim() != 3 or x_ND.shape[1] != w_eDF.shape[1]:
        raise ValueError(
            f"{name}: expected x (N, D) and w (e, D, F), got {tuple(x_ND.shape)} and {tuple(w_eDF.shape)}"
        )
    if offs_e.dtype != torch.int32 or offs_e.shape != (w_eDF.shape[0],):
        raise ValueError(
            f"{name}: offs must be int32 of shape ({w_eDF.shape[0]},), got {offs_e.dtype} {tuple(offs_e.shape)}"
        )


def _mx_quantizer(device: torch.device) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    if device.type == "cuda":
        from moetrain.kernels import quant_triton

        if quant_triton.triton_available():
            return quant_triton.quantize_mxfp8_triton
    return quant.quantize_mxfp8


class BF16GroupedGemm:
    """`torch._grouped_mm`, differentiable through torch's own autograd formula."""

    name = "bf16"
    emulated = False

    def __call__(
        self, x_ND: torch.Tensor, w_eDF: torch.Tensor, offs_e: torch.Tensor
    ) -> torch.Tensor:
        _check_inputs(self.name, x_ND, w_eDF, offs_e)
        return grouped_mm(x_ND, w_eDF, offs_e)


class FP8RowwiseGroupedGemm:
    """E4M3 operands with one fp32 scale per row of the activation and per output column of the
    weight, bf16 output, fp32 accumulation.

    Forward      y = x @ w:       x scaled per row along D, w per column along D.
    Input grad   gx = gy @ w^T:   gy scaled per row along F, w per row along F (its reduction dim).
    Weight grad  gw_i = x_i^T gy_i in BF16 with `torch._grouped_mm`: the FP8 2-D x 2-D kernel
                 asserts non-empty groups whose sizes are multiples of 16, which routing does not
                 give (see the module docstring). x is therefore saved in its input precision.
    Weights are quantized at every call, like the activations: no cache, no host-side state. The
    product and its backward are two opaque torch.library ops with a registered autograd formula
    (`fp8_grouped_mm`), quantizing with the Triton kernels inside on the GPU: a compiled block
    traces them without a graph break and the step can be CUDA-graphed. Without a capable
    GPU (`emulate=True`, or built for the CPU) the same math runs as quantize -> dequantize ->
    fp32 grouped GEMM: equal to the hardware path up to the order of fp32 accumulation, and
    `emulated` is True.
    `use_fast_accum` (default) lets the tensor cores accumulate without CUTLASS's periodic
    promotion to fp32: 2.7x faster at `small`'s expert shapes on the H200, while the forward's
    error against fp32 math on the same FP8 operands went from 1.67e-3 (the bf16 output's
    rounding, nearly all of it) to 1.75-1.86e-3 (benchmarks/RESULTS.md, session 13). `fuse_swiglu` (default) makes
    `swiglu_mlp` take the experts' whole MLP (moe/fp8_experts.py); False composes the products.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        emulate: bool | None = None,
        use_fast_accum: bool = True,
        fuse_swiglu: bool = True,
    ) -> None:
        device = torch.device(device)
        reason = fp8_unsupported_reason(device)
        if emulate is None:
            emulate = reason is not None
        if not emulate and reason is not None:
            raise ValueError(f"fp8_rowwise: {reason}")
        self.emulated = emulate
        self.name = "fp8_rowwise (emulation)" if emulate else "fp8_rowwise"
        self.use_fast_accum = use_fast_accum
        self.fuse_swiglu = fuse_swiglu

    def swiglu_mlp(
        self,
        x_ND: torch.Tensor,
        w_up_eD2F: torch.Tensor,
        w_down_eFD: torch.Tensor,
        offs_e: torch.Tensor,
        w_N: torch.Tensor | None,
        x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """The experts' whole MLP as one op with the quantizations fused into the SwiGLU
        kernels (moe/fp8_experts.py), or None when built with `fuse_swiglu=False` (the caller
        then composes the products). `x_fp8`: x's rows already quantized, (q, scale)."""
        if not self.fuse_swiglu:
            return None
        from moetrain.moe.fp8_experts import fp8_swiglu_experts

        _check_inputs(self.name, x_ND, w_up_eD2F, offs_e)
        e, d, f2 = w_up_eD2F.shape
        if w_down_eFD.shape != (e, f2 // 2, d) or f2 % 2:
            raise ValueError(
                f"{self.name}: expected w_up (e, D, 2F) and w_down (e, F, D), got "
                f"{tuple(w_up_eD2F.shape)} and {tuple(w_down_eFD.shape)}"
            )
        if not self.emulated:
            self._check_kernel_shapes(w_up_eD2F)
            self._check_kernel_shapes(w_down_eFD)
        return fp8_swiglu_experts(
            x_ND, w_up_eD2F, w_down_eFD, offs_e, w_N,
            emulate=self.emulated, use_fast_accum=self.use_fast_accum, x_fp8=x_fp8,
        )  # fmt: skip

    @property
    def takes_fp8_rows(self) -> bool:
        """Whether `swiglu_mlp` runs (and so uses rows a dispatcher quantized)."""
        return self.fuse_swiglu

    def _check_kernel_shapes(self, w_eDF: torch.Tensor) -> None:
        d, f = w_eDF.shape[1:]
        if d % 16 or f % 16:
            raise ValueError(
                f"{self.name}: D={d} and F={f} must be multiples of 16 (torch._scaled_grouped_mm)"
            )
        if w_eDF.shape[0] >= 1024:
            raise ValueError(f"{self.name}: at most 1023 experts per GEMM, got {w_eDF.shape[0]}")

    def __call__(
        self, x_ND: torch.Tensor, w_eDF: torch.Tensor, offs_e: torch.Tensor
    ) -> torch.Tensor:
        _check_inputs(self.name, x_ND, w_eDF, offs_e)
        if not self.emulated:
            self._check_kernel_shapes(w_eDF)
        return fp8_grouped_mm(x_ND.contiguous(), w_eDF, offs_e, self.emulated, self.use_fast_accum)


def quantized_weight(w_eDF: torch.Tensor, reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_eNK contiguous, scale_eN) with K the reduction dim: "D" for the forward, "F" for the
    input gradient. `q.mT` is the column-major operand `torch._scaled_grouped_mm` wants."""
    if reduction == "D":
        return quantize_rows_of_transpose(w_eDF)  # (e, F, D), one scale per output column
    return quantize_rows(w_eDF, dim=-1)  # (e, D, F), one scale per row of w


def scaled_grouped_mm(
    a_q_MK: torch.Tensor,
    a_scale_M: torch.Tensor,
    b_q_eNK: torch.Tensor,
    b_scale_eN: torch.Tensor,
    offs_e: torch.Tensor,
    out_dtype: torch.dtype,
    emulate: bool,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """out[rows of group i] = (a_q * a_scale) @ (b_q[i] * b_scale[i]).T, via FP8 tensor cores
    or, emulated, in fp32."""
    if emulate:
        a_MK = quant.dequantize_fp8_rowwise(a_q_MK, a_scale_M, dim=-1)
        b_eNK = quant.dequantize_fp8_rowwise(b_q_eNK, b_scale_eN, dim=-1)
        return grouped_mm(a_MK, b_eNK.mT, offs_e).to(out_dtype)
    out_MN = torch._scaled_grouped_mm(
        a_q_MK,
        b_q_eNK.mT,
        a_scale_M,
        b_scale_eN,
        offs=offs_e,
        out_dtype=torch.bfloat16,
        use_fast_accum=use_fast_accum,
    )
    return out_MN.to(out_dtype)


# The product is two opaque ops with a registered autograd formula (torch.library): traced by
# torch.compile without a graph break, called as they are. As an autograd.Function with the
# quantizations traced into the graph, the compiled backward returned zero gradients for both
# inputs on the H200 (torch 2.11; aot_eager as well as inductor): likely dynamo reading
# `ctx.needs_input_grad` as False, the symptom of pytorch/pytorch#160901 (not confirmed here).
# Inside the ops the Triton quantizers run on the GPU.
@torch.library.custom_op("moetrain::fp8_grouped_mm", mutates_args=())
def fp8_grouped_mm(
    x_ND: torch.Tensor,
    w_eDF: torch.Tensor,
    offs_e: torch.Tensor,
    emulate: bool,
    use_fast_accum: bool,
) -> torch.Tensor:
    """y = x @ w per group in FP8 (x row-major): tensor cores, or the fp32 emulation."""
    return scaled_grouped_mm(
        *quantize_rows(x_ND, dim=-1), *quantized_weight(w_eDF, "D"), offs_e, x_ND.dtype,
        emulate, use_fast_accum,
    )  # fmt: skip


@fp8_grouped_mm.register_fake
def _(x_ND, w_eDF, offs_e, emulate, use_fast_accum):
    return x_ND.new_empty((x_ND.shape[0], w_eDF.shape[2]))


@torch.library.custom_op("moetrain::fp8_grouped_mm_backward", mutates_args=())
def fp8_grouped_mm_backward(
    grad_y_NF: torch.Tensor,
    x_ND: torch.Tensor,
    w_eDF: torch.Tensor,
    offs_e: torch.Tensor,
    emulate: bool,
    use_fast_accum: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad x in FP8, grad w in the input precision) of `fp8_grouped_mm`."""
    grad_y_NF = grad_y_NF.contiguous()
    grad_x_ND = scaled_grouped_mm(
        *quantize_rows(grad_y_NF, dim=-1), *quantized_weight(w_eDF, "F"), offs_e, x_ND.dtype,
        emulate, use_fast_accum,
    )  # fmt: skip
    grad_w_eDF = _grouped_weight_grad(x_ND, grad_y_NF.to(x_ND.dtype), offs_e).to(w_eDF.dtype)
    return grad_x_ND, grad_w_eDF


@fp8_grouped_mm_backward.register_fake
def _(grad_y_NF, x_ND, w_eDF, offs_e, emulate, use_fast_accum):
    return torch.empty_like(x_ND), torch.empty_like(w_eDF)


def _fp8_grouped_mm_setup(ctx, inputs, output) -> None:
    x_ND, w_eDF, offs_e, emulate, use_fast_accum = inputs
    ctx.save_for_backward(x_ND, w_eDF, offs_e)
    ctx.emulate, ctx.use_fast_accum = emulate, use_fast_accum


def _fp8_grouped_mm_grad(ctx, grad_y_NF):
    x_ND, w_eDF, offs_e = ctx.saved_tensors
    grad_x_ND, grad_w_eDF = fp8_grouped_mm_backward(
        grad_y_NF, x_ND, w_eDF, offs_e, ctx.emulate, ctx.use_fast_accum
    )
    return grad_x_ND, grad_w_eDF, None, None, None


fp8_grouped_mm.register_autograd(_fp8_grouped_mm_grad, setup_context=_fp8_grouped_mm_setup)


class MXFP8EmulatedGroupedGemm:
    """MXFP8 recipe, emulated: each operand of each product is quantized to MXFP8 (e4m3 elements,
    one E8M0 scale per 32 elements) along that product's reduction dim, dequantized, and
    multiplied in the input dtype (BF16 math for bf16 inputs).

    Forward x along D, w along D; input grad gy along F, w along F; weight grad x and gy along the
    token dim. Token blocks are aligned to the global row index, so a block may straddle two
    experts (a hardware kernel would pad each group to 32 rows instead); padding rows are zeroed
    first so they cannot leak into a real row's scale. Needs D and F to be multiples of 32.
    """

    name = "mxfp8 (emulation)"
    emulated = True

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.quantize = _mx_quantizer(torch.device(device))

    def __call__(
        self, x_ND: torch.Tensor, w_eDF: torch.Tensor, offs_e: torch.Tensor
    ) -> torch.Tensor:
        _check_inputs(self.name, x_ND, w_eDF, offs_e)
        d, f = w_eDF.shape[1:]
        if d % quant.MX_BLOCK or f % quant.MX_BLOCK:
            raise ValueError(f"{self.name}: D={d} and F={f} must be multiples of {quant.MX_BLOCK}")
        return _MXFP8Fn.apply(x_ND, w_eDF, offs_e, self)

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """MXFP8 round trip along the last dim, back in x's dtype."""
        return quant.dequantize_mxfp8(*self.quantize(x), dtype=x.dtype)

    def fake_quantize_rows(self, x_NK: torch.Tensor, offs_e: torch.Tensor) -> torch.Tensor:
        """Round trip along the token dim (blocks of 32 rows), padding rows zeroed."""
        n = x_NK.shape[0]
        valid_N = torch.arange(n, device=x_NK.device) < offs_e[-1]
        x_KN = torch.where(valid_N[:, None], x_NK, 0).T
        x_KN = torch.nn.functional.pad(x_KN, (0, -n % quant.MX_BLOCK))
        return self.fake_quantize(x_KN)[:, :n].T.contiguous()

    def weight(self, w_eDF: torch.Tensor, reduction: str) -> torch.Tensor:
        """w round-tripped along its reduction dim ("D" forward, "F" input grad), as (e, D, F)."""
        w = w_eDF.detach()
        q, scale = self.quantize(w.mT) if reduction == "D" else self.quantize(w)
        w_dq = quant.dequantize_mxfp8(q, scale, dtype=w_eDF.dtype)
        return w_dq.mT if reduction == "D" else w_dq


class _MXFP8Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, w_eDF, offs_e, gemm: MXFP8EmulatedGroupedGemm):
        x_ND = x_ND.contiguous()
        ctx.save_for_backward(x_ND, w_eDF, offs_e)
        ctx.gemm = gemm
        return grouped_mm(gemm.fake_quantize(x_ND), gemm.weight(w_eDF, "D").to(x_ND.dtype), offs_e)

    @staticmethod
    def backward(ctx, grad_y_NF):
        x_ND, w_eDF, offs_e = ctx.saved_tensors
        gemm = ctx.gemm
        grad_y_NF = grad_y_NF.to(x_ND.dtype).contiguous()
        grad_x_ND = grad_w_eDF = None
        if ctx.needs_input_grad[0]:
            w_dq_eFD = gemm.weight(w_eDF, "F").to(x_ND.dtype).mT
            grad_x_ND = grouped_mm(gemm.fake_quantize(grad_y_NF), w_dq_eFD, offs_e)
        if ctx.needs_input_grad[1]:
            x_dq_ND = gemm.fake_quantize_rows(x_ND, offs_e)
            g_dq_NF = gemm.fake_quantize_rows(grad_y_NF, offs_e)
            grad_w_eDF = _grouped_weight_grad(x_dq_ND, g_dq_NF, offs_e).to(w_eDF.dtype)
        return grad_x_ND, grad_w_eDF, None, None


def make_grouped_gemm(
    recipe: str,
    device: torch.device | str,
    *,
    use_fast_accum: bool = True,
) -> GroupedGemm:
    """The expert GEMM for a precision recipe on `device` (the device the step runs on).

    "bf16": `torch._grouped_mm`. "fp8_rowwise": FP8 tensor cores on compute capability 9.x/10.x
    (fast accumulation unless `use_fast_accum=False`); on the CPU an emulation (for tests and debugging); any other CUDA GPU
    raises ValueError. "mxfp8": always the emulation (no MXFP8 grouped kernel exists for Hopper).
    """
    device = torch.device(device)
    if recipe == "bf16":
        return BF16GroupedGemm()
    if recipe == "fp8_rowwise":
        if device.type == "cpu":
            return FP8RowwiseGroupedGemm(device, emulate=True)
        reason = fp8_unsupported_reason(device)
        if reason is not None:
            raise ValueError(
                f"precision.experts=fp8_rowwise is unavailable: {reason}; use 'bf16' or 'mxfp8' (emulation)"
            )
        return FP8RowwiseGroupedGemm(device, use_fast_accum=use_fast_accum)
    if recipe == "mxfp8":
        return MXFP8EmulatedGroupedGemm(device)
    raise ValueError(
        f"precision.experts: unknown recipe {recipe!r}; valid: 'bf16', 'fp8_rowwise', 'mxfp8'"
    )
