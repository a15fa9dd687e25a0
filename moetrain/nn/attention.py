"""Causal self-attention: multi-head or grouped-query, optional qk-norm, RoPE, SDPA.

Shapes: B batch, S sequence, D d_model, N query heads, G key/value heads, H head dim.
qk-norm "full" (OLMoE) is an RMSNorm over the full q and k projections, before the heads are
split; "per_head" (Qwen3) an RMSNorm over each head's H features, one H-wide weight for all heads
of q and one for k; both before RoPE, with the parameter names q_norm.weight, k_norm.weight.
q, k and v come from one GEMM against the three projection weights, which stay three parameters
(as in Hugging Face checkpoints) and are concatenated in forward and backward (`gemm.stacked`,
nn/linear.py) rather than kept concatenated (a D x C copy per layer and micro-batch in flight).
The projections run on `gemm`, the backend the precision plan installs (bf16 by default). On
CUDA with Triton, full qk-norm and RoPE run fused (kernels/qk_norm_rope_triton.py, fp32 math
rounded once); the torch path rounds between norm and RoPE. `qk_norm_rope_reference` is the fused
op's twin. Per-head qk-norm takes the torch path (compiled with the block on GPU): the kernel
reduces over whole rows, and a per-head reduction would be another kernel, measured against its
twin.
SDPA runs flash or cuDNN on GPU (the backend can be pinned). Given a `DocumentMask`
(nn/document_mask.py), attention stays within each document and RoPE takes its positions.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from moetrain.kernels import qk_norm_rope_triton
from moetrain.nn.document_mask import DocumentMask
from moetrain.nn.linear import BF16Linear, LinearGemm
from moetrain.nn.norm import RMSNorm, rms_norm_reference
from moetrain.nn.rope import RotaryEmbedding, apply_rope

_BACKENDS = {
    "cudnn": [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
    ],
    "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "math": [SDPBackend.MATH],
}


def qk_norm_rope_reference(
    x_BSD: torch.Tensor, weight: torch.Tensor, eps: float, cos_SH: torch.Tensor,
    sin_SH: torch.Tensor, head_dim: int, positions_BS: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """RMSNorm of each row of x_BSD (N heads of head_dim), then RoPE of each head at positions
    0..S-1 (or positions_BS) with the tables (max_positions, head_dim / 2), in fp32 (fp64 for
    fp64 inputs), rounded once to x's dtype; differentiable in x and weight."""
    B, S, D = x_BSD.shape
    acc = torch.promote_types(x_BSD.dtype, torch.float32)
    y_BSD = rms_norm_reference(x_BSD.to(acc), weight, eps)
    y_BNSH = y_BSD.view(B, S, D // head_dim, head_dim).transpose(1, 2)
    if positions_BS is None:
        cos_SH, sin_SH = cos_SH[:S].to(acc), sin_SH[:S].to(acc)
    else:  # (B, 1, S, head_dim / 2): one table row per position, broadcast over the heads
        cos_SH, sin_SH = (
            cos_SH[positions_BS][:, None].to(acc),
            sin_SH[positions_BS][:, None].to(acc),
        )
    cos_SD, sin_SD = torch.cat([cos_SH, cos_SH], dim=-1), torch.cat([sin_SH, sin_SH], dim=-1)
    y_BNSH = apply_rope(y_BNSH, cos_SD, sin_SD)
    return y_BNSH.transpose(1, 2).reshape(B, S, D).to(x_BSD.dtype)


class Attention(nn.Module):
    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qk_norm: str = "full",
        norm_eps: float = 1e-5,
        rope_theta: float = 10_000.0,
        max_positions: int = 0,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.backend = backend
        self.q_proj = nn.Linear(d_model, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, d_model, bias=False)
        if qk_norm not in ("none", "full", "per_head"):
            raise ValueError(f"qk_norm ({qk_norm!r}) must be none, full or per_head")
        self.qk_norm = qk_norm
        per_head = qk_norm == "per_head"  # one head_dim-wide weight shared by the heads
        q_width = head_dim if per_head else num_heads * head_dim
        k_width = head_dim if per_head else num_kv_heads * head_dim
        self.q_norm = RMSNorm(q_width, norm_eps) if qk_norm != "none" else None
        self.k_norm = RMSNorm(k_width, norm_eps) if qk_norm != "none" else None
        self.rope = RotaryEmbedding(head_dim, rope_theta, max_positions)
        self.gemm: LinearGemm = BF16Linear()  # the projections' GEMM (precision.linear)

    def forward(self, x_BSD: torch.Tensor, documents: DocumentMask | None = None) -> torch.Tensor:
        """Causal attention over the whole row, or within each of its `documents`."""
        B, S, _ = x_BSD.shape
        weights = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        positions_BS = documents.positions_BS if documents is not None else None
        q_BNSH, k_BGSH, v_BGSH = self._heads(self.gemm.stacked(x_BSD, weights), positions_BS)
        with self._kernel_choice(x_BSD.device):
            if documents is not None:
                out_BNSH = documents.attend(q_BNSH, k_BGSH, v_BGSH)
            else:
                out_BNSH = F.scaled_dot_product_attention(
                    q_BNSH,
                    k_BGSH,
                    v_BGSH,
                    is_causal=True,
                    enable_gqa=self.num_kv_heads != self.num_heads,
                )
        out_BSC = out_BNSH.transpose(1, 2).reshape(B, S, -1)
        return self.gemm(out_BSC, self.o_proj.weight)

    def _heads(
        self, qkv_BSC: torch.Tensor, positions_BS: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the fused projection split into heads, (B, N, S, H) and twice (B, G, S, H),
        q and k qk-normed and rotated (at positions 0..S-1, or positions_BS)."""
        B, S, _ = qkv_BSC.shape
        H, rope = self.head_dim, self.rope
        kv_width = self.num_kv_heads * H
        fused = (
            self.qk_norm == "full"  # the kernel's norm spans the row (module docstring)
            and qkv_BSC.is_cuda
            and qk_norm_rope_triton.supports(qkv_BSC, rope.cos_SH, kv_width)
        )
        if fused:
            q_BSD, k_BSD, v_BSD = qk_norm_rope_triton.qkv_norm_rope_triton(
                qkv_BSC, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                rope.cos_SH, rope.sin_SH, H, kv_width, positions_BS,
            )  # fmt: skip
        else:
            q_BSD, k_BSD, v_BSD = qkv_BSC.split([self.num_heads * H, kv_width, kv_width], -1)
            if self.qk_norm == "full":
                q_BSD, k_BSD = self.q_norm(q_BSD), self.k_norm(k_BSD)
        q_BSNH = q_BSD.view(B, S, self.num_heads, H)
        k_BSGH = k_BSD.view(B, S, self.num_kv_heads, H)
        if self.qk_norm == "per_head":
            q_BSNH, k_BSGH = self.q_norm(q_BSNH), self.k_norm(k_BSGH)
        q_BNSH, k_BGSH = q_BSNH.transpose(1, 2), k_BSGH.transpose(1, 2)
        v_BGSH = v_BSD.view(B, S, self.num_kv_heads, H).transpose(1, 2)
        if fused:
            return q_BNSH, k_BGSH, v_BGSH
        cos, sin = rope.cos_sin(S, qkv_BSC.dtype, positions_BS)
        return apply_rope(q_BNSH, cos, sin), apply_rope(k_BGSH, cos, sin), v_BGSH

    def _kernel_choice(self, device: torch.device) -> contextlib.AbstractContextManager:
        backend = self.backend
        if backend == "auto":
            backend = "cudnn" if device.type == "cuda" else "math"
        if device.type != "cuda" and backend != "math":
            return contextlib.nullcontext()
        return sdpa_kernel(_BACKENDS[backend], set_priority=True)
