"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)), with gate and up fused in one matrix."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.nn.fp8 import fp8_linear


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.w_gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)
        self.fp8: str | None = None  # "fp8" or "fp8-emulated": both products in FP8 (nn.fp8)
        self.fp8_fast_accum = True  # precision.fp8_fast_accum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is None:
            gate, up = self.w_gate_up(x).chunk(2, dim=-1)
            return self.w_down(F.silu(gate) * up)
        kw = dict(emulate=self.fp8 == "fp8-emulated", fast_accum=self.fp8_fast_accum)
        gate, up = fp8_linear(x, [self.w_gate_up.weight], **kw).chunk(2, dim=-1)
        return fp8_linear(F.silu(gate) * up, [self.w_down.weight], **kw)
