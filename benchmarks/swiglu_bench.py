"""SwiGLU of the grouped experts: torch.compile'd silu(gate) * up against the Triton op.

    python benchmarks/swiglu_bench.py [--rows 131072] [--hidden 512 1024] [--iters 50] [--sweep]

For h of N x 2F ([gate | up]) in bf16, times forward and backward (through autograd, h requiring
grad as in the model) of
- `F.silu(gate) * up` under torch.compile (what GroupedExperts ran before the op);
- `moetrain.kernels.swiglu.swiglu`, i.e. the Triton op `moetrain::swiglu` on CUDA, without and
  with row weights (the router weights GroupedExperts applies there; the backward then also
  returns their gradient, a row sum).
Timing is gather_bench's: median of `--iters` CUDA-event samples after warm-up, a sleep kernel
queued before each sample to hide launch latency. GB/s count the bytes floor, 2 bytes an element:
forward reads 2F and writes F per row, backward reads 2F + F and writes 2F. `--sweep` times the
raw kernels over tiles and warps, to check `swiglu_triton.launch_config`.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from gather_bench import PEAK_GBPS, row, time_backward_ms, time_ms

from moetrain.kernels import swiglu_triton
from moetrain.kernels.swiglu import swiglu


def torch_swiglu(h_N2F: torch.Tensor) -> torch.Tensor:
    gate_NF, up_NF = h_N2F.chunk(2, dim=-1)
    return F.silu(gate_NF) * up_NF


def bench(N: int, hidden: int, iters: int) -> None:
    h = torch.randn(N, 2 * hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(N, hidden, device="cuda", dtype=torch.bfloat16)
    fwd_bytes, bwd_bytes = 2 * N * 3 * hidden, 2 * N * 5 * hidden

    print(f"\nN={N}, F={hidden}, bf16")
    print(f"| {'operation':<46} | {'ms':>7} | {'GB/s':>7} | {'peak':>6} |")
    print(f"|{'-' * 48}|{'-' * 9}|{'-' * 9}|{'-' * 8}|")
    row("device copy of h (reference)", time_ms(h.detach().clone, iters), 2 * 2 * h.numel())
    w_rows = torch.rand(N, device="cuda")  # router weights: the experts apply them in the op
    variants = [
        ("torch.compile silu(g) * u", torch.compile(torch_swiglu)),
        ("triton op", swiglu),
        ("triton op, row weights (+ their gradient)", lambda h: swiglu(h, w_rows)),
    ]
    for label, fn in variants:
        row(f"forward, {label}", time_ms(lambda f=fn: f(h), iters), fwd_bytes)
        row(f"backward, {label}", time_backward_ms(fn, (h,), grad, iters), bwd_bytes)

    def outputs(fn):
        out = fn(h)
        return out, torch.autograd.grad(out, h, grad)[0]

    (c_out, c_grad), (t_out, t_grad) = outputs(variants[0][1]), outputs(swiglu)
    diff = [(t.float() - c.float()).abs().max().item() for t, c in ((t_out, c_out), (t_grad, c_grad))]  # fmt: skip
    print(f"max |triton - compiled|: forward {diff[0]:.3g}, backward {diff[1]:.3g}")


def sweep(N: int, hidden: int, iters: int) -> None:
    """The raw kernels over column block, rows per tile and warps."""
    h = torch.randn(N, 2 * hidden, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(N, hidden, device="cuda", dtype=torch.bfloat16)
    out, dh = torch.empty_like(grad), torch.empty_like(h)
    fwd_bytes, bwd_bytes = 2 * N * 3 * hidden, 2 * N * 5 * hidden
    default = swiglu_triton.launch_config(hidden)
    print(f"\nsweep F={hidden} (default {default})")
    w_rows, dw = torch.rand(N, device="cuda"), torch.empty(N, 8, device="cuda")
    print(
        "| block_f | rows | warps | fwd ms | fwd % peak | bwd ms | bwd % peak | weighted bwd ms |"
    )
    configs = {}  # distinct tiles only: narrow rows give the same tile for several caps
    for max_block_f in (256, 512, 1024):
        for tile in (2048, 4096, 8192):
            for warps in (4, 8):
                cfg = dict(swiglu_triton.launch_config(hidden, max_block_f, tile), num_warps=warps)
                configs[tuple(cfg.values())] = cfg
    for cfg in configs.values():
        fwd = time_ms(lambda c=cfg: swiglu_triton.launch_forward(h, out, config=c), iters)
        bwd = time_ms(lambda c=cfg: swiglu_triton.launch_backward(h, grad, dh, config=c), iters)
        dw_NB = dw[:, : swiglu_triton.num_column_blocks(hidden, cfg)]
        wbwd = time_ms(lambda c=cfg, d=dw_NB: swiglu_triton.launch_backward(h, grad, dh, w_rows, d, config=c), iters)  # fmt: skip
        pct = [100 * b / ms / 1e6 / PEAK_GBPS for b, ms in ((fwd_bytes, fwd), (bwd_bytes, bwd))]
        print(f"| {cfg['BLOCK_F']:7} | {cfg['BLOCK_N']:4} | {cfg['num_warps']:5} | {fwd:6.3f} | {pct[0]:9.1f}% | {bwd:6.3f} | {pct[1]:9.1f}% | {wbwd:6.3f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=131072)
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--sweep", action="store_true", help="also time tile shapes")
    args = parser.parse_args()
    if not (torch.cuda.is_available() and swiglu_triton.triton_available()):
        print("swiglu_bench: needs a CUDA GPU and Triton; nothing to time here.")
        return
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for hidden in args.hidden:
        bench(args.rows, hidden, args.iters)
    if args.sweep:
        for hidden in args.hidden:
            sweep(args.rows, hidden, max(10, args.iters // 5))


if __name__ == "__main__":
    main()
