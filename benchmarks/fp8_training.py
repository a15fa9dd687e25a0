"""FP8 training on Hopper: moetrain's FP8 linears and expert GEMMs against torchao's and BF16, on
the same shapes in the same job, then whole training steps.

    python benchmarks/fp8_training.py [--parts kernels,products,experts,steps]
        [--presets olmoe8,small] [--steps 8] [--json OUT.json]

1. kernels: compiled forward + backward of one product at olmoe8's shapes (16,384 tokens):
   the q/k/v projection (2048 -> 6144) and the output projection (2048 -> 2048) as BF16
   `F.linear`, moetrain's `fp8_linear` and torchao's `Float8Linear` (rowwise recipe); the expert
   up projection (131,072 rows over 64 experts, 2048 -> 2048, group sizes rounded to 16, which
   torchao requires) as BF16 `torch._grouped_mm`, moetrain's FP8RowwiseGroupedGemm and torchao's
   `_to_fp8_rowwise_then_scaled_grouped_mm`, each in its own weight layout. Median ms (CUDA
   events) and the relative error of output, input and weight gradient against fp32.
   torchao is optional: without it its rows are skipped.
2. products: the FP8 linear taken apart at olmoe8's and small's output projection: each product
   on pre-quantized operands against bf16, with precise and fast accumulation (and their errors
   against fp32 math on the same operands), and each quantization alone (CUDA-graph replays: a
   single eager call timed with events also counts its launch gaps).
3. experts: the FP8 expert GEMMs taken apart at each preset's shapes: per projection, each
   quantization (the weight's three ways), each FP8 product with precise and fast accumulation
   (the weight gradient's too, on equal groups), the whole ops, and the bf16 products they
   replace; then the SwiGLU with its quantization apart and fused, and the fused kernels' tiles.
4. steps: `moetrain bench`'s step (mixed optimizer, CUDA graph) of each preset in BF16 and in
   the FP8 variants of VARIANTS (experts; experts composed per product; experts with precise
   accumulation; experts and projections; and the LM head; and the experts' weight gradients):
   median ms, peak GiB, graphed or not.

Prediction (olmoe8, H200, from the FLOP split in the FP8 issue): the expert GEMMs' forward and
input gradient are ~38% of the FLOPs and run ~1.3x faster in FP8 (926 vs 720 TFLOP/s), the
projections ~19% at up to 1.76x (1,400 vs 794); quantizing activations and weights adds about
3 bytes per element per operand (~6 ms a step). Net: ~8% (experts alone: ~3%) at equal power;
more if the FP8 GEMMs' lower energy per FLOP lifts the capped clock.
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
from moetrain.moe.fp8_gemm import FP8RowwiseGroupedGemm
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


def graph_timed(fn, reps: int = 20) -> float:
    """Median ms of `fn` replayed as a CUDA graph: its device time alone, as a graphed training
    step runs it (a single eager call timed with events also counts its launch gaps, which for
    short kernels can be most of the figure)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compiles, autotunes, allocates outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timed(graph.replay, reps)


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


def expert_pieces(x, w, g, offs) -> dict:
    """The pieces of one expert projection y = x @ w (grouped by `offs`), gradient g: the bf16
    products, each step of the FP8 path on operands quantized beforehand, and the whole FP8 ops."""
    from moetrain.moe.fp8_gemm import (
        _grouped_weight_grad,
        fp8_grouped_mm,
        fp8_grouped_mm_backward,
        quantized_weight,
        scaled_grouped_mm,
    )
    from moetrain.nn.fp8 import quantize_rows

    qx, qwd = quantize_rows(x), quantized_weight(w, "D")
    qg, qwf = quantize_rows(g), quantized_weight(w, "F")
    bf16 = torch.bfloat16
    # The weight gradient's FP8 product (2-D x 2-D, jagged K = rows): x^T and g^T row-major, one
    # scale per (group, column); the groups here are equal multiples of 16, as the kernel needs.
    e = w.shape[0]
    xt_q, gt_q = qx[0].T.contiguous(), qg[0].T.contiguous()
    xt_s = torch.ones(e * x.shape[1], device=x.device)
    gt_s = torch.ones(e * g.shape[1], device=x.device)

    def wgrad(fast: bool) -> torch.Tensor:
        return torch._scaled_grouped_mm(
            xt_q, gt_q.T, xt_s, gt_s, offs=offs, out_dtype=bf16, use_fast_accum=fast
        )

    return {
        "bf16 forward": lambda: torch._grouped_mm(x, w, offs=offs),
        "bf16 input grad": lambda: torch._grouped_mm(g, w.mT, offs=offs),
        "bf16 weight grad": lambda: _grouped_weight_grad(x, g, offs),
        "fp8 quantize rows (fwd)": lambda: quantize_rows(x),
        "fp8 quantize weight (fwd)": lambda: quantized_weight(w, "D"),
        "fp8 quantize weight (fwd), bf16 copy first": lambda: quantize_rows(w.mT.contiguous()),
        "fp8 quantize weight (fwd), split amax + cast": lambda: split_column_kernels(w),
        **{
            f"fp8 quantize weight (fwd), one pass, tile {m}x{n}, {warps} warps": (
                lambda tile=(m, n, warps): one_pass_column_kernel(w, tile)
            )
            for m, n, warps in (
                (64, 64, 4),
                (256, 64, 8),
                (4096, 16, 8),  # the whole column block in registers (M <= 4096)
                (4096, 16, 16),
                (4096, 32, 16),
            )
        },
        "fp8 product (fwd)": lambda: scaled_grouped_mm(*qx, *qwd, offs, bf16, False),
        "fp8 product fast accum (fwd)": lambda: scaled_grouped_mm(
            *qx, *qwd, offs, bf16, False, True
        ),
        "fp8 quantize rows (input grad)": lambda: quantize_rows(g),
        "fp8 quantize weight (input grad)": lambda: quantized_weight(w, "F"),
        "fp8 product (input grad)": lambda: scaled_grouped_mm(*qg, *qwf, offs, bf16, False),
        "fp8 product fast accum (input grad)": lambda: scaled_grouped_mm(
            *qg, *qwf, offs, bf16, False, True
        ),
        "fp8 product (weight grad)": lambda: wgrad(False),
        "fp8 product fast accum (weight grad)": lambda: wgrad(True),
        "fp8 op forward": lambda: fp8_grouped_mm(x, w, offs, False, True),
        "fp8 op backward (input and weight grads)": lambda: fp8_grouped_mm_backward(
            g, x, w, offs, False, True
        ),
    }


def split_column_kernels(w):
    """The weight's forward quantization by the split kernels (amax over row blocks, then cast)."""
    from moetrain.kernels import quant_triton

    saved = quant_triton.COLUMN_PROGRAMS_MIN
    quant_triton.COLUMN_PROGRAMS_MIN = 10**9
    try:
        return quant_triton.quantize_fp8_rowwise_triton(w, -2, transposed=True)
    finally:
        quant_triton.COLUMN_PROGRAMS_MIN = saved


def one_pass_column_kernel(w, tile: tuple[int, int, int]):
    """The weight's forward quantization by the one-pass kernel with another tile and warps."""
    from moetrain.kernels import quant_triton

    saved = quant_triton.COLUMN_TILE
    quant_triton.COLUMN_TILE = tile
    try:
        return quant_triton.quantize_fp8_rowwise_triton(w, -2, transposed=True)
    finally:
        quant_triton.COLUMN_TILE = saved


def swiglu_pieces(n: int, f: int, gen) -> dict:
    """The SwiGLU between the projections with its FP8 quantization apart and fused."""
    from moetrain.kernels.swiglu import swiglu_fp8, swiglu_fp8_backward
    from moetrain.kernels.swiglu_triton import swiglu_triton
    from moetrain.nn.fp8 import quantize_rows

    h = torch.randn(n, 2 * f, device="cuda", generator=gen, dtype=torch.bfloat16)
    g = torch.randn(n, f, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.rand(n, device="cuda", generator=gen)
    from moetrain.kernels import swiglu_triton as st

    a = swiglu_triton(h, w)
    dh = torch.ops.moetrain.swiglu_backward(h, g, w)[0]
    out, q, scale = torch.empty_like(a), torch.empty(a.shape, dtype=torch.float8_e4m3fn, device="cuda"), torch.empty(n, device="cuda")  # fmt: skip
    dh_out, dh_q = torch.empty_like(dh), torch.empty(dh.shape, dtype=torch.float8_e4m3fn, device="cuda")  # fmt: skip
    dw = torch.empty(n, 1, device="cuda")
    configs = {
        f"tile {tile}, {warps} warps": st.quantizing_config(f, tile, warps)
        for tile, warps in ((4096, 4), (4096, 8), (2048, 4), (2048, 8), (1024, 4))
    }
    sweep = {}
    for name, cfg in configs.items():
        sweep[f"fused forward, {name}"] = lambda c=cfg: st.launch_forward(
            h, out, w, config=c, q_NF=q, scale_N=scale
        )
        sweep[f"fused backward, {name}"] = lambda c=cfg: st.launch_backward(
            h, g, dh_out, w, dw, config=c, q_N2F=dh_q, scale_N=scale
        )
    return sweep | {
        "swiglu forward": lambda: swiglu_triton(h, w),
        "swiglu forward, then quantize": lambda: quantize_rows(swiglu_triton(h, w)),
        "quantize its output alone": lambda: quantize_rows(a),
        "swiglu forward, quantization fused": lambda: swiglu_fp8(h, w),
        "swiglu backward": lambda: torch.ops.moetrain.swiglu_backward(h, g, w),
        "swiglu backward, then quantize": lambda: quantize_rows(
            torch.ops.moetrain.swiglu_backward(h, g, w)[0]
        ),
        "quantize dh alone": lambda: quantize_rows(dh),
        "swiglu backward, quantization fused": lambda: swiglu_fp8_backward(h, g, w),
    }


def expert_product_rows(preset: str, reps: int = 20) -> list[dict]:
    """Where the FP8 expert GEMMs' time goes at a preset's shapes (T K rows in E equal groups):
    the pieces (`expert_pieces`) of the up (D -> 2F) and down (F -> D) projections, timed as
    CUDA-graph replays."""
    config = get_preset(preset)
    t, m, moe = config.train, config.model, config.moe
    n, e, f = t.micro_batch_size * t.seq_len * moe.top_k, moe.num_experts, moe.expert_hidden
    offs = torch.full((e,), n // e, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(3)
    rows = []
    for name, d_in, d_out in (("up", m.d_model, 2 * f), ("down", f, m.d_model)):
        x, g = (
            torch.randn(n, d, device="cuda", generator=gen, dtype=torch.bfloat16)
            for d in (d_in, d_out)
        )
        w = torch.randn(e, d_in, d_out, device="cuda", generator=gen, dtype=torch.bfloat16)
        print(f"  {preset} expert {name} projection: {n} rows, {e} experts, {d_in} -> {d_out}")
        for piece, fn in expert_pieces(x, w, g, offs).items():
            ms = graph_timed(fn, reps)
            rows.append({"preset": preset, "projection": name, "piece": piece, "ms": ms})
            print(f"    {piece:<46} {ms:7.3f} ms", flush=True)
        errs = accumulation_errors(x, w, offs)
        rows.append({"preset": preset, "projection": name, "piece": "accumulation", **errs})
        print(
            "    forward error against fp32 math on the same FP8 operands: "
            + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()),
            flush=True,
        )
    print(f"  {preset} SwiGLU: {n} rows, hidden {f}")
    for piece, fn in swiglu_pieces(n, f, gen).items():
        ms = graph_timed(fn, reps)
        rows.append({"preset": preset, "projection": "swiglu", "piece": piece, "ms": ms})
        print(f"    {piece:<46} {ms:7.3f} ms", flush=True)
    return rows


def accumulation_errors(x, w, offs) -> dict:
    """Relative error of the FP8 forward product, precise and fast accumulation, against fp32
    math on the same dequantized operands: what the accumulation alone adds."""
    from moetrain.kernels import quant
    from moetrain.moe.fp8_gemm import quantized_weight, scaled_grouped_mm
    from moetrain.nn.fp8 import quantize_rows

    qx, qw = quantize_rows(x), quantized_weight(w, "D")
    x32 = quant.dequantize_fp8_rowwise(*qx)
    w32 = quant.dequantize_fp8_rowwise(*qw).mT
    want = torch._grouped_mm(x32, w32, offs=offs)
    return {
        f"{mode} accum": rel(scaled_grouped_mm(*qx, *qw, offs, torch.bfloat16, False, fast), want)
        for mode, fast in (("precise", False), ("fast", True))
    } | {"bf16 output rounding": rel(want.bfloat16(), want)}


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


def product_rows(tokens: int, k: int, n: int, reps: int = 20) -> list[dict]:
    """Where an FP8 linear's time goes: each of its three products alone on operands quantized
    beforehand, against the bf16 product, and each quantization alone (compiled, as a block
    runs it); every piece timed as CUDA-graph replays. y = x w^T with x (tokens, k), w (n, k)."""
    from moetrain.kernels import quant
    from moetrain.nn.fp8 import scaled_mm

    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(tokens, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    g = torch.randn(tokens, n, device="cuda", generator=gen, dtype=torch.bfloat16)
    quantize = torch.compile(quant.quantize_fp8_rowwise)
    operands = {  # product: (row-major a, b with the reduction dim last), as fp8_linear has them
        "forward": (x, w),
        "input grad": (g, w.T),
        "weight grad": (g.T, x.T),
    }
    rows = []
    for name, (a, b) in operands.items():
        qa, qb = quantize(a.contiguous()), quantize(b.contiguous())
        flops = 2 * a.shape[0] * a.shape[1] * b.shape[0]
        bf16_ms = graph_timed(lambda a=a, b=b: a @ b.T, reps)
        fp8_ms = graph_timed(lambda qa=qa, qb=qb: scaled_mm(*qa, *qb, torch.bfloat16, False), reps)
        fast_ms = graph_timed(
            lambda qa=qa, qb=qb: scaled_mm(*qa, *qb, torch.bfloat16, False, True), reps
        )
        want = quant.dequantize_fp8_rowwise(*qa) @ quant.dequantize_fp8_rowwise(*qb).T
        errs = {
            f"rel_{mode}": rel(scaled_mm(*qa, *qb, torch.bfloat16, False, fast), want)
            for mode, fast in (("precise", False), ("fast", True))
        }
        quant_ms = graph_timed(lambda a=a: quantize(a), reps) + graph_timed(
            lambda b=b: quantize(b), reps
        )
        rows.append(
            {
                "product": name, "shape": [a.shape[0], b.shape[0], a.shape[1]],
                "bf16_ms": bf16_ms, "bf16_tflops": flops / bf16_ms / 1e9,
                "fp8_ms": fp8_ms, "fp8_tflops": flops / fp8_ms / 1e9, "quantize_ms": quant_ms,
                "fp8_fast_ms": fast_ms, **errs,
            }
        )  # fmt: skip
        r = rows[-1]
        print(
            f"  {name:<12} (M, N, K) {tuple(r['shape'])}: bf16 {bf16_ms:.3f} ms "
            f"({r['bf16_tflops']:.0f} TFLOP/s), fp8 GEMM {fp8_ms:.3f} ms "
            f"({r['fp8_tflops']:.0f}), fast accum {fast_ms:.3f} ms, its two quantizations "
            f"{quant_ms:.3f} ms; error against fp32 on the same operands: precise "
            f"{errs['rel_precise']:.2e}, fast {errs['rel_fast']:.2e}",
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
    if "products" in parts:
        print("an FP8 linear's products and quantizations, olmoe8's output projection")
        results["products"] = product_rows(16384, 2048, 2048)
        print("the same at small's output projection")
        results["products_small"] = product_rows(16384, 1024, 1024)
        save(results, args.json)
    if "experts" in parts:
        print("the FP8 expert GEMMs taken apart, per preset (CUDA-graph replays)")
        results["experts"] = [r for p in args.presets.split(",") for r in expert_product_rows(p)]
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
