"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)), with gate and up fused in one matrix; both
products on `gemm`, the backend the precision plan installs (nn/linear.py; bf16 by default)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.nn.linear import BF16Linear, LinearGemm


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.w_gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)
        self.gemm: LinearGemm = BF16Linear()  # precision.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gemm(x, self.w_gate_up.weight).chunk(2, dim=-1)
        return self.gemm(F.silu(gate) * up, self.w_down.weight)
