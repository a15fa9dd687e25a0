"""Grouped SwiGLU experts: every local expert's weights in 3-D tensors, one GEMM per projection.

Letters: N rows (grouped by expert), D model dim, F expert hidden, e local experts.
    h_N2F = rows_ND @ w_up_eD2F[expert of row]      (gate and up fused: [gate | up])
    y_ND  = swiglu(h_N2F, w_N) @ w_down_eFD[expert of row]
                                   (w * silu(gate) * up, moetrain.kernels.swiglu)
Both products are one `torch._grouped_mm` each, driven by device-side offsets. The optional row
weights w_N are the router weights of the rows, handed over by a dispatcher whose combine then
only sums (LocalDispatcher): applied inside the SwiGLU, before the linear down projection, they
give the same result as weighting y, while the combine's backward needs no saved y. The GEMM is a
swappable callable (BF16, FP8 row-scaled, MXFP8 emulation); `grouped_mm_reference` is the
obvious loop over experts that tests compare against. Weights are indexed by global expert id
minus `expert_offset`, so expert parallelism only changes which slice of experts a rank holds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moetrain.kernels.swiglu import swiglu

GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
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
    """`torch._grouped_mm` where it supports the dtype and strides (rows of 16-byte multiples),
    else the reference loop (float64 tests, odd toy shapes)."""
    aligned = all(n * x_ND.element_size() % 16 == 0 for n in w_eDF.shape[1:])
    if x_ND.dtype in _GROUPED_MM_DTYPES and aligned:
        return torch._grouped_mm(x_ND, w_eDF, offs=offsets_e)
    return grouped_mm_reference(x_ND, w_eDF, offsets_e)


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, d_model: int, hidden: int, gemm: GroupedMM = grouped_mm):
        super().__init__()
        self.num_experts, self.d_model, self.hidden = num_experts, d_model, hidden
        self.expert_offset = 0  # global id of local expert 0 (expert parallelism changes it)
        self.w_up_eD2F = nn.Parameter(torch.empty(num_experts, d_model, 2 * hidden))
        self.w_down_eFD = nn.Parameter(torch.empty(num_experts, hidden, d_model))
        self.gemm = gemm

    def forward(
        self, rows_ND: torch.Tensor, offsets_e: torch.Tensor, w_N: torch.Tensor | None = None
    ) -> torch.Tensor:
        h_N2F = self.gemm(rows_ND, self.w_up_eD2F, offsets_e)
        return self.gemm(swiglu(h_N2F, w_N), self.w_down_eFD, offsets_e)
