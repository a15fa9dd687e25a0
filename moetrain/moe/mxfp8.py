"""The MXFP8 expert GEMM, emulated: each operand of each product is quantized to MXFP8 (e4m3
elements, one E8M0 scale per 32 elements) along that product's reduction dim, dequantized, and
multiplied in the input dtype (BF16 math for bf16 inputs).

MXFP8 grouped products are Blackwell-only in torch, so this emulation measures the recipe's
accuracy, never its speed. Letters: N rows (grouped by expert), D input dim, F output dim, e
experts.
"""

from __future__ import annotations

import torch

from moetrain.kernels import quant
from moetrain.moe.experts import (
    GroupedGemm,
    check_grouped_inputs,
    grouped_mm,
    grouped_mm_weight_grad,
)


class MXFP8EmulatedGroupedGemm(GroupedGemm):
    """Forward x along D, w along D; input grad gy along F, w along F; weight grad x and gy along
    the token dim. Token blocks are aligned to the global row index, so a block may straddle two
    experts (a hardware kernel would pad each group to 32 rows instead); padding rows are zeroed
    first so they cannot leak into a real row's scale. Needs D and F to be multiples of 32. The
    MLP is composed of two such products and `swiglu` (`GroupedGemm.mlp`).
    """

    name = "mxfp8 (emulation)"
    emulated = True

    def __call__(
        self, x_ND: torch.Tensor, w_eDF: torch.Tensor, offs_e: torch.Tensor
    ) -> torch.Tensor:
        check_grouped_inputs(self.name, x_ND, w_eDF, offs_e)
        d, f = w_eDF.shape[1:]
        if d % quant.MX_BLOCK or f % quant.MX_BLOCK:
            raise ValueError(f"{self.name}: D={d} and F={f} must be multiples of {quant.MX_BLOCK}")
        return _MXFP8Fn.apply(x_ND, w_eDF, offs_e, self)

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """MXFP8 round trip along the last dim, back in x's dtype."""
        return quant.dequantize_mxfp8(*quant.quantize_mxfp8(x), dtype=x.dtype)

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
        q, scale = quant.quantize_mxfp8(w.mT if reduction == "D" else w)
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
            grad_w_eDF = grouped_mm_weight_grad(x_dq_ND, g_dq_NF, offs_e).to(w_eDF.dtype)
        return grad_x_ND, grad_w_eDF, None, None
