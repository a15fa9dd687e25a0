"""Rotary position embedding (RoPE) in the "rotate half" layout used by Llama, OLMoE and HF.

The head dimension is split into two halves [a, b]; position p rotates pair (a_i, b_i) by angle
p * theta^(-2i/head_dim). Cosines and sines are recomputed from `inv_freq` for the sequence length
at hand (a tiny outer product), so there is no cache to invalidate when the length changes.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float = 10_000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
        return 1.0 / (self.theta ** (exponents / self.head_dim))

    def init_weights(self) -> None:
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def cos_sin(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (seq_len, head_dim)."""
        positions = torch.arange(seq_len, dtype=torch.float32, device=self.inv_freq.device)
        angles_SH = torch.outer(positions, self.inv_freq)
        angles_SD = torch.cat([angles_SH, angles_SH], dim=-1)
        return angles_SD.cos().to(dtype), angles_SD.sin().to(dtype)


def apply_rope(x_BNSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    half = x_BNSD.shape[-1] // 2
    rotated = torch.cat([-x_BNSD[..., half:], x_BNSD[..., :half]], dim=-1)
    return x_BNSD * cos_SD + rotated * sin_SD
