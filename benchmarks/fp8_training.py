"""FP8 products on Hopper: moetrain's FP8 linears and expert GEMMs against torchao's and BF16, on
the same shapes in the same job. (Whole FP8 steps: `moetrain bench --set precision.experts=...`.)

    python benchmarks/fp8_training.py [--json OUT.json]

Compiled forward + backward of one product at olmoe8's shapes (16,384 tokens): the q/k/v
projection (2048 -> 6144) and the output projection (2048 -> 2048) as BF16 `F.linear`,
moetrain's `fp8_linear` and torchao's `Float8Linear` (rowwise recipe); the expert up projection
(131,072 rows over 64 experts, 2048 -> 2048, group sizes rounded to 16, which torchao requires)
as BF16 `torch._grouped_mm`, moetrain's FP8RowwiseGroupedGemm and torchao's
`_to_fp8_rowwise_then_scaled_grouped_mm`, each in its own weight layout. Median ms (CUDA events)
and the relative error of output, input and weight gradient against fp32. torchao is optional:
without it its rows are skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from moetrain.moe.grouped_gemm import FP8RowwiseGroupedGemm
from moetrain.nn.fp8 import fp8_linear
from moetrain.tools.bench.timing import time_steps


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def timed(fn, reps: int = 20) -> float:
    return statistics.median(time_steps(fn, warmup=3, steps=reps, device=torch.device("cuda")))


def fwd_bwd(fn, x, w, g):
    """(output, grad x, grad w) of sum(fn(x, w) * g), and a zero-argument timer closure."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()

    def step():
        y = fn(x, w)
        return (y, *torch.autograd.grad(y, (x, w), g))

    return step


def torchao_linear():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    config = Float8LinearConfig.from_recipe_name("rowwise")

    def make(w_NK: torch.Tensor):
        holder = torch.nn.Sequential(torch.nn.Linear(w_NK.shape[1], w_NK.shape[0], bias=False))
        holder = holder.to(device=w_NK.device, dtype=w_NK.dtype)
        convert_to_float8_training(holder, config=config)
        return holder[0]

    return make


def linear_rows(tokens: int, reps: int) -> list[dict]:
    rows = []
    make_ao = torchao_linear()
    for name, k, n in (("qkv projection", 2048, 6144), ("output projection", 2048, 2048)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(tokens, k, device="cuda", generator=gen)
        w = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
        g = torch.randn(tokens, n, device="cuda", generator=gen)
        want = fwd_bwd(lambda a, b: F.linear(a, b), x, w, g)()
        x, w, g = x.bfloat16(), w.bfloat16(), g.bfloat16()
        steps = {
            "bf16": fwd_bwd(torch.compile(lambda a, b: F.linear(a, b)), x, w, g),
            "moetrain fp8": fwd_bwd(
                torch.compile(lambda a, b: fp8_linear(a, [b], emulate=False)), x, w, g
            ),
        }
        if make_ao is not None:  # torchao's module holds the weight as its parameter
            ao = make_ao(w)
            ao.weight.data.copy_(w)
            compiled_ao, x_ao = torch.compile(ao), x.detach().requires_grad_()

            def ao_step(compiled_ao=compiled_ao, x_ao=x_ao, ao=ao, g=g):
                y = compiled_ao(x_ao)
                return (y, *torch.autograd.grad(y, (x_ao, ao.weight), g))

            steps["torchao fp8 rowwise"] = ao_step
        for kind, step in steps.items():
            got = step()
            ms = timed(step, reps)
            flops = 6 * tokens * k * n
            rows.append(
                {
                    "product": name, "kernel": kind, "ms": ms, "tflops": flops / ms / 1e9,
                    **errors(got, want),
                }
            )  # fmt: skip
            print_row(rows[-1])
    return rows


def grouped_rows(rows_n: int, experts: int, d: int, f: int, reps: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    share = torch.rand(experts, generator=gen, device="cuda") * 1.5 + 0.25
    counts = (share / share.sum() * rows_n / 16).floor().long() * 16
    counts[0] += rows_n - counts.sum()
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(rows_n, d, device="cuda", generator=gen)
    w = torch.randn(experts, d, f, device="cuda", generator=gen) / d**0.5
    g = torch.randn(rows_n, f, device="cuda", generator=gen)
    want = fwd_bwd(lambda a, b: torch._grouped_mm(a, b, offs=offs), x, w, g)()
    x, w, g = x.bfloat16(), w.bfloat16(), g.bfloat16()
    ours = FP8RowwiseGroupedGemm()
    kinds = {
        "bf16": (lambda a, b: torch._grouped_mm(a, b, offs=offs), w),
        "moetrain fp8": (lambda a, b: ours(a, b, offs), w),
    }
    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import (
            _to_fp8_rowwise_then_scaled_grouped_mm as ao_mm,
        )

        w_col = w.mT.contiguous().mT  # (e, D, F) stored column-major, the layout torchao wants
        kinds["torchao fp8 rowwise"] = (
            lambda a, b: ao_mm(a, b, offs, pad_token_groups_for_grouped_mm=False),
            w_col,
        )
    except ImportError:
        pass
    out = []
    for kind, (fn, weight) in kinds.items():
        try:
            step = fwd_bwd(torch.compile(fn), x, weight, g)
            got = step()
            ms = timed(step, reps)
        except Exception as e:  # a library's constraint: report it, keep the other rows
            print(f"  expert up projection {kind}: failed: {type(e).__name__}: {e}"[:400])
            continue
        flops = 6 * rows_n * d * f
        out.append(
            {
                "product": "expert up projection", "kernel": kind, "ms": ms,
                "tflops": flops / ms / 1e9,
                **errors(got, want),
            }
        )  # fmt: skip
        print_row(out[-1])
    return out


def errors(got, want) -> dict:
    return {f"rel_{t}": rel(a, b) for t, a, b in zip(("y", "gx", "gw"), got, want, strict=True)}


def print_row(r: dict) -> None:
    print(
        f"  {r['product']:<21} {r['kernel']:<20} {r['ms']:7.3f} ms {r['tflops']:6.0f} TFLOP/s  "
        f"rel err y {r['rel_y']:.4f} gx {r['rel_gx']:.4f} gw {r['rel_gw']:.4f}",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    results: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    try:
        import torchao

        results["torchao"] = torchao.__version__
    except ImportError:
        results["torchao"] = None
    print("compiled forward + backward, olmoe8 shapes")
    results["linear"] = linear_rows(16384, reps=20)
    save(results, args.json)
    results["grouped"] = grouped_rows(131072, 64, 2048, 2048, reps=10)
    save(results, args.json)


def save(results: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
