"""Per-phase GPU time of one training step, from the PyTorch profiler's kernel list.

Kernels are assigned to phases by name. The rules are heuristics over the kernel names that
cuBLAS, cuDNN, CUTLASS, flash attention and PyTorch's own kernels use on Hopper; anything
unmatched is "other", so the phases always add up to the measured GPU time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (phase, substrings); first match wins, so specific rules come first.
RULES: list[tuple[str, tuple[str, ...]]] = [
    ("optimizer", ("adam", "foreach", "multi_tensor")),
    ("attention", ("flash", "fmha", "cudnn", "sdpa", "attention", "attn")),
    ("expert GEMMs", ("grouped", "group_gemm", "groupedgemm", "groupproblemshape")),
    # moetrain's Triton quantizers (kernels/quant_triton.py) and torch's float8 casts
    ("FP8 conversions", ("_rowwise_kernel", "_column_amax", "_column_cast", "_mxfp8", "float8")),
    (
        "dispatch/combine (sort, gather, scatter)",
        ("sort", "radix", "index", "gather", "scatter", "cumsum", "scan", "bmm", "routes_kernel"),
    ),
    (
        "dense GEMMs (projections, router, LM head)",
        ("gemm", "nvjet", "cutlass", "sm90_xmma", "matmul"),
    ),
    ("loss (softmax, logsumexp)", ("logsumexp", "log_softmax", "softmax", "nll", "cross_entropy")),
    ("norms, activations, elementwise", ("norm", "silu", "elementwise", "vectorized", "reduce")),
]


def classify(kernel_name: str) -> str:
    lowered = kernel_name.lower()
    for phase, keys in RULES:
        if any(k in lowered for k in keys):
            return phase
    return "other"


def profile_phases(step: Callable[[], object]) -> dict[str, float]:
    """Run `step` once under the profiler; GPU milliseconds per phase."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        phase = classify(event.name)
        totals[phase] = totals.get(phase, 0.0) + event.device_time_total / 1e3
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))
