"""Rotary position embedding (RoPE) in the "rotate half" layout used by Llama, OLMoE and HF.

The head dimension is split into two halves [a, b]; position p rotates pair (a_i, b_i) by angle
p * theta^(-2i/head_dim). The first `max_positions` positions' cos and sin are float32 tables
(buffers outside the state dict, rebuilt by `init_weights`; without them compiled code evaluates
cos and sin per element of q and k). Longer sequences, or a dtype wider than the tables, compute
them on the spot.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float = 10_000.0, max_positions: int = 0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
        self.head_dim = head_dim
        self.theta = theta
        self.max_positions = max_positions
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        cos_SH, sin_SH = self._tables(max_positions)
        self.register_buffer("cos_SH", cos_SH, persistent=False)
        self.register_buffer("sin_SH", sin_SH, persistent=False)

    def _inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
        return 1.0 / (self.theta ** (exponents / self.head_dim))

    def _tables(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each (position, frequency), shape (seq_len, head_dim / 2), in the
        dtype of `inv_freq` (float32 unless the module was cast)."""
        positions = torch.arange(seq_len, dtype=self.inv_freq.dtype, device=self.inv_freq.device)
        angles_SH = torch.outer(positions, self.inv_freq)
        return angles_SH.cos(), angles_SH.sin()

    def init_weights(self) -> None:
        self.inv_freq = self._inv_freq(self.inv_freq.device).to(self.inv_freq.dtype)
        self.cos_SH, self.sin_SH = self._tables(self.max_positions)

    def cos_sin(
        self, seq_len: int, dtype: torch.dtype, positions_BS: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions 0..seq_len-1, shape (seq_len, head_dim); with positions_BS
        (ints in [0, seq_len)), of those positions, shape (B, 1, seq_len, head_dim), which
        broadcasts over the heads of (B, heads, seq_len, head_dim)."""
        cached = seq_len <= self.cos_SH.shape[0] and dtype.itemsize <= self.cos_SH.dtype.itemsize
        if cached:
            cos_SH, sin_SH = self.cos_SH[:seq_len], self.sin_SH[:seq_len]
        else:
            cos_SH, sin_SH = self._tables(seq_len)
        if positions_BS is not None:
            cos_SH, sin_SH = cos_SH[positions_BS][:, None], sin_SH[positions_BS][:, None]
        cos_SD, sin_SD = torch.cat([cos_SH, cos_SH], dim=-1), torch.cat([sin_SH, sin_SH], dim=-1)
        return cos_SD.to(dtype), sin_SD.to(dtype)


def apply_rope(x_BNSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    half = x_BNSD.shape[-1] // 2
    rotated = torch.cat([-x_BNSD[..., half:], x_BNSD[..., :half]], dim=-1)
    return x_BNSD * cos_SD + rotated * sin_SD
