"""Causal self-attention: multi-head or grouped-query, optional qk-norm, RoPE, SDPA.

Shapes: B batch, S sequence, D d_model, N query heads, G key/value heads, H head dim.
qk-norm (OLMoE) is an RMSNorm over the full q and k projections, before the heads are split.
`torch.nn.functional.scaled_dot_product_attention` runs the flash or cuDNN kernels on GPU; the
backend can be pinned, since cuDNN is about twice as fast as flash on Hopper for our shapes.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from moetrain.nn.norm import RMSNorm
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


class Attention(nn.Module):
    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qk_norm: bool = True,
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
        self.q_norm = RMSNorm(num_heads * head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(num_kv_heads * head_dim, norm_eps) if qk_norm else None
        self.rope = RotaryEmbedding(head_dim, rope_theta, max_positions)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q, k, v = self.q_proj(x_BSD), self.k_proj(x_BSD), self.v_proj(x_BSD)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q_BNSH = q.view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k_BGSH = k.view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v_BGSH = v.view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rope.cos_sin(S, q.dtype)
        q_BNSH, k_BGSH = apply_rope(q_BNSH, cos, sin), apply_rope(k_BGSH, cos, sin)
        with self._kernel_choice(x_BSD.device):
            out_BNSH = F.scaled_dot_product_attention(
                q_BNSH,
                k_BGSH,
                v_BGSH,
                is_causal=True,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )
        return self.o_proj(out_BNSH.transpose(1, 2).reshape(B, S, -1))

    def _kernel_choice(self, device: torch.device) -> contextlib.AbstractContextManager:
        backend = self.backend
        if backend == "auto":
            backend = "cudnn" if device.type == "cuda" else "math"
        if device.type != "cuda" and backend != "math":
            return contextlib.nullcontext()
        return sdpa_kernel(_BACKENDS[backend], set_priority=True)
