"""The FP8 row-scaled expert GEMM backends (`precision.experts = fp8_rowwise`).

A backend is a `GroupedGemm` (moe/experts.py, which also holds the bf16 one; MXFP8: moe/mxfp8.py),
chosen once by the precision plan (parallel/precision.py): `FP8RowwiseGroupedGemm` on the tensor
cores of compute capability 9.x / 10.x, `FP8RowwiseEmulatedGroupedGemm` the same math elsewhere
(quantize -> dequantize -> fp32 GEMM; numerics, not speed). Each product is moe/fp8_ops.py's; the
experts' MLP runs as one op (moe/fp8_experts.py), taking the rows a local dispatcher quantized.
Letters: N rows, D input (reduction) dim, F output dim, e local experts, T tokens, K top-k.
"""

from __future__ import annotations

import torch

from moetrain.moe.experts import NO_FP8_ROWS, FP8Rows, GroupedGemm, check_grouped_inputs
from moetrain.moe.fp8_experts import FP8ExpertsInputs, fp8_swiglu_experts, gather_fp8_rows
from moetrain.moe.fp8_ops import fp8_grouped_mm


class FP8RowwiseGroupedGemm(GroupedGemm):
    """E4M3 operands with one fp32 scale per row of the activation and per output column of the
    weight, bf16 output, fp32 accumulation.

    Forward      y = x @ w:       x scaled per row along D, w per column along D.
    Input grad   gx = gy @ w^T:   gy scaled per row along F, w per row along F (its reduction dim).
    Weight grad  gw_i = x_i^T gy_i in BF16 with `torch._grouped_mm`: the FP8 2-D x 2-D kernel
                 asserts group sizes routing does not give (moe/fp8_ops.py); x is saved in its
                 input precision.
    Weights are quantized at every call (no cache, no host state: compiled without a graph
    break, CUDA-graphable). `use_fast_accum`: accumulate without CUTLASS's periodic fp32
    promotion (precision.fp8_fast_accum). `mlp` takes the experts' whole MLP as one op, with
    the quantizations fused into the SwiGLU kernels; `quantized_rows` quantizes a local
    dispatcher's T token rows once, for all T*K rows.
    """

    name = "fp8_rowwise"

    def __init__(self, *, use_fast_accum: bool = True) -> None:
        self.use_fast_accum = use_fast_accum

    def mlp(
        self,
        x_ND: torch.Tensor,
        w_up_eD2F: torch.Tensor,
        w_down_eFD: torch.Tensor,
        offs_e: torch.Tensor,
        w_N: torch.Tensor | None = None,
        rows_fp8: FP8Rows = NO_FP8_ROWS,
    ) -> torch.Tensor:
        """The experts' whole MLP as one op (moe/fp8_experts.py). `rows_fp8`: x's rows already
        quantized, (q, scale), or (None, None)."""
        check_grouped_inputs(self.name, x_ND, w_up_eD2F, offs_e)
        e, d, f2 = w_up_eD2F.shape
        if w_down_eFD.shape != (e, f2 // 2, d) or f2 % 2:
            raise ValueError(
                f"{self.name}: expected w_up (e, D, 2F) and w_down (e, F, D), got "
                f"{tuple(w_up_eD2F.shape)} and {tuple(w_down_eFD.shape)}"
            )
        self.check_kernel_shapes(w_up_eD2F)
        self.check_kernel_shapes(w_down_eFD)
        inputs = FP8ExpertsInputs(
            x_ND, w_up_eD2F, w_down_eFD, offs_e, w_N, *rows_fp8,
            self.emulated, self.use_fast_accum,
        )  # fmt: skip
        return fp8_swiglu_experts(inputs)

    def quantized_rows(self, x_TD: torch.Tensor, order_N: torch.Tensor, top_k: int) -> FP8Rows:
        return gather_fp8_rows(x_TD, order_N // top_k)

    def check_kernel_shapes(self, w_eDF: torch.Tensor) -> None:
        """ValueError unless `torch._scaled_grouped_mm` takes w's shape."""
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
        check_grouped_inputs(self.name, x_ND, w_eDF, offs_e)
        self.check_kernel_shapes(w_eDF)
        return fp8_grouped_mm(x_ND.contiguous(), w_eDF, offs_e, self.emulated, self.use_fast_accum)


class FP8RowwiseEmulatedGroupedGemm(FP8RowwiseGroupedGemm):
    """`FP8RowwiseGroupedGemm`'s math without FP8 tensor cores: the quantized operands are
    dequantized and multiplied in fp32 (equal to the kernels up to the order of fp32
    accumulation), on any device and for any shape."""

    name = "fp8_rowwise (emulation)"
    emulated = True

    def check_kernel_shapes(self, w_eDF: torch.Tensor) -> None:
        """No kernel: fp32 math takes any shape."""
