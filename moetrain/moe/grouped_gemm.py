"""The experts' grouped-GEMM backends, one per precision recipe, and `make_grouped_gemm`.

Every backend computes `y_NF = grouped_mm(x_ND, w_eDF, offs_e)`: rows of x are grouped by expert,
`offs_e` (int32, on device) holds cumulative END offsets, and rows offs[i-1]:offs[i] are multiplied
by w[i]. Rows past offs[-1] are padding; their output is unspecified. A backend is a callable
object with a `name` and `emulated`, chosen once by `make_grouped_gemm(recipe, device)`:
`BF16GroupedGemm` (`torch._grouped_mm`), `FP8RowwiseGroupedGemm` (moe/fp8_ops.py, and the whole
MLP as one op: moe/fp8_experts.py), `MXFP8EmulatedGroupedGemm` (moe/mxfp8.py).
Letters: N rows, D input (reduction) dim, F output dim, e local experts.
"""

from __future__ import annotations

from typing import Protocol

import torch

from moetrain.moe.experts import check_grouped_inputs, grouped_mm
from moetrain.moe.fp8_experts import FP8ExpertsInputs, fp8_swiglu_experts
from moetrain.moe.fp8_ops import fp8_grouped_mm
from moetrain.moe.mxfp8 import MXFP8EmulatedGroupedGemm
from moetrain.nn.fp8 import fp8_unsupported_reason


class GroupedGemm(Protocol):
    name: str
    emulated: bool

    def __call__(
        self, x_ND: torch.Tensor, w_eDF: torch.Tensor, offs_e: torch.Tensor
    ) -> torch.Tensor: ...


class BF16GroupedGemm:
    """`torch._grouped_mm`, differentiable through torch's own autograd formula."""

    name = "bf16"
    emulated = False

    def __call__(
        self, x_ND: torch.Tensor, w_eDF: torch.Tensor, offs_e: torch.Tensor
    ) -> torch.Tensor:
        check_grouped_inputs(self.name, x_ND, w_eDF, offs_e)
        return grouped_mm(x_ND, w_eDF, offs_e)


class FP8RowwiseGroupedGemm:
    """E4M3 operands with one fp32 scale per row of the activation and per output column of the
    weight, bf16 output, fp32 accumulation.

    Forward      y = x @ w:       x scaled per row along D, w per column along D.
    Input grad   gx = gy @ w^T:   gy scaled per row along F, w per row along F (its reduction dim).
    Weight grad  gw_i = x_i^T gy_i in BF16 with `torch._grouped_mm`: the FP8 2-D x 2-D kernel
                 asserts group sizes routing does not give (moe/fp8_ops.py); x is saved in its
                 input precision.
    Weights are quantized at every call (no cache, no host state: compiled without a graph
    break, CUDA-graphable). Without a capable GPU (`emulate=True`, or the CPU) the same math runs
    as quantize -> dequantize -> fp32 GEMM and `emulated` is True. `use_fast_accum`: accumulate
    without CUTLASS's periodic fp32 promotion (precision.fp8_fast_accum). `fuse_swiglu`: let
    `swiglu_mlp` take the experts' whole MLP (moe/fp8_experts.py).
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
        check_grouped_inputs(self.name, x_ND, w_up_eD2F, offs_e)
        e, d, f2 = w_up_eD2F.shape
        if w_down_eFD.shape != (e, f2 // 2, d) or f2 % 2:
            raise ValueError(
                f"{self.name}: expected w_up (e, D, 2F) and w_down (e, F, D), got "
                f"{tuple(w_up_eD2F.shape)} and {tuple(w_down_eFD.shape)}"
            )
        if not self.emulated:
            self._check_kernel_shapes(w_up_eD2F)
            self._check_kernel_shapes(w_down_eFD)
        x_q_ND, x_scale_N = (None, None) if x_fp8 is None else x_fp8
        inputs = FP8ExpertsInputs(
            x_ND, w_up_eD2F, w_down_eFD, offs_e, w_N, x_q_ND, x_scale_N,
            self.emulated, self.use_fast_accum,
        )  # fmt: skip
        return fp8_swiglu_experts(inputs)

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
        check_grouped_inputs(self.name, x_ND, w_eDF, offs_e)
        if not self.emulated:
            self._check_kernel_shapes(w_eDF)
        return fp8_grouped_mm(x_ND.contiguous(), w_eDF, offs_e, self.emulated, self.use_fast_accum)


def make_grouped_gemm(
    recipe: str, device: torch.device | str, *, use_fast_accum: bool = True
) -> GroupedGemm:
    """The expert GEMM for a precision recipe on `device` (the device the step runs on).

    "bf16": `torch._grouped_mm`. "fp8_rowwise": FP8 tensor cores on compute capability 9.x/10.x
    (fast accumulation unless `use_fast_accum=False`); on the CPU an emulation (for tests and
    debugging); any other CUDA GPU raises ValueError. "mxfp8": always the emulation (no MXFP8
    grouped kernel exists for Hopper).
    """
    device = torch.device(device)
    if recipe == "bf16":
        return BF16GroupedGemm()
    if recipe == "fp8_rowwise":
        emulate = device.type == "cpu"
        reason = None if emulate else fp8_unsupported_reason(device)
        if reason is not None:
            raise ValueError(
                f"precision.experts=fp8_rowwise is unavailable: {reason}; use 'bf16' or 'mxfp8' (emulation)"
            )
        return FP8RowwiseGroupedGemm(device, emulate=emulate, use_fast_accum=use_fast_accum)
    if recipe == "mxfp8":
        return MXFP8EmulatedGroupedGemm()
    raise ValueError(
        f"precision.experts: unknown recipe {recipe!r}; valid: 'bf16', 'fp8_rowwise', 'mxfp8'"
    )
