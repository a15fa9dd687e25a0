"""The gradient-accumulation passes of `precision.grad_dtype=fp32` over a preset's parameter
shapes: torch's cross-dtype copy_/add_ against the fused Triton pass
(`moetrain.kernels.accumulate_triton`), and autograd's bf16 accumulation (the bf16 path) for
reference. Median ms of 20 repetitions (CUDA events) and effective TB/s.

    PYTHONPATH=. python benchmarks/grad_accum_bench.py [--preset small] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from moetrain.bench.timing import time_steps
from moetrain.kernels.accumulate_triton import accumulate_
from moetrain.model.transformer import Transformer
from moetrain.presets import get_preset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--json")
    args = p.parse_args()
    with torch.device("meta"):
        shapes = [tuple(q.shape) for q in Transformer(get_preset(args.preset)).parameters()]
    n = sum(torch.Size(s).numel() for s in shapes)
    grads = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
    other = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
    bufs = [torch.empty(s, device="cuda") for s in shapes]

    def each(op, outs):
        return lambda: [op(o, g) for o, g in zip(outs, grads, strict=True)]

    passes = {  # name: (one pass over every tensor, bytes moved per element)
        "torch copy_ (bf16 -> fp32)": (each(torch.Tensor.copy_, bufs), 6),
        "triton first": (each(lambda b, g: accumulate_(b, g, True), bufs), 6),
        "torch add_ (fp32 += bf16)": (each(torch.Tensor.add_, bufs), 10),
        "triton add": (each(lambda b, g: accumulate_(b, g, False), bufs), 10),
        "torch bf16 += bf16 (autograd's)": (each(torch.Tensor.add_, other), 6),
    }
    out = {"preset": args.preset, "params": n, "tensors": len(shapes), "passes": {}}
    for name, (fn, nbytes) in passes.items():
        ms = statistics.median(time_steps(fn, warmup=3, steps=20, device=torch.device("cuda")))
        out["passes"][name] = {"ms": ms, "TB/s": nbytes * n / ms / 1e9}
        print(f"{name:34s} {ms:8.3f} ms  {nbytes * n / ms / 1e9:6.2f} TB/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
