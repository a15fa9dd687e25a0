"""The step's matrix products at a preset's shapes, in the formulations we could choose between.

    python benchmarks/gemm_bench.py [--preset small] [--iters 20]

1. Expert grouped GEMMs (`torch._grouped_mm`, bf16), per projection (up: D -> 2F, down: F -> D)
   and per product (forward, input gradient, weight gradient), for both weight layouts:
   `in_out` stores w[e, in, out] (moetrain's layout; the forward's B is row-major) and `out_in`
   stores w[e, out, in] (nn.Linear's; the forward reads w.mT, column-major). PyTorch's CUTLASS
   kernel picks its tile by the mean group size, so both layouts run the same tile shape; only
   the operand majorness differs. Group sizes come from a top-k of random scores (as a router at
   initialization gives: near-uniform with binomial noise).
2. The attention projections: q, k, v as three GEMMs against one fused qkv GEMM, forward and
   backward through autograd.
3. SDPA (causal) per backend, forward and forward + backward.
TFLOP/s count 2 M N K per product. Times are medians of CUDA-event samples after warm-up, a sleep
kernel queued before each so that launch latency is not timed (`moetrain.bench.timing.kernel_ms`).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moetrain.bench.timing import kernel_ms
from moetrain.presets import get_preset

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: smoke runs only


def row(label: str, ms: float, flops: float) -> None:
    print(f"| {label:<52} | {ms:8.3f} | {flops / ms / 1e9:7.0f} |", flush=True)


def header(title: str) -> None:
    print(
        f"\n{title}\n| {'product':<52} | {'ms':>8} | {'TFLOP/s':>7} |\n|{'-' * 54}|{'-' * 10}|{'-' * 9}|"
    )


def group_offsets(T: int, K: int, E: int, device) -> torch.Tensor:
    ids = torch.rand(T, E, device=device).topk(K, dim=-1).indices.flatten()
    return torch.bincount(ids, minlength=E).cumsum(0).to(torch.int32)


def layout_cases(x, g, w_io, w_oi, offs) -> dict:
    """(forward, input grad, weight grad) products of one projection for each weight layout."""
    gm = torch._grouped_mm
    return {
        "in_out": (
            lambda: gm(x, w_io, offs=offs),
            lambda: gm(g, w_io.mT, offs=offs),
            lambda: gm(x.mT, g, offs=offs),
        ),
        "out_in": (
            lambda: gm(x, w_oi.mT, offs=offs),
            lambda: gm(g, w_oi, offs=offs),
            lambda: gm(g.mT, x, offs=offs),
        ),
    }


def expert_gemms(T: int, K: int, E: int, D: int, Fh: int, iters: int) -> None:
    dev = DEVICE
    N = T * K
    offs = group_offsets(T, K, E, dev)
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    header(
        f"expert GEMMs: {N} rows, {E} groups (rows per group min {counts.min().item()}, "
        f"max {counts.max().item()}), D={D}, F={Fh}"
    )
    gm = torch._grouped_mm
    total = {"in_out": 0.0, "out_in": 0.0}
    for proj, din, dout in (("up", D, 2 * Fh), ("down", Fh, D)):
        x = torch.randn(N, din, device=dev, dtype=torch.bfloat16)
        g = torch.randn(N, dout, device=dev, dtype=torch.bfloat16)
        flops = 2 * N * din * dout
        w_io = torch.randn(E, din, dout, device=dev, dtype=torch.bfloat16) * 0.02
        w_oi = w_io.transpose(1, 2).contiguous()
        cases = layout_cases(x, g, w_io, w_oi, offs)
        ref = gm(x, w_io, offs=offs).float()
        for layout, fns in cases.items():
            err = (fns[0]().float() - ref).norm() / ref.norm()
            assert err < 1e-2, (layout, err)
            for name, fn in zip(("forward", "input grad", "weight grad"), fns, strict=True):
                ms = kernel_ms(fn, reps=iters)
                total[layout] += ms
                row(f"{proj} {name}, {layout}", ms, flops)
    for layout, ms in total.items():
        print(f"one layer's six products, {layout}: {ms:.3f} ms")


def fwd_bwd_ms(fn, inputs, iters: int) -> float:
    out = fn(*inputs)
    grad = torch.randn_like(out)

    def step():
        torch.autograd.backward(fn(*inputs), grad)

    return kernel_ms(step, reps=iters)


def projections(T: int, D: int, iters: int) -> None:
    header(f"attention projections, {T} tokens, D={D} (forward + backward)")
    x = torch.randn(T, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    ws = [torch.randn(D, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]  # fmt: skip
    w_qkv = torch.cat([w.detach() for w in ws]).requires_grad_()
    flops = 3 * 2 * T * D * 3 * D

    def separate(x, *ws):
        return torch.cat([F.linear(x, w) for w in ws], dim=-1)

    def three(x, *ws):  # what Attention runs: three products, their input grads summed
        q, k, v = (F.linear(x, w) for w in ws)
        return q + k + v

    def fused(x, w):
        return F.linear(x, w)

    row("q, k, v: three GEMMs (outputs summed)", fwd_bwd_ms(three, (x, *ws), iters), flops)
    row("q, k, v: three GEMMs (outputs concatenated)", fwd_bwd_ms(separate, (x, *ws), iters), flops)  # fmt: skip
    row("qkv: one fused GEMM", fwd_bwd_ms(fused, (x, w_qkv), iters), flops)
    row("forward only, three GEMMs", kernel_ms(lambda: [F.linear(x, w) for w in ws], reps=iters), flops / 3)  # fmt: skip
    row("forward only, fused", kernel_ms(lambda: F.linear(x, w_qkv), reps=iters), flops / 3)


def attention(B: int, N: int, S: int, H: int, iters: int) -> None:
    header(f"SDPA causal, B={B} heads={N} S={S} head_dim={H}")
    q, k, v = (
        torch.randn(B, S, N, H, device=DEVICE, dtype=torch.bfloat16)
        .transpose(1, 2)
        .requires_grad_()  # fmt: skip
        for _ in range(3)
    )
    fwd_flops = 4 * B * N * S * S * H / 2
    for name, backend in (
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):

        def fn(q, k, v, backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        try:
            row(f"{name} forward", kernel_ms(lambda: fn(q, k, v), reps=iters), fwd_flops)
            row(f"{name} forward + backward", fwd_bwd_ms(fn, (q, k, v), iters), 3.5 * fwd_flops)
        except RuntimeError as exc:
            print(f"{name}: {str(exc).splitlines()[0][:100]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", action="append", default=[])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    for name in args.preset or ["small"]:
        c = get_preset(name)
        m, moe, t = c.model, c.moe, c.train
        T = t.micro_batch_size * t.seq_len
        print(f"\n## {name}")
        expert_gemms(T, moe.top_k, moe.num_experts, m.d_model, moe.expert_hidden, args.iters)
        projections(T, m.d_model, args.iters)
        attention(t.micro_batch_size, m.num_heads, t.seq_len, m.dim_per_head, args.iters)


if __name__ == "__main__":
    main()
