"""Grouped SwiGLU experts: every local expert's weights in 3-D tensors, one GEMM per projection.

Letters: N rows (grouped by expert), D model dim, F expert hidden, e local experts.
    h_N2F = rows_ND @ w_up_eD2F[expert of row]      (gate and up fused: [gate | up])
    y_ND  = swiglu(h_N2F, w_N) @ w_down_eFD[expert of row]
                                   (w * silu(gate) * up, moetrain.kernels.swiglu)
Each product is one grouped GEMM driven by device-side offsets. The optional row weights w_N
(router weights, from a dispatcher whose combine only sums) are applied inside the SwiGLU: the
same as weighting y, since the down projection is linear. The experts run their whole MLP on
`gemm`, a swappable backend (`GroupedGemm`; the precision plan installs precision.experts'):
`BF16GroupedGemm` (`torch._grouped_mm`, the default) composes it of two products and `swiglu`;
the FP8 backend (moe/grouped_gemm.py) runs it as one op; `ComposedGroupedGemm` is any backend's
products composed, the twin of a fused MLP. `grouped_mm_reference` is the loop tests compare
against. Weights are indexed by global expert id minus `expert_offset`, so expert parallelism
only changes which slice a rank holds.
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.kernels.swiglu import swiglu

# rows already quantized by a dispatcher, (q e4m3, fp32 scale per row), or (None, None)
FP8Rows = tuple[torch.Tensor, torch.Tensor] | tuple[None, None]
NO_FP8_ROWS: FP8Rows = (None, None)
_GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def grouped_mm_reference(
    x_ND: torch.Tensor, w_eDF: torch.Tensor, offsets_e: torch.Tensor
) -> torch.Tensor:
    """Loop over experts. Reads the offsets on the host: for tests and CPU fallbacks only."""
    out_NF = x_ND.new_zeros(x_ND.shape[0], w_eDF.shape[-1])
    start = 0
    for expert, end in enumerate(offsets_e.tolist()):
        if end > start:
            out_NF[start:end] = x_ND[start:end] @ w_eDF[expert]
        start = end
    return out_NF


def grouped_mm(x_ND: torch.Tensor, w_eDF: torch.Tensor, offsets_e: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm`: one kernel for all experts, offsets read on the device. float64
    (tests only) takes the reference loop; anything else the kernel rejects (other dtypes, rows
    not a multiple of 16 bytes) is a ValueError, never a silent slow loop (the config checks the
    widths at start-up)."""
    if x_ND.dtype == torch.float64:
        return grouped_mm_reference(x_ND, w_eDF, offsets_e)
    if x_ND.dtype not in _GROUPED_MM_DTYPES:
        raise ValueError(f"grouped_mm: torch._grouped_mm has no {x_ND.dtype} kernel")
    size = x_ND.element_size()
    widths = {"the input width": w_eDF.shape[1], "output width": w_eDF.shape[2]}
    bad = [f"{name} ({n})" for name, n in widths.items() if n * size % 16]
    if bad:
        raise ValueError(
            f"grouped_mm: {' and '.join(bad)} must be multiples of {16 // size} in "
            f"{x_ND.dtype} (16-byte rows)"
        )
    return torch._grouped_mm(x_ND, w_eDF, offs=offsets_e)


def check_grouped_inputs(
    name: str, x_ND: torch.Tensor, w_eDF: torch.Tensor, offs_e: torch.Tensor
) -> None:
    """ValueError naming `name` unless x is (N, D), w (e, D, F) and offs int32 (e,). Shapes only:
    host-known metadata, no device sync."""
    if x_ND.dim() != 2 or w_eDF.dim() != 3 or x_ND.shape[1] != w_eDF.shape[1]:
        raise ValueError(
            f"{name}: expected x (N, D) and w (e, D, F), got {tuple(x_ND.shape)} and {tuple(w_eDF.shape)}"
        )
    if offs_e.dtype != torch.int32 or offs_e.shape != (w_eDF.shape[0],):
        raise ValueError(
            f"{name}: offs must be int32 of shape ({w_eDF.shape[0]},), got {offs_e.dtype} {tuple(offs_e.shape)}"
        )


@torch.library.custom_op(
    "moetrain::grouped_mm_weight_grad", mutates_args=(), tags=(torch.Tag.needs_exact_strides,)
)
def grouped_mm_weight_grad(
    x_ND: torch.Tensor, g_NF: torch.Tensor, offs_e: torch.Tensor
) -> torch.Tensor:
    """(e, D, F): each group's sum over its rows of x^T g, the weight gradient of `grouped_mm`.
    x.T of a row-major x is column-major, the layout whose jagged dim the CUDA kernel takes
    without alignment or non-empty requirements (row-major, every group but the last must be a
    multiple of 16 bytes, else a device-side assert). An opaque op with exact strides, so that
    a compiled graph cannot hand it an x that Inductor laid out column-major; float64 takes a
    loop over the groups."""
    x_ND, g_NF = x_ND.contiguous(), g_NF.contiguous()
    if x_ND.dtype in _GROUPED_MM_DTYPES:
        return torch._grouped_mm(x_ND.T, g_NF, offs=offs_e)
    out_eDF = x_ND.new_zeros(offs_e.numel(), x_ND.shape[1], g_NF.shape[1])
    start = 0
    for expert, end in enumerate(offs_e.tolist()):
        out_eDF[expert] = x_ND[start:end].T @ g_NF[start:end]
        start = end
    return out_eDF


@grouped_mm_weight_grad.register_fake
def _(x_ND, g_NF, offs_e):
    return x_ND.new_empty((offs_e.shape[0], x_ND.shape[1], g_NF.shape[1]))


class GroupedGemm:
    """An expert GEMM backend. `gemm(x_ND, w_eDF, offs_e)` is one grouped product: rows of x
    grouped by expert, `offs_e` (int32, on device) their cumulative END offsets, rows
    offs[i-1]:offs[i] multiplied by w[i]; rows past offs[-1] are padding, their output
    unspecified. `mlp` is the experts' whole SwiGLU MLP (here: two products and `swiglu`; a
    backend may run it as one op, and take `rows_fp8`, the rows a dispatcher already
    quantized). `quantized_rows(x_TD, order_N, top_k)` is what a local dispatcher hands the MLP
    as `rows_fp8` for the rows x_TD[order_N // top_k] (here: nothing to quantize). A subclass
    defines `__call__`, `name` and `emulated` (whether the product stands in for a kernel this
    device lacks)."""

    name: str
    emulated = False

    def __call__(
        self, x_ND: torch.Tensor, w_eDF: torch.Tensor, offs_e: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError

    def mlp(
        self,
        x_ND: torch.Tensor,
        w_up_eD2F: torch.Tensor,
        w_down_eFD: torch.Tensor,
        offs_e: torch.Tensor,
        w_N: torch.Tensor | None = None,
        rows_fp8: FP8Rows = NO_FP8_ROWS,
    ) -> torch.Tensor:
        h_N2F = self(x_ND, w_up_eD2F, offs_e)
        return self(swiglu(h_N2F, w_N), w_down_eFD, offs_e)

    def quantized_rows(self, x_TD: torch.Tensor, order_N: torch.Tensor, top_k: int) -> FP8Rows:
        return NO_FP8_ROWS


class BF16GroupedGemm(GroupedGemm):
    """`torch._grouped_mm` in the inputs' dtype, differentiable through torch's own formula."""

    name = "bf16"

    def __call__(
        self, x_ND: torch.Tensor, w_eDF: torch.Tensor, offs_e: torch.Tensor
    ) -> torch.Tensor:
        check_grouped_inputs(self.name, x_ND, w_eDF, offs_e)
        return grouped_mm(x_ND, w_eDF, offs_e)


class ReferenceGroupedGemm(GroupedGemm):
    """`grouped_mm_reference`, the loop over experts (offsets read on the host): the slow twin."""

    name = "reference"

    def __call__(
        self, x_ND: torch.Tensor, w_eDF: torch.Tensor, offs_e: torch.Tensor
    ) -> torch.Tensor:
        return grouped_mm_reference(x_ND, w_eDF, offs_e)


class ComposedGroupedGemm(GroupedGemm):
    """`gemm`'s products with the MLP composed of them one by one, no rows quantized ahead: the
    twin a backend's fused `mlp` is tested against."""

    def __init__(self, gemm: GroupedGemm) -> None:
        self.gemm, self.name, self.emulated = gemm, f"{gemm.name} (composed)", gemm.emulated

    def __call__(
        self, x_ND: torch.Tensor, w_eDF: torch.Tensor, offs_e: torch.Tensor
    ) -> torch.Tensor:
        return self.gemm(x_ND, w_eDF, offs_e)


class GroupedExperts(nn.Module):
    def __init__(
        self, num_experts: int, d_model: int, hidden: int, gemm: GroupedGemm | None = None
    ) -> None:
        super().__init__()
        self.num_experts, self.d_model, self.hidden = num_experts, d_model, hidden
        self.expert_offset = 0  # global id of local expert 0 (expert parallelism changes it)
        self.w_up_eD2F = nn.Parameter(torch.empty(num_experts, d_model, 2 * hidden))
        self.w_down_eFD = nn.Parameter(torch.empty(num_experts, hidden, d_model))
        self.gemm: GroupedGemm = BF16GroupedGemm() if gemm is None else gemm

    def forward(
        self,
        rows_ND: torch.Tensor,
        offsets_e: torch.Tensor,
        w_N: torch.Tensor | None = None,
        rows_fp8: FP8Rows = NO_FP8_ROWS,
    ) -> torch.Tensor:
        """y_ND for the rows grouped by `offsets_e`, scaled by the row weights w_N if given.
        `rows_fp8`: the rows in row-scaled FP8 (`nn.fp8.quantize_rows(rows_ND)`), which a fused
        FP8 MLP uses instead of quantizing them; ignored otherwise."""
        return self.gemm.mlp(rows_ND, self.w_up_eD2F, self.w_down_eFD, offsets_e, w_N, rows_fp8)
