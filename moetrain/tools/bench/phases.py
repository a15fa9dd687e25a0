"""Per-phase GPU time of one training step, from the PyTorch profiler's kernel list.

Kernels are assigned to phases by name. The rules are heuristics over the kernel names that
cuBLAS, cuDNN, CUTLASS, flash attention and PyTorch's own kernels use on Hopper; anything
unmatched is "other", so the phases always add up to the measured GPU time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# (phase, substrings); first match wins, so specific rules come first.
RULES: list[tuple[str, tuple[str, ...]]] = [
    ("optimizer", ("adam", "foreach", "multi_tensor", "_sum_of_squares")),
    ("attention", ("flash", "fmha", "cudnn", "sdpa", "attention", "attn")),
    ("expert GEMMs", ("grouped", "group_gemm", "groupedgemm", "groupproblemshape")),
    # moetrain's Triton quantizers (kernels/quant_triton.py) and torch's float8 casts
    (
        "FP8 conversions",
        (
            "_rowwise_kernel",
            "_column_kernel",
            "_column_amax",
            "_column_cast",
            "_mxfp8",
            "float8",
        ),
    ),
    (
        "dispatch/combine (sort, gather, scatter)",
        (
            "sort",
            "radix",
            "index",
            "gather",
            "scatter",
            "cumsum",
            "scan",
            "bmm",
            "routes_kernel",
            "_route_topk",
        ),
    ),
    (
        "dense GEMMs (projections, router, LM head)",
        ("gemm", "nvjet", "cutlass", "sm90_xmma", "matmul"),
    ),
    (
        "loss (softmax, logsumexp)",
        ("logsumexp", "log_softmax", "softmax", "nll", "cross_entropy", "_ce_rows"),
    ),
    (
        "norms, activations, elementwise",
        ("norm", "silu", "swiglu", "elementwise", "vectorized", "reduce"),
    ),
]


def classify(kernel_name: str) -> str:
    lowered = kernel_name.lower()
    for phase, keys in RULES:
        if any(k in lowered for k in keys):
            return phase
    return "other"


def profile_phases(step: Callable[[], object], top: int = 0) -> dict[str, Any]:
    """Run `step` once under the profiler. Returns GPU milliseconds per phase ("phases"), the
    step's wall time between two CUDA events ("step_ms"; step_ms minus the phase total is time the
    GPU sat idle), and the `top` kernels by total time ("kernels": name, phase, calls, ms)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    per_kernel: dict[str, list[float]] = {}
    spans = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        spans.append((event.time_range.start, event.time_range.end, event.name))
        ms = event.device_time_total / 1e3
        phase = classify(event.name)
        totals[phase] = totals.get(phase, 0.0) + ms
        calls_ms = per_kernel.setdefault(event.name, [0, 0.0])
        calls_ms[0] += 1
        calls_ms[1] += ms
    kernels = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "phases": dict(sorted(totals.items(), key=lambda kv: -kv[1])),
        "step_ms": start.elapsed_time(end),
        "gaps": idle_gaps(spans, top),
        "kernels": [
            {"name": name[:160], "phase": classify(name), "calls": int(c), "ms": round(ms, 4)}
            for name, (c, ms) in kernels
        ],
    }


def idle_gaps(spans: list[tuple[float, float, str]], top: int) -> list[dict[str, Any]]:
    """The `top` longest stretches (us) in which no kernel ran, with the kernels around them."""
    spans = sorted(spans)
    gaps, busy_until, last = [], None, ""
    for start, end, name in spans:
        if busy_until is not None and start > busy_until:
            gaps.append(
                {"us": round(start - busy_until, 1), "after": last[:80], "before": name[:80]}
            )
        if busy_until is None or end > busy_until:
            busy_until, last = end, name
    return sorted(gaps, key=lambda g: -g["us"])[:top]
