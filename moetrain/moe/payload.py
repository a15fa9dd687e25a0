"""FP8 payload for dispatched rows (`precision.dispatch = fp8`).

Dispatched rows travel as one uint8 row of D e4m3 bytes plus the fp32 row scale (row-scaled FP8),
about half of bf16's bytes, and are dequantized on arrival. Only the forward dispatch travels in
FP8; the combine and gradients travel in the activations' dtype, the rounding straight-through
(DeepSeek-V3's recipe).

Letters: R rows, D model dim.
"""

from __future__ import annotations

import torch

from moetrain.kernels import quant
from moetrain.nn.fp8 import quantize_rows

PAYLOADS = ("bf16", "fp8")
SCALE_BYTES = 4  # one float32 per row


def check_payload(payload: str) -> str:
    if payload not in PAYLOADS:
        raise ValueError(f"dispatch payload must be one of {PAYLOADS}, got {payload!r}")
    return payload


def encode_fp8_rows(x_RD: torch.Tensor) -> torch.Tensor:
    """[R, D] floats -> [R, D + 4] uint8: e4m3 elements, then the row's fp32 scale bytes."""
    q_RD, scale_R = quantize_rows(x_RD)  # fused by Inductor when compiled
    scale_bytes = scale_R.float().contiguous().view(torch.uint8).view(-1, SCALE_BYTES)
    return torch.cat([q_RD.view(torch.uint8), scale_bytes], dim=1)


def decode_fp8_rows(packed_RB: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `encode_fp8_rows`. An all-zero packed row (a sink or padding row) decodes to 0."""
    d = packed_RB.shape[1] - SCALE_BYTES
    q_RD = packed_RB[:, :d].view(torch.float8_e4m3fn)
    scale_R = packed_RB[:, d:].contiguous().view(torch.float32).view(-1)
    return quant.dequantize_fp8_rowwise(q_RD, scale_R, dim=-1, dtype=dtype)


def fp8_round_trip_reference(x_RD: torch.Tensor) -> torch.Tensor:
    """What the experts receive for rows `x_RD` under the FP8 payload (no gradient): the
    decoded packed rows, without packing them (nothing travels)."""
    q_RD, scale_R = quantize_rows(x_RD)  # fused by Inductor when compiled
    return quant.dequantize_fp8_rowwise(q_RD, scale_R, dim=-1, dtype=x_RD.dtype)


class _FP8RoundTrip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD):  # type: ignore[override]
        return fp8_round_trip_reference(x_RD)

    @staticmethod
    def backward(ctx, grad_RD):  # type: ignore[override]
        return grad_RD


def fp8_round_trip(x_RD: torch.Tensor) -> torch.Tensor:
    """Quantize and dequantize rows, straight-through in backward. Used where rows do not leave
    the device (one rank, LocalDispatcher): the experts see the same values as under expert
    parallelism, so a run's numerics do not depend on its layout."""
    return _FP8RoundTrip.apply(x_RD)
