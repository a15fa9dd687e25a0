"""Timing primitives: CUDA-event step timing, the measured matmul ceiling, summary statistics.

Rules (docs/benchmarks.md): warm up first, time forward + backward + optimizer step with device
events, report the median (and spread) of at least 5 timed steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def time_steps(
    step: Callable[[], object], warmup: int, steps: int, device: torch.device
) -> list[float]:
    """Milliseconds per call of `step`, each synchronized, after `warmup` untimed calls."""
    for _ in range(warmup):
        step()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def kernel_ms(
    fn: Callable[[], object],
    reps: int = 20,
    warmup: int = 3,
    prep: Callable[[], object] | None = None,
    sleep_cycles: int = 2_000_000,
) -> float:
    """Median milliseconds of one call of a short GPU operation (micro-benchmarks). Before each
    sample a sleep kernel keeps the GPU busy while the host queues the work, so launch latency is
    not timed, and `prep` (untimed) can restore inputs or evict L2. Without CUDA (the Triton
    interpreter's smoke runs) it returns the wall time of one call."""
    prep = prep or (lambda: None)
    for _ in range(warmup):
        prep()
        fn()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(sleep_cycles)
        prep()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def summarize(times_ms: list[float]) -> dict[str, float]:
    ordered = sorted(times_ms)
    q = statistics.quantiles(ordered, n=10) if len(ordered) >= 2 else [ordered[0]] * 9
    return {
        "median_ms": statistics.median(ordered),
        "p10_ms": q[0],
        "p90_ms": q[-1],
        "min_ms": ordered[0],
        "max_ms": ordered[-1],
    }


def matmul_tflops(device: torch.device, n: int = 8192, repeats: int = 10) -> float | None:
    """The BF16 n^3 matrix-product rate measured on this GPU (random inputs, median)."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times = time_steps(lambda: a @ b, warmup=3, steps=repeats, device=device)
    return 2 * n**3 / (statistics.median(times) * 1e-3) / 1e12


def steady_rate(work_per_chunk: float, chunk_ms: list[float]) -> tuple[float, float]:
    """(rate over all chunks, median rate over the last half) of equal chunks of work, per
    second: the second is the rate once the GPU's clock has settled at its power limit."""
    if not chunk_ms:
        raise ValueError("no chunks timed")
    overall = work_per_chunk * len(chunk_ms) / (sum(chunk_ms) * 1e-3)
    late = chunk_ms[len(chunk_ms) // 2 :]
    return overall, work_per_chunk / (statistics.median(late) * 1e-3)


def sustained_matmul(
    device: torch.device, n: int = 8192, seconds: float = 2.0, chunk: int = 50
) -> dict | None:
    """The BF16 n^3 product back to back for at least `seconds`, in chunks of `chunk`, with the
    GPU's state sampled: the rate at the power limit that training steps reach and the short
    `matmul_tflops` does not. Returns TFLOP/s over the run and its second half, the seconds run
    and the GPU's state; None off CUDA."""
    from moetrain.tools.bench.gpu_state import GpuStateSampler, nvml_reader

    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b, out=out)
    torch.cuda.synchronize(device)
    chunks_ms: list[float] = []
    t0 = time.perf_counter()
    with GpuStateSampler(nvml_reader(device)) as gpu:
        while time.perf_counter() - t0 < seconds:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(chunk):
                torch.matmul(a, b, out=out)
            end.record()
            end.synchronize()
            chunks_ms.append(start.elapsed_time(end))
    overall, late = steady_rate(chunk * 2 * n**3 / 1e12, chunks_ms)
    return {
        "tflops": overall,
        "tflops_second_half": late,
        "seconds": sum(chunks_ms) / 1e3,
        "gpu_state": gpu.summary(),
    }
