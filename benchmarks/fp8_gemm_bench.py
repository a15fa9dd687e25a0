"""BF16 vs FP8 row-scaled grouped GEMMs at olmoe8 expert shapes, and FP8 quantizer bandwidth.

    python benchmarks/fp8_gemm_bench.py [--rows 131072] [--experts 64] [--iters 20]

GEMM rows: the bare kernels (`torch._grouped_mm`, `torch._scaled_grouped_mm` on pre-quantized
operands), then the whole FP8RowwiseGroupedGemm (quantization of activations and weights
included, as within a training step) against the BF16 backend, forward and forward+backward.
Backward TFLOP/s count the input and weight gradients (4 N D F). Quantizer rows: bytes moved
(read + written) per second, next to a plain device copy of the same activation.
Median of `--iters` runs timed with CUDA events, after warm-up. Needs a CUDA GPU of compute
capability 9.x or 10.x.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from moetrain.bench.timing import time_steps
from moetrain.kernels import quant, quant_triton
from moetrain.moe.fp8_gemm import (
    BF16GroupedGemm,
    FP8RowwiseGroupedGemm,
    fp8_unsupported_reason,
)


def time_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of `fn` (CUDA events, moetrain's benchmark timer)."""
    return statistics.median(time_steps(fn, warmup, iters, torch.device("cuda")))


def uneven_offsets(rows: int, experts: int, seed: int) -> torch.Tensor:
    """Random group sizes (0.25x .. 1.75x the mean) summing to `rows`, as int32 end offsets."""
    gen = torch.Generator().manual_seed(seed)
    share = torch.rand(experts, generator=gen) * 1.5 + 0.25
    counts = (share / share.sum() * rows).floor().long()
    counts[0] += rows - counts.sum()
    return counts.cumsum(0).to(torch.int32).cuda()


def row(name: str, ms: float, value: float, unit: str) -> None:
    print(f"| {name:<58} | {ms:8.3f} | {value:8.1f} {unit:<7} |")


def bench_gemms(rows: int, experts: int, d: int, f: int, iters: int) -> None:
    offs = uneven_offsets(rows, experts, seed=d + f)
    x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(experts, d, f, device="cuda") / d**0.5).to(torch.bfloat16)
    grad_y = torch.randn(rows, f, device="cuda", dtype=torch.bfloat16)
    fwd_flops = 2 * rows * d * f
    tflops = lambda flops, ms: flops / ms / 1e9  # noqa: E731

    print(f"\n{rows} rows, {experts} uneven groups, D={d}, F={f}")
    print(f"| {'operation':<58} | {'ms':>8} | {'rate':>16} |")
    print(f"|{'-' * 60}|{'-' * 10}|{'-' * 18}|")
    ms = time_ms(lambda: torch._grouped_mm(x, w, offs=offs), iters)
    row("bf16 torch._grouped_mm forward", ms, tflops(fwd_flops, ms), "TFLOP/s")
    ms = time_ms(lambda: torch._grouped_mm(grad_y, w.mT, offs=offs), iters)
    row("bf16 input gradient (grad_y @ w^T)", ms, tflops(fwd_flops, ms), "TFLOP/s")
    ms = time_ms(lambda: torch._grouped_mm(x.T, grad_y, offs=offs), iters)
    row("bf16 weight gradient (2-D x 2-D, jagged rows)", ms, tflops(fwd_flops, ms), "TFLOP/s")

    x_q, x_scale = quant_triton.quantize_fp8_rowwise_triton(x)
    w_q, w_scale = quant_triton.quantize_fp8_rowwise_triton(w.mT)  # (e, F, D): along D
    g_q, g_scale = quant_triton.quantize_fp8_rowwise_triton(grad_y)
    wt_q, wt_scale = quant_triton.quantize_fp8_rowwise_triton(w)  # (e, D, F): along F
    for fast in (False, True):
        ms = time_ms(
            lambda fast=fast: torch._scaled_grouped_mm(
                x_q,
                w_q.mT,
                x_scale,
                w_scale,
                offs=offs,
                out_dtype=torch.bfloat16,
                use_fast_accum=fast,
            ),
            iters,
        )
        row(
            f"fp8 torch._scaled_grouped_mm forward, fast_accum={fast}",
            ms,
            tflops(fwd_flops, ms),
            "TFLOP/s",
        )
    ms = time_ms(
        lambda: torch._scaled_grouped_mm(
            g_q, wt_q.mT, g_scale, wt_scale, offs=offs, out_dtype=torch.bfloat16
        ),
        iters,
    )
    row("fp8 input gradient, pre-quantized", ms, tflops(fwd_flops, ms), "TFLOP/s")

    backends = [BF16GroupedGemm(), FP8RowwiseGroupedGemm("cuda")]
    backends.append(FP8RowwiseGroupedGemm("cuda", use_fast_accum=True))
    for gemm in backends:
        label = gemm.name + (", fast_accum" if getattr(gemm, "use_fast_accum", False) else "")
        with torch.no_grad():
            fwd_ms = time_ms(lambda gemm=gemm: gemm(x, w, offs), iters)
        x_req = x.detach().requires_grad_()
        w_req = w.detach().requires_grad_()

        def step(gemm=gemm, x_req=x_req, w_req=w_req):
            x_req.grad = w_req.grad = None
            gemm(x_req, w_req, offs).backward(grad_y)

        total_ms = time_ms(step, iters)
        row(
            f"{label}: forward (quantization included)",
            fwd_ms,
            tflops(fwd_flops, fwd_ms),
            "TFLOP/s",
        )
        bwd_ms = total_ms - fwd_ms
        row(
            f"{label}: backward (= fwd+bwd - fwd)", bwd_ms, tflops(2 * fwd_flops, bwd_ms), "TFLOP/s"
        )


def bench_quantizers(rows: int, d: int, experts: int, f: int, iters: int) -> None:
    x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, d, f, device="cuda", dtype=torch.bfloat16)
    act_fp8_bytes = rows * d * (2 + 1) + rows * 4  # bf16 in, fp8 out, fp32 scales
    gbps = lambda nbytes, ms: nbytes / ms / 1e6  # noqa: E731

    print(f"\nQuantizers on a ({rows}, {d}) bf16 activation and ({experts}, {d}, {f}) bf16 weights")
    print(f"| {'operation':<58} | {'ms':>8} | {'rate':>16} |")
    print(f"|{'-' * 60}|{'-' * 10}|{'-' * 18}|")
    ms = time_ms(lambda: x.clone(), iters)
    row("device copy (x.clone())", ms, gbps(2 * x.numel() * 2, ms), "GB/s")
    for cast in (False, True):
        ms = time_ms(
            lambda cast=cast: quant_triton.quantize_fp8_rowwise_triton(x, software_cast=cast), iters
        )
        row(
            f"triton fp8 rowwise, dim=-1, software_cast={cast}", ms, gbps(act_fp8_bytes, ms), "GB/s"
        )
    ms = time_ms(lambda: quant.quantize_fp8_rowwise(x), iters)
    row("torch reference fp8 rowwise, dim=-1", ms, gbps(act_fp8_bytes, ms), "GB/s")
    mx_bytes = rows * d * (2 + 1) + rows * d // 32
    ms = time_ms(lambda: quant_triton.quantize_mxfp8_triton(x), iters)
    row("triton mxfp8", ms, gbps(mx_bytes, ms), "GB/s")
    ms = time_ms(lambda: quant.quantize_mxfp8(x), iters)
    row("torch reference mxfp8", ms, gbps(mx_bytes, ms), "GB/s")
    w_bytes = w.numel() * (2 * 2 + 1) + experts * f * 4  # read twice (amax, cast), write fp8
    ms = time_ms(lambda: quant_triton.quantize_fp8_rowwise_triton(w, dim=-2), iters)
    row("triton fp8 per-column weights, dim=-2 (two kernels)", ms, gbps(w_bytes, ms), "GB/s")
    ms = time_ms(lambda: quant_triton.quantize_fp8_rowwise_triton(w.mT), iters)
    row("triton fp8 weights along D via w.mT (copy + dim=-1)", ms, gbps(w_bytes, ms), "GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=131072)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    reason = fp8_unsupported_reason(torch.device("cuda")) if torch.cuda.is_available() else "no GPU"
    if reason is not None:
        raise SystemExit(f"fp8_gemm_bench: {reason}")
    if not quant_triton.triton_available():
        raise SystemExit("fp8_gemm_bench: Triton is not installed")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for d, f in ((2048, 2048), (2048, 1024)):
        bench_gemms(args.rows, args.experts, d, f, args.iters)
    bench_quantizers(args.rows, 2048, args.experts, 1024, args.iters)


if __name__ == "__main__":
    main()
