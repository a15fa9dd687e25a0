"""Throughput, FLOP and memory accounting for the train record: tokens/s, TFLOP/s and MFU (model
FLOPs, model/flops.py, against the GPU's datasheet dense BF16 peak) over each log interval, and
the peak memory allocated.
"""

from __future__ import annotations

import time

import torch

# Datasheet dense BF16 TFLOP/s (no sparsity).
PEAK_TFLOPS = {
    "H100": 989.0,
    "H200": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "B200": 2250.0,
    "B300": 2250.0,
    "GH200": 989.0,
}


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_TFLOPS[key]
    return None


def peak_memory_gib(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    return torch.cuda.max_memory_allocated(device) / 2**30


class Throughput:
    """Tokens/s, TFLOP/s and MFU over the interval since the last `measure()`."""

    def __init__(self, flops_per_token: int, device: torch.device) -> None:
        self.flops_per_token = flops_per_token
        self.peak = peak_tflops(device)
        self.device = device
        self._t0 = time.perf_counter()
        self._tokens = 0

    def add_tokens(self, n: int) -> None:
        self._tokens += n

    def reset(self) -> None:
        self._t0, self._tokens = time.perf_counter(), 0

    def measure(self) -> dict[str, float | None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        tokens_per_s = self._tokens / elapsed
        tflops = tokens_per_s * self.flops_per_token / 1e12
        self.reset()
        return {
            "tokens_per_s": tokens_per_s,
            "tflops": tflops,
            "mfu": tflops / self.peak if self.peak else None,
        }
