"""FP8 training on Hopper: moetrain's FP8 linears and expert GEMMs against torchao's and BF16, on
the same shapes in the same job, then whole training steps.

    python benchmarks/fp8_training.py [--parts kernels,steps] [--presets olmoe8,small]
        [--variants ...] [--steps 8] [--json OUT.json]

1. kernels: compiled forward + backward of one product at olmoe8's shapes (16,384 tokens):
   the q/k/v projection (2048 -> 6144) and the output projection (2048 -> 2048) as BF16
   `F.linear`, moetrain's `fp8_linear` and torchao's `Float8Linear` (rowwise recipe); the expert
   up projection (131,072 rows over 64 experts, 2048 -> 2048, group sizes rounded to 16, which
   torchao requires) as BF16 `torch._grouped_mm`, moetrain's FP8RowwiseGroupedGemm and torchao's
   `_to_fp8_rowwise_then_scaled_grouped_mm`, each in its own weight layout. Median ms (CUDA
   events) and the relative error of output, input and weight gradient against fp32.
   torchao is optional: without it its rows are skipped.
2. steps: `moetrain bench`'s step (mixed optimizer, CUDA graph) of each preset in BF16 and in
   the FP8 variants of VARIANTS (experts; experts composed per product; experts with precise
   accumulation; experts and projections; and the LM head): median ms, peak GiB, graphed or not.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics

import torch
import torch.nn.functional as F

from moetrain.bench.harness import warmed_trainer
from moetrain.bench.timing import time_steps
from moetrain.moe.grouped_gemm import FP8RowwiseGroupedGemm
from moetrain.nn.fp8 import fp8_linear
from moetrain.presets import get_preset

FP8_EXPERTS = ["precision.experts=fp8_rowwise"]
VARIANTS = {  # name: (config overrides, FP8RowwiseGroupedGemm arguments other than the defaults)
    "bf16": ([], {}),
    "fp8 experts": (FP8_EXPERTS, {}),
    "fp8 experts unfused": (FP8_EXPERTS, {"fuse_swiglu": False}),
    "fp8 experts precise accum": ([*FP8_EXPERTS, "precision.fp8_fast_accum=false"], {}),
    "fp8 experts+linear": ([*FP8_EXPERTS, "precision.linear=fp8_rowwise"], {}),
    "fp8 experts+linear+head": (
        [*FP8_EXPERTS, "precision.linear=fp8_rowwise", "precision.lm_head=fp8_rowwise"],
        {},
    ),
}


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
            ms = timed(step)
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
    ours = FP8RowwiseGroupedGemm("cuda")
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


def time_variant(config, steps: int) -> dict:
    """One preset and precision as `moetrain bench` builds it (mixed optimizer, CUDA graph)."""
    torch.cuda.reset_peak_memory_stats()
    with warmed_trainer(config, "mixed") as (trainer, it):
        graphed = trainer.step_graph is not None and trainer.step_graph.graph is not None
        times = time_steps(
            lambda: trainer.train_step(it), warmup=2, steps=steps, device=trainer.device
        )
        loss = trainer.train_step(it).item()
    peak = torch.cuda.max_memory_allocated() / 2**30
    ms = statistics.median(times)
    return {"ms": ms, "peak_gib": peak, "graphed": graphed, "loss": loss, "times": times}


@contextlib.contextmanager
def expert_gemm(**gemm_args):
    """Builds the FP8 expert GEMMs with these arguments (levers the trainer has no switch for)."""
    from moetrain.train import build

    make = build.make_grouped_gemm
    if gemm_args:
        build.make_grouped_gemm = lambda recipe, device, **kw: (
            FP8RowwiseGroupedGemm(device, **kw, **gemm_args)
            if recipe == "fp8_rowwise"
            else make(recipe, device, **kw)
        )
    try:
        yield
    finally:
        build.make_grouped_gemm = make


def step_rows(presets: list[str], variants: list[str], steps: int) -> list[dict]:
    rows = []
    for preset in presets:
        for variant in variants:
            overrides, gemm_args = VARIANTS[variant]
            config = get_preset(preset).with_overrides(overrides)
            with expert_gemm(**gemm_args):
                row = {"preset": preset, "variant": variant, **time_variant(config, steps)}
            gc.collect()  # the trainer and its step graph's memory pool, before the next one
            torch.cuda.empty_cache()
            rows.append(row)
            base = next(r for r in rows if r["preset"] == preset)
            print(
                f"  {preset:<8} {variant:<20} {row['ms']:8.2f} ms  x{row['ms'] / base['ms']:.3f}  "
                f"peak {row['peak_gib']:6.2f} GiB  graphed {row['graphed']}  loss {row['loss']:.3f}",
                flush=True,
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--parts", default="kernels,steps")
    p.add_argument("--presets", default="olmoe8,small")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--json")
    args = p.parse_args()
    results: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    try:
        import torchao

        results["torchao"] = torchao.__version__
    except ImportError:
        results["torchao"] = None
    parts = args.parts.split(",")
    if "kernels" in parts:
        print("compiled forward + backward, olmoe8 shapes")
        results["linear"] = linear_rows(16384, reps=20)
        save(results, args.json)
        results["grouped"] = grouped_rows(131072, 64, 2048, 2048, reps=10)
        save(results, args.json)
    if "steps" in parts:
        print("training steps (moetrain bench, mixed optimizer)")
        results["steps"] = step_rows(args.presets.split(","), args.variants.split(","), args.steps)
        save(results, args.json)


def save(results: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
