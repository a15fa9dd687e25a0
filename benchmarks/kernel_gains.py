"""Does each hand-written Triton kernel earn its place? Kernel against its torch/Inductor twin at
its call site's shapes, per benchmark preset, as a share of the preset's step.

    PYTHONPATH=. python benchmarks/kernel_gains.py [--presets small,olmoe8,scale-E8,scale-E128]
        [--step-ms small=52.2,...] [--measure-steps] [--reps 10] [--json OUT.json]
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/kernel_gains.py --smoke   # CPU: runs every
        case on tiny shapes under Triton's interpreter (times meaningless)

For every kernel and preset: the kernel's entry point and its twin (the code the call site runs
without the kernel: the torch reference under torch.compile where the call site is a compiled
block, eager where it is inside an opaque op or the optimizer) on fresh random inputs of the
call site's shapes, forward + backward where both exist, median of `--reps` samples
(`bench.timing.kernel_ms`: a sleep kernel hides launch latency). gain = (twin - kernel) x calls
per step; share = gain / the preset's step time: measured (`--measure-steps`, `moetrain bench`'s
graphed step, mixed optimizer) or given (`--step-ms`; the defaults are benchmarks/RESULTS.md's
session-12 calibration check, H200, mixed optimizer). The FP8 rows (FP8 runs only) are shares of
that bf16 step. Each case runs in isolation: at the call site Inductor may also fuse the twin
with its neighbours, which only favours the twin, so a kernel under ~1% on every preset goes.
Results are appended to `--json` (JSON lines) as they come, so a timed-out run keeps its rows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from unittest import mock

import torch

from moetrain.config.presets import get_preset
from moetrain.tools.bench.timing import kernel_ms

PRESETS = ["small", "olmoe8", "scale-E8", "scale-E128"]
STEP_MS = {"small": 52.2, "olmoe8": 154.1, "scale-E8": 133.2, "scale-E128": 171.6}
OPTIMIZER_ELEMENTS = 1.2e9  # parameters timed at most; optimizer passes scale linearly past it
CE_CHUNK = 4096  # nn/loss.py's chunk_size


@dataclass
class Case:
    kernel: str  # the kernel's file and what it computes
    replaces: str
    calls: int  # per step of the preset
    run_kernel: object  # () -> None, one call (forward and backward)
    run_twin: object
    twin_context: object = nullcontext  # () -> context manager around the twin's calls
    scale: float = 1.0  # the times are of 1/scale of the call's work (optimizer passes)


class Shapes:
    """A preset's call-site shapes (`--smoke`: tiny ones of the same structure)."""

    def __init__(self, name: str, smoke: bool) -> None:
        c = get_preset(name)
        m, moe, t = c.model, c.moe, c.train
        self.name, self.layers = name, m.num_layers
        self.T = t.micro_batch_size * t.seq_len
        self.B, self.S, self.D, self.heads = t.micro_batch_size, t.seq_len, m.d_model, m.num_heads
        self.E, self.K, self.F, self.V = moe.num_experts, moe.top_k, moe.expert_hidden, m.vocab_size
        self.config = c
        if smoke:
            self.B, self.S, self.D, self.heads, self.F, self.V = 2, 32, 64, 4, 32, 320
            self.T, self.E, self.K = self.B * self.S, min(self.E, 16), min(self.K, 4)
        self.N = self.T * self.K


def rand(*shape, dtype=torch.bfloat16, device, scale=1.0):
    return (scale * torch.randn(*shape, device=device)).to(dtype)


def fwd_bwd(fn, inputs: list, diff: list):
    """() -> None: fn(*inputs) and the gradients of its differentiable outputs (against fixed
    random output gradients) w.r.t. `diff`."""
    first = fn(*inputs)
    first = first if isinstance(first, tuple) else (first,)
    keep = [i for i, o in enumerate(first) if o.requires_grad]
    grads = [torch.randn_like(first[i]) for i in keep]

    def run():
        outs = fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.grad([outs[i] for i in keep], diff, grads)

    return run


def routes(s: Shapes, device):
    """(order_N, inverse_TK) of a random top-k routing, as the LocalDispatcher has them."""
    scores = torch.rand(s.T, s.E, device=device)
    ids = scores.topk(s.K, dim=-1).indices.reshape(-1)
    order = torch.argsort(ids, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=device)
    return order, inverse.view(s.T, s.K)


def topk_cases(s: Shapes, device, compile_twin) -> list[Case]:
    """The router's top-k and routes per expert, forward only."""
    from moetrain.kernels import topk

    scores = torch.rand(s.T, s.E, device=device).softmax(-1)
    twin = compile_twin(topk.route_topk_reference)
    return [Case("topk (route_topk)", "torch.topk + scatter_add, compiled", s.layers,
                 lambda: torch.ops.moetrain.route_topk(scores, s.K), lambda: twin(scores, s.K))]  # fmt: skip


def gather_cases(s: Shapes, device, compile_twin) -> list[Case]:
    """The LocalDispatcher's row movements, forward + backward."""
    from moetrain.kernels import gather, gather_triton

    order, inverse = routes(s, device)
    x = rand(s.T, s.D, device=device).requires_grad_()
    y = rand(s.N, s.D, device=device).requires_grad_()
    g_twin = compile_twin(lambda x: gather._GatherRoutesReference.apply(x, order, inverse))
    s_twin = compile_twin(lambda y: gather._SumRoutesReference.apply(y, order, inverse))
    return [
        Case("gather (gather_routes)", "x[order // K], compiled", s.layers,
             fwd_bwd(lambda x: gather_triton.gather_routes_triton(x, inverse), [x], [x]),
             fwd_bwd(g_twin, [x], [x])),
        Case("gather (sum_routes)", "gather + sum over K, compiled", s.layers,
             fwd_bwd(lambda y: gather_triton.sum_routes_triton(y, inverse), [y], [y]),
             fwd_bwd(s_twin, [y], [y])),
    ]  # fmt: skip


def swiglu_cases(s: Shapes, device, compile_twin) -> list[Case]:
    """The experts' SwiGLU with row weights, forward + backward."""
    from moetrain.kernels import swiglu, swiglu_triton

    h = rand(s.N, 2 * s.F, device=device).requires_grad_()
    w = torch.rand(s.N, device=device).requires_grad_()
    twin = compile_twin(lambda h, w: swiglu._SwiGLUReference.apply(h, w))
    return [Case("swiglu", "silu(gate) * up * w, compiled", s.layers,
                 fwd_bwd(swiglu_triton.swiglu_triton, [h, w], [h, w]),
                 fwd_bwd(twin, [h, w], [h, w]))]  # fmt: skip


def qk_norm_rope_cases(s: Shapes, device, compile_twin) -> list[Case]:
    """Attention's qk-norm + RoPE over the fused projection, forward + backward."""
    from moetrain.kernels import qk_norm_rope_triton
    from moetrain.nn.attention import Attention

    H = s.D // s.heads
    attn = Attention(s.D, s.heads, s.heads, H, max_positions=s.S).to(device)
    for p in attn.parameters():  # bf16 weights, fp32 RoPE tables, as the trainer has them
        p.data = p.data.to(torch.bfloat16)
    qkv = rand(s.B, s.S, 3 * s.D, device=device, scale=2.0).requires_grad_()
    weights = [qkv, attn.q_norm.weight, attn.k_norm.weight]

    def kernel(qkv):
        return qk_norm_rope_triton.qkv_norm_rope_triton(
            qkv, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps,
            attn.rope.cos_SH, attn.rope.sin_SH, H, s.D,
        )  # fmt: skip

    def torch_path():  # Attention's path without the kernel
        return mock.patch.object(qk_norm_rope_triton, "supports", lambda *a: False)

    with torch_path():
        twin = fwd_bwd(compile_twin(attn._heads), [qkv], weights)
    return [Case("qk_norm_rope", "RMSNorm + RoPE of q and k, compiled", s.layers,
                 fwd_bwd(kernel, [qkv], weights), twin, torch_path)]  # fmt: skip


def cross_entropy_cases(s: Shapes, device, compile_twin) -> list[Case]:
    """One chunk's loss and softmax - onehot (its forward writes the gradient)."""
    from moetrain.kernels import cross_entropy_triton
    from moetrain.nn.loss import _chunk_loss_and_grad

    rows = min(CE_CHUNK, s.T)
    logits = rand(rows, s.V, device=device, scale=2.0)
    targets = torch.randint(0, s.V, (rows,), device=device)
    twin = compile_twin(_chunk_loss_and_grad)
    return [Case("cross_entropy (one chunk)", "logsumexp + softmax - onehot, compiled",
                 math.ceil(s.T / CE_CHUNK),
                 lambda: cross_entropy_triton.chunk_loss_and_grad_triton(logits, targets, 1e-4),
                 lambda: twin(logits, targets, 1e-4))]  # fmt: skip


def preset_tensors(s: Shapes, device, dtype=torch.bfloat16) -> tuple[list[torch.Tensor], float]:
    """The preset's parameter shapes as fresh tensors, at most OPTIMIZER_ELEMENTS elements, and
    the factor from their count to the preset's (1 when all fit)."""
    from moetrain.model.transformer import Transformer

    with torch.device("meta"):
        shapes = [p.shape for p in Transformer(s.config).parameters()]
    if s.D <= 64:  # smoke: a few small tensors
        shapes = [torch.Size((s.E, s.D, s.F)), torch.Size((s.V, s.D)), torch.Size((s.D,))]
    total, kept, n = sum(x.numel() for x in shapes), [], 0
    for shape in shapes:
        if n + shape.numel() > OPTIMIZER_ELEMENTS and kept:
            continue
        kept.append(shape)
        n += shape.numel()
    return [rand(*shape, dtype=dtype, device=device, scale=1e-2) for shape in kept], total / n


def adamw_cases(s: Shapes, device, compile_twin) -> list[Case]:
    """AdamW's update over the preset's parameters (mixed: bf16 parameters, fp32 masters and
    moments): optim/adamw.py with the Triton kernel against it with torch's fused AdamW."""
    from moetrain.kernels import adamw_triton  # noqa: F401 - the case goes with the kernel
    from moetrain.optim.adamw import AdamW

    grads, factor = preset_tensors(s, device)
    params = [torch.nn.Parameter(g.clone()) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    group = [{"params": params, "param_names": [str(i) for i in range(len(params))],
              "weight_decay": 0.1, "lr_mult": 1.0}]  # fmt: skip
    zero = torch.zeros((), device=device, dtype=torch.bool)

    def update(kernel):
        opt = AdamW(group, betas=(0.9, 0.95), eps=1e-8, master_weights=True, fused=True,
                    norm_fn=lambda: zero.float(), kernel=kernel)  # fmt: skip
        return lambda: opt._update(1e-3, zero, None)

    return [Case("adamw (one launch per group)", "torch fused AdamW + casts to the fp32 masters",
                 1, update("triton"), update("torch"), scale=factor)]  # fmt: skip


def sum_of_squares_cases(s: Shapes, device, compile_twin) -> list[Case]:
    """The gradient norm's sum of squares over the preset's bf16 gradients."""
    from moetrain.kernels import sum_of_squares_triton

    grads, factor = preset_tensors(s, device)

    def twin():
        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()

    return [Case("sum_of_squares (gradient norm)", "torch._foreach_norm", 1,
                 lambda: sum_of_squares_triton.multi_tensor_sum_of_squares(grads), twin,
                 scale=factor)]  # fmt: skip


def accumulate_cases(s: Shapes, device, compile_twin) -> list[Case]:
    """One micro-batch's bf16 gradients added into the fp32 buffers."""
    from moetrain.kernels import accumulate_triton

    grads, factor = preset_tensors(s, device)
    pairs = [(torch.empty_like(g, dtype=torch.float32), g) for g in grads]
    return [Case("accumulate (each micro-batch beyond one; the presets run one)",
                 "fp32 buffer add_ of the bf16 .grad", 1,
                 lambda: [accumulate_triton.accumulate_(b, g, False) for b, g in pairs],
                 lambda: [b.add_(g) for b, g in pairs], scale=factor)]  # fmt: skip


def fp8_cases(s: Shapes, device, compile_twin) -> list[Case]:
    """The FP8 experts' quantizations (precision.experts=fp8_rowwise), inside an opaque op: the
    twin is eager torch."""
    from moetrain.kernels import quant, quant_triton, swiglu, swiglu_triton

    x = rand(s.T, s.D, device=device)
    g = rand(s.N, s.D, device=device)
    w_up, w_down = rand(s.E, s.D, 2 * s.F, device=device), rand(s.E, s.F, s.D, device=device)
    h, ga = rand(s.N, 2 * s.F, device=device), rand(s.N, s.F, device=device)
    w_N = torch.rand(s.N, device=device)
    q = quant_triton.quantize_fp8_rowwise_triton

    def rows_kernel():
        for t in (x, g, w_up, w_down):  # x (dispatcher), gy (backward), weights along the rows
            q(t)

    def rows_twin():
        for t in (x, g, w_up, w_down):
            quant.quantize_fp8_rowwise(t)

    def swiglu_fp8_twin():
        quant.quantize_fp8_rowwise(swiglu.swiglu_reference(h, w_N))
        dh, _ = swiglu.weighted_swiglu_backward_reference(h, ga, w_N)
        quant.quantize_fp8_rowwise(dh)
        swiglu.swiglu_reference(h, w_N)

    L = s.layers
    return [
        Case("quant rows (FP8)", "eager quantize_fp8_rowwise", L, rows_kernel, rows_twin),
        Case("quant columns, transposed (FP8 weights)", "eager quantize of w.mT", L,
             lambda: [q(w, dim=-2, transposed=True) for w in (w_up, w_down)],
             lambda: [quant.quantize_fp8_rowwise(w.mT) for w in (w_up, w_down)]),
        Case("swiglu FP8 rows (forward + backward)", "eager SwiGLU + quantize", L,
             lambda: (swiglu_triton.swiglu_fp8_triton(h, w_N),
                      swiglu_triton.swiglu_fp8_backward_triton(h, ga, w_N)),
             swiglu_fp8_twin),
    ]  # fmt: skip


# One builder per kernel, each importing what it times: a deleted kernel's builder is skipped.
BUILDERS = [topk_cases, gather_cases, swiglu_cases, qk_norm_rope_cases, cross_entropy_cases,
            adamw_cases, sum_of_squares_cases, accumulate_cases, fp8_cases]  # fmt: skip


def built(build, s: Shapes, device, compile_twin) -> list[Case]:
    """build's cases, or none (said why) when its kernel was deleted or it fails."""
    try:
        return build(s, device, compile_twin)
    except ImportError as e:  # the kernel module was deleted
        print(f"{build.__name__}: skipped ({e})", flush=True)
    except Exception as e:  # noqa: BLE001 - one failing case must not cost the others
        print(f"{build.__name__} on {s.name}: failed ({type(e).__name__}: {e})"[:400], flush=True)
    return []


def time_case(case: Case, reps: int) -> tuple[float, float]:
    """(kernel ms, twin ms) of one call at the call site."""
    kernel = kernel_ms(case.run_kernel, reps=reps, warmup=2)
    with case.twin_context():
        twin = kernel_ms(case.run_twin, reps=reps, warmup=2)
    return kernel * case.scale, twin * case.scale


def measure_step(preset: str) -> float:
    from moetrain.tools.bench.harness import bench_moetrain

    return bench_moetrain(get_preset(preset), steps=5).stats["median_ms"]


def print_table(rows: list[dict]) -> None:
    """The markdown table of measured rows: kernel x preset, kernel / twin ms and share."""
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    cells: dict[str, dict[str, str]] = {}
    for r in rows:
        cell = f"{r['kernel_ms']:.3f} / {r['twin_ms']:.3f}, {r['share_pct']:+.2f}%"
        cells.setdefault(r["kernel"], {"replaces": r["replaces"]})[r["preset"]] = cell
    steps = {r["preset"]: r["step_ms"] for r in rows}
    print("\nstep ms: " + ", ".join(f"{p} {steps[p]:.1f}" for p in presets))
    print("| kernel | replaces | " + " | ".join(f"{p}: kernel / twin ms, share" for p in presets) + " |")  # fmt: skip
    print("|---|---|" + "---|" * len(presets))
    for kernel, row in cells.items():
        print(f"| {kernel} | {row['replaces']} | " + " | ".join(row.get(p, "-") for p in presets) + " |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--step-ms", default="", help="preset=ms,... (default: RESULTS.md's)")
    parser.add_argument("--measure-steps", action="store_true")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", help="append one JSON line per measured row here")
    parser.add_argument("--table", help="only print the table of this --json file")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, interpreter")
    args = parser.parse_args()
    if args.table:
        with open(args.table) as f:
            print_table([json.loads(line) for line in f if line.strip()])
        return
    t0 = time.perf_counter()
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke needs TRITON_INTERPRET=1 in the environment")
        device, compile_twin, args.reps = torch.device("cpu"), (lambda fn: fn), 1
    else:
        from moetrain.kernels.triton_support import triton_available

        if not (torch.cuda.is_available() and triton_available()):
            raise SystemExit("kernel_gains: needs a CUDA GPU and Triton (or --smoke)")
        device = torch.device("cuda")
        torch._dynamo.config.cache_size_limit = 64

        def compile_twin(fn):
            return torch.compile(fn, dynamic=False)

    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke)"
    print(f"{name}, torch {torch.__version__}", flush=True)
    step_ms = dict(STEP_MS)
    step_ms.update({k: float(v) for k, v in (p.split("=") for p in args.step_ms.split(",") if p)})
    rows = []
    for preset in args.presets.split(","):
        if args.measure_steps and not args.smoke:
            step_ms[preset] = measure_step(preset)
        shapes = Shapes(preset, args.smoke)
        for build in BUILDERS:  # one builder's tensors at a time
            for case in built(build, shapes, device, compile_twin):
                try:
                    kernel, twin = time_case(case, args.reps)
                except Exception as e:  # noqa: BLE001
                    print(f"{case.kernel} on {preset}: failed ({type(e).__name__}: {e})"[:400])
                    continue
                gain = (twin - kernel) * case.calls
                row = dict(preset=preset, kernel=case.kernel, replaces=case.replaces,
                           kernel_ms=kernel, twin_ms=twin, calls=case.calls, gain_ms=gain,
                           step_ms=step_ms[preset], share_pct=100 * gain / step_ms[preset])  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"{time.perf_counter() - t0:.0f} s")
    print_table(rows)


if __name__ == "__main__":
    main()
