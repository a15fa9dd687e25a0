"""The payloads dispatched rows travel in (`precision.dispatch`): what a dispatcher and the
collectives under it (parallel/comm.py) run on the rows, installed by the precision plan.

A payload `encode`s rows for the wire and `decode`s them on arrival (in the activations' dtype);
`loop_back` is what a group of one hands back (encoded and decoded, nothing moved), `round_trip`
the rounding alone, for a dispatcher whose rows never leave the device. Both are
straight-through in backward.
- `BF16Payload`: the activations' own dtype (bf16 in training); every method is the identity.
- `FP8Payload`: one uint8 row of D e4m3 bytes plus the fp32 row scale (row-scaled FP8), about
  half of bf16's bytes. Only the forward dispatch travels in FP8; the combine and gradients
  travel in the activations' dtype, the rounding straight-through (DeepSeek-V3's recipe).

Letters: R rows, D model dim, B bytes of a packed row.
"""

from __future__ import annotations

from typing import Protocol

import torch

from moetrain.kernels import quant
from moetrain.nn.fp8 import quantize_rows

SCALE_BYTES = 4  # one float32 per row


class Payload(Protocol):
    name: str

    def encode(self, x_RD: torch.Tensor) -> torch.Tensor: ...

    def decode(self, packed_RB: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...

    def loop_back(self, x_RD: torch.Tensor) -> torch.Tensor: ...

    def round_trip(self, x_RD: torch.Tensor) -> torch.Tensor: ...


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


class _FP8LoopBack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD):  # type: ignore[override]
        return decode_fp8_rows(encode_fp8_rows(x_RD), x_RD.dtype)

    @staticmethod
    def backward(ctx, grad_RD):  # type: ignore[override]
        return grad_RD


class BF16Payload:
    """Rows travel in the activations' own dtype."""

    name = "bf16"

    def encode(self, x_RD: torch.Tensor) -> torch.Tensor:
        return x_RD

    def decode(self, packed_RB: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return packed_RB

    def loop_back(self, x_RD: torch.Tensor) -> torch.Tensor:
        return x_RD

    def round_trip(self, x_RD: torch.Tensor) -> torch.Tensor:
        return x_RD


class FP8Payload:
    """Rows travel row-scaled FP8 (`encode_fp8_rows`), dequantized on arrival."""

    name = "fp8"

    def encode(self, x_RD: torch.Tensor) -> torch.Tensor:
        return encode_fp8_rows(x_RD)

    def decode(self, packed_RB: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return decode_fp8_rows(packed_RB, dtype)

    def loop_back(self, x_RD: torch.Tensor) -> torch.Tensor:
        """The packed rows decoded again, as an exchange within a group of one returns them."""
        return _FP8LoopBack.apply(x_RD)

    def round_trip(self, x_RD: torch.Tensor) -> torch.Tensor:
        return fp8_round_trip(x_RD)


BF16_PAYLOAD = BF16Payload()
FP8_PAYLOAD = FP8Payload()
