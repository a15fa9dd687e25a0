"""Dispatch / combine data movement: the torch code of moe/dispatch.py against the Triton ops.

    python benchmarks/gather_bench.py [--tokens 16384] [--top-k 8] [--dims 1024 2048] [--sweep]

At the `small` preset's shape (T = 16384 tokens, top-8 of 64 experts, N = T*K rows, bf16), times
- the previous torch implementation of moe/dispatch.py (permutation gathers as autograd Functions
  whose backwards are gathers, and the elementwise weighted sum; copied below as the baseline),
  eager and under torch.compile, forward and backward;
- the new ops (`moetrain.kernels.gather`), forward and backward (through autograd).
Each time is the median of `--iters` CUDA-event samples after warm-up; a ~0.5 ms sleep kernel is
queued before each sample so that host-side launch latency is not counted. GB/s count the
minimum bytes each op must move (each input element read once, each output written once,
indices and weights included), against 4.2 TB/s (a device copy on the H200 reaches about 4.3).
`--sweep` also times the raw kernels over block shapes, to check the default launch config.
"""

from __future__ import annotations

import argparse

import torch

from moetrain.bench.timing import kernel_ms
from moetrain.kernels import gather, gather_triton
from moetrain.moe.dispatch import permute_routes, weighted_sum_of_routes

PEAK_GBPS = 4200.0


# --- the baseline: moe/dispatch.py before the Triton ops ---------------------------------------


class _GatherRoutes(torch.autograd.Function):
    """rows[n] = x[order[n] // K]: each token copied to its K routes. Backward sums the K route
    gradients of each token: one gather by the inverse order, then a sum over K."""

    @staticmethod
    def forward(ctx, x_TD, order_N, inverse_N, top_k: int):  # type: ignore[override]
        ctx.save_for_backward(inverse_N)
        ctx.top_k = top_k
        return x_TD[order_N // top_k]

    @staticmethod
    def backward(ctx, grad_ND):  # type: ignore[override]
        (inverse_N,) = ctx.saved_tensors
        grad_TKD = grad_ND[inverse_N].view(-1, ctx.top_k, grad_ND.shape[-1])
        return grad_TKD.sum(dim=1), None, None, None


def old_permute_rows(
    x_ND: torch.Tensor, index_N: torch.Tensor, inverse_N: torch.Tensor
) -> torch.Tensor:
    """The expert-side permutation, which the LocalDispatcher still uses (for the router weights):
    out = x[index], backward a gather by the inverse."""
    return permute_routes(x_ND, index_N, inverse_N)


def old_gather_routes(
    x_TD: torch.Tensor, order_N: torch.Tensor, inverse_N: torch.Tensor, top_k: int
) -> torch.Tensor:
    """Expert-ordered rows of the K-times repeated tokens (see `_GatherRoutes`)."""
    return _GatherRoutes.apply(x_TD, order_N, inverse_N, top_k)


def time_ms(fn, iters: int, warmup: int = 5) -> float:
    return kernel_ms(fn, reps=iters, warmup=warmup, sleep_cycles=1_000_000)


def time_backward_ms(forward, inputs, grad, iters: int) -> float:
    """Backward alone: autograd.grad on one retained graph; where the compiled graph cannot be
    run twice, (forward + backward) - forward."""
    out = forward(*inputs)
    try:
        torch.autograd.grad(out, inputs, grad, retain_graph=True)
        return time_ms(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True), iters)
    except RuntimeError:
        both = time_ms(lambda: torch.autograd.grad(forward(*inputs), inputs, grad), iters)
        return both - time_ms(lambda: forward(*inputs), iters)


def row(name: str, ms: float, nbytes: int) -> None:
    gbps = nbytes / ms / 1e6
    print(f"| {name:<46} | {ms:7.3f} | {gbps:7.0f} | {100 * gbps / PEAK_GBPS:5.1f}% |")


def routes(tokens: int, top_k: int, experts: int, seed: int = 0):
    """Expert order of a random top-k routing, as LocalDispatcher.dispatch builds it."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(tokens, experts, device="cuda", generator=gen)
    expert_ids = scores.topk(top_k, dim=-1).indices
    order_N = torch.argsort(expert_ids.reshape(-1), stable=True)
    inverse_N = torch.argsort(order_N)
    weights = scores.gather(1, expert_ids).softmax(-1)
    return order_N, inverse_N, weights


def bench(tokens: int, top_k: int, experts: int, dim: int, iters: int) -> None:
    T, K, D, N = tokens, top_k, dim, tokens * top_k
    order_N, inverse_N, weights = routes(T, K, experts, seed=dim)
    inverse_TK = inverse_N.view(T, K)
    bf16 = torch.bfloat16
    x = torch.randn(T, D, device="cuda", dtype=bf16, requires_grad=True)
    y = torch.randn(N, D, device="cuda", dtype=bf16, requires_grad=True)
    w = weights.clone().requires_grad_()
    g_rows = torch.randn(N, D, device="cuda", dtype=bf16)
    g_out = torch.randn(T, D, device="cuda", dtype=bf16)

    def old_gather(x):
        return old_gather_routes(x, order_N, inverse_N, K)

    def old_combine(y, w):
        y_TKD = old_permute_rows(y, inverse_N, order_N).view(T, K, D)
        return weighted_sum_of_routes(y_TKD, w)

    def new_gather(x):
        return gather.gather_routes(x, order_N, inverse_TK)

    def new_combine(y, w):
        return gather.combine_routes(y, order_N, inverse_TK, w)

    # minimum traffic: rows of D bf16, int64 indices, float32 weights / weight gradients
    gather_fwd = 2 * (T * D + N * D) + 8 * N
    gather_bwd = 2 * (N * D + T * D) + 8 * N
    combine_fwd = 2 * (N * D + T * D) + 8 * N + 4 * N
    combine_bwd = 2 * (T * D + 2 * N * D) + 8 * N + 4 * N + 4 * N

    print(f"\nT={T}, K={K}, N={N}, D={D}, bf16, {experts} experts")
    print(f"| {'operation':<46} | {'ms':>7} | {'GB/s':>7} | {'peak':>6} |")
    print(f"|{'-' * 48}|{'-' * 9}|{'-' * 9}|{'-' * 8}|")
    row("device copy of the N x D rows (reference)", time_ms(g_rows.clone, iters), 4 * N * D)
    variants = [
        ("torch eager", old_gather, old_combine),
        ("torch compiled", torch.compile(old_gather), torch.compile(old_combine)),
        ("triton ops", new_gather, new_combine),
    ]
    for label, gather_fn, combine_fn in variants:
        row(f"gather forward, {label}", time_ms(lambda f=gather_fn: f(x), iters), gather_fwd)
        row(
            f"gather backward, {label}",
            time_backward_ms(gather_fn, (x,), g_rows, iters),
            gather_bwd,
        )
        row(f"combine forward, {label}", time_ms(lambda f=combine_fn: f(y, w), iters), combine_fwd)
        row(
            f"combine backward (y and w), {label}",
            time_backward_ms(combine_fn, (y, w), g_out, iters),
            combine_bwd,
        )

    def outputs(gather_fn, combine_fn):
        rows = gather_fn(x)
        (gx,) = torch.autograd.grad(rows, x, g_rows)
        out = combine_fn(y, w)
        gy, gw = torch.autograd.grad(out, (y, w), g_out)
        return {"rows": rows, "grad_x": gx, "combined": out, "grad_y": gy, "grad_w": gw}

    old, new = outputs(old_gather, old_combine), outputs(new_gather, new_combine)
    diffs = ", ".join(
        f"{k} {(new[k].float() - old[k].float()).abs().max().item():.3g}" for k in old
    )
    print(f"max |new - old| (eager): {diffs}")


def sweep(tokens: int, top_k: int, dim: int, iters: int) -> None:
    """The raw kernels over tokens per program, warps and row block (the whole row up to 4096)."""
    T, K, D, N = tokens, top_k, dim, tokens * top_k
    _, inverse_N, weights = routes(T, K, 64, seed=dim)
    inverse_TK = inverse_N.view(T, K)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    rows, out = torch.empty_like(y), torch.empty_like(x)
    grad_y, grad_w = torch.empty_like(y), torch.empty_like(weights)
    default = gather_triton.launch_config(D)
    print(f"\nsweep D={D} (default {default['BLOCK_R']} tokens, {default['num_warps']} warps)")
    print("| tokens | warps | block_d | gather ms | combine ms | combine bwd ms |")
    for max_block_d in sorted({min(4096, triton_pow2(D)), 1024}):
        for block_r in (1, 2, 4, 8):
            for warps in (4, 8):
                cfg = gather_triton.launch_config(D, max_block_d=max_block_d)
                cfg.update(BLOCK_R=block_r, num_warps=warps)
                launches = (
                    lambda c=cfg: gather_triton.launch_spread_routes(
                        x, inverse_TK, None, None, rows, None, c
                    ),
                    lambda c=cfg: gather_triton.launch_sum_routes(y, inverse_TK, weights, out, c),
                    lambda c=cfg: gather_triton.launch_spread_routes(
                        out, inverse_TK, weights, y, grad_y, grad_w, c
                    ),
                )
                t_g, t_c, t_b = (time_ms(launch, iters) for launch in launches)
                print(f"| {block_r:6} | {warps:5} | {max_block_d:7} | {t_g:9.3f} | {t_c:10.3f} | {t_b:14.3f} |")  # fmt: skip


def triton_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--dims", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--sweep", action="store_true", help="also time block shapes")
    args = parser.parse_args()
    assert torch.cuda.is_available() and gather_triton.triton_available(), "needs CUDA + Triton"
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for dim in args.dims:
        bench(args.tokens, args.top_k, args.experts, dim, args.iters)
    if args.sweep:
        for dim in args.dims:
            sweep(args.tokens, args.top_k, dim, max(10, args.iters // 5))


if __name__ == "__main__":
    main()
