"""The six expert products of one MoE layer: ATen's CUTLASS grouped GEMM against what Inductor's
max-autotune picks (its persistent Triton grouped-mm template, benchmarked against ATen).

    python benchmarks/grouped_mm_autotune.py [--preset small] [--backends ATEN,TRITON]

Each product is compiled on its own (`torch.compile(dynamic=False)`, `max_autotune_gemm` on) and
timed with `kernel_ms` on group sizes from a top-k of random scores (Inductor tunes on even
groups of its own). Inductor prints its AUTOTUNE table per product (the best choices, ms each).
The compiled result is checked against the eager one.
"""

from __future__ import annotations

import argparse
import time

import torch
from gemm_bench import group_offsets  # benchmarks/ is the script's directory, on sys.path

from moetrain.bench.timing import kernel_ms
from moetrain.presets import get_preset


def products(
    N: int, E: int, D: int, Fh: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """name -> (a, b, flops) with torch._grouped_mm(a, b, offs) the product autograd runs."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    cases = {}
    for proj, din, dout in (("up", D, 2 * Fh), ("down", Fh, D)):
        x, g = torch.randn(N, din, **bf16), torch.randn(N, dout, **bf16)
        w = torch.randn(E, din, dout, **bf16) * 0.02
        flops = 2.0 * N * din * dout
        cases[f"{proj} forward"] = (x, w, flops)
        cases[f"{proj} input grad"] = (g, w.mT, flops)
        cases[f"{proj} weight grad"] = (x.mT, g, flops)
    return cases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--backends", default="ATEN,TRITON")
    parser.add_argument("--only", default="", help="comma-separated product names")
    args = parser.parse_args()
    c = get_preset(args.preset)
    T = c.train.micro_batch_size * c.train.seq_len
    N, E = T * c.moe.top_k, c.moe.num_experts
    offs = group_offsets(T, c.moe.top_k, E, "cuda")
    print(f"{args.preset}: {N} rows, {E} groups, D={c.model.d_model}, F={c.moe.expert_hidden}")
    options = {"max_autotune_gemm": True, "max_autotune_gemm_backends": args.backends}
    total = {"eager": 0.0, "autotuned": 0.0}
    for name, (a, b, flops) in products(N, E, c.model.d_model, c.moe.expert_hidden).items():
        if args.only and name not in args.only.split(","):
            continue
        torch._dynamo.reset()
        fn = torch.compile(lambda a, b, o: torch._grouped_mm(a, b, offs=o), dynamic=False, options=options)  # fmt: skip
        t0 = time.perf_counter()
        out = fn(a, b, offs)
        compile_s = time.perf_counter() - t0
        ref = torch._grouped_mm(a, b, offs=offs)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        eager = kernel_ms(lambda a=a, b=b: torch._grouped_mm(a, b, offs=offs))
        tuned = kernel_ms(lambda a=a, b=b, fn=fn: fn(a, b, offs))
        total["eager"] += eager
        total["autotuned"] += tuned
        print(
            f"| {name:<18} | eager {eager:.3f} ms {flops / eager / 1e9:4.0f} TFLOP/s | autotuned "
            f"{tuned:.3f} ms {flops / tuned / 1e9:4.0f} | rel err {err:.1e} | compile {compile_s:.0f} s |",
            flush=True,
        )
    print(f"six products: eager {total['eager']:.3f} ms, autotuned {total['autotuned']:.3f} ms")


if __name__ == "__main__":
    main()
