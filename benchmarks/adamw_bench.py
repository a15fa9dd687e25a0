"""torch fused AdamW against the single-launch Triton multi_tensor_adamw_, on one H200.

    python benchmarks/adamw_bench.py [--quick] [--iters 20] [--block N] [--num-warps 8]

Parameter sets: (a) the `small` preset's 91 tensors (~0.94B parameters, shapes read off the model
built on meta); (b) ~4.9B parameters as 24 layers of expert weights (128 x 1024 x 2*512 and
128 x 512 x 1024) and two 50304 x 1024 embeddings. `--quick` runs (a) only.
Dtype signatures: bf16-adamw (bf16 params, grads and states) and mixed (bf16 params and grads,
fp32 states and masters). For mixed the torch row is what moetrain/optim/adamw.py does today:
cast the grads into the masters' fp32 grads, fused step on the masters, copy back to the params.
GB/s counts the floor bytes per parameter (each tensor read once, written once): bf16-adamw
2 (grad) + 4 (param r/w) + 8 (m, v r/w) = 14; mixed 2 (grad) + 8 (master r/w) + 16 (m, v r/w)
+ 2 (param write) = 28. Median of `--iters` runs timed with CUDA events, after warm-up. The
same random state then goes through one step of each; the max |difference| of the results
(params for bf16-adamw, masters for mixed) is printed. Mixed at 5B needs ~120 GB; when the GPU
has less free it runs at ~2.5B and says so.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from moetrain.bench.timing import time_steps
from moetrain.kernels.adamw_triton import multi_tensor_adamw_
from moetrain.model.transformer import Transformer
from moetrain.presets import small

PEAK_BYTES_PER_S = 4.2e12
FLOOR_BYTES = {"bf16-adamw": 14, "mixed": 28}
PEAK_BYTES = {"bf16-adamw": 10, "mixed": 24}  # state + torch's transient + one saved result
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1


def small_shapes() -> list[tuple[int, ...]]:
    with torch.device("meta"):
        model = Transformer(small())
    return [tuple(p.shape) for p in model.parameters()]


def large_shapes(layers: int) -> list[tuple[int, ...]]:
    experts = [s for _ in range(layers) for s in ((128, 1024, 2 * 512), (128, 512, 1024))]
    return [(50304, 1024), *experts, (50304, 1024)]


def time_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of `fn` (CUDA events, moetrain's benchmark timer)."""
    return statistics.median(time_steps(fn, warmup, iters, torch.device("cuda")))


class Case:
    """One parameter set in one dtype signature, with a torch fused optimizer over the same
    state tensors (its exp_avg / exp_avg_sq are ours), so both update the same buffers."""

    def __init__(self, shapes, signature: str) -> None:
        self.mixed = signature == "mixed"
        state_dtype = torch.float32 if self.mixed else torch.bfloat16
        new = lambda dtype: [torch.empty(s, dtype=dtype, device="cuda") for s in shapes]  # noqa: E731
        self.params, self.grads = new(torch.bfloat16), new(torch.bfloat16)
        self.exp_avgs, self.exp_avg_sqs = new(state_dtype), new(state_dtype)
        self.masters = new(torch.float32) if self.mixed else None
        self.step = torch.zeros((), device="cuda")
        self.leaves = self.masters if self.mixed else self.params
        self.opt = torch.optim.AdamW(self.leaves, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)  # fmt: skip
        for leaf, m, v in zip(self.leaves, self.exp_avgs, self.exp_avg_sqs, strict=True):
            self.opt.state[leaf] = {"step": torch.zeros((), device="cuda"), "exp_avg": m, "exp_avg_sq": v}  # fmt: skip
        if not self.mixed:
            for p, g in zip(self.params, self.grads, strict=True):
                p.grad = g
        self.numel = sum(p.numel() for p in self.params)

    def fill(self, seed: int) -> None:
        """Fresh random state (the same for the same seed); step counters back to zero."""
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for i, p in enumerate(self.params):
            (self.masters[i] if self.mixed else p).normal_(generator=gen)
            if self.mixed:
                p.copy_(self.masters[i])
            self.grads[i].normal_(0.0, 1e-2, generator=gen)
            self.exp_avgs[i].normal_(0.0, 1e-3, generator=gen)
            self.exp_avg_sqs[i].uniform_(0.0, 1e-5, generator=gen)
        self.step.zero_()
        for leaf in self.leaves:
            self.opt.state[leaf]["step"].zero_()

    def torch_step(self) -> None:
        if self.mixed:
            for master, g in zip(self.masters, self.grads, strict=True):
                master.grad = g.float()
        self.opt.step()
        if self.mixed:
            torch._foreach_copy_(self.params, self.masters)
            for master in self.masters:
                master.grad = None

    def triton_step(self, block: int | None, num_warps: int) -> None:
        self.step += 1
        multi_tensor_adamw_(
            self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.masters, self.step,
            lr=LR, weight_decay=WD, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
            block=block, num_warps=num_warps,
        )  # fmt: skip

    def result(self) -> list[torch.Tensor]:
        return self.masters if self.mixed else self.params


def row(name: str, method: str, ms: float, floor_bytes: float) -> None:
    rate = floor_bytes / ms / 1e6
    pct = 100 * rate * 1e9 / PEAK_BYTES_PER_S
    print(f"| {name:<46} | {method:<36} | {ms:8.2f} | {rate:7.0f} | {pct:5.1f} % |")


@torch.no_grad()
def bench(name: str, shapes, signature: str, args) -> None:
    case = Case(shapes, signature)
    label = f"{name}, {signature}, {case.numel / 1e9:.2f}B"
    floor_bytes = FLOOR_BYTES[signature] * case.numel
    case.fill(seed=0)
    torch_name = "torch fused" + (" (+cast grads, copy back)" if case.mixed else "")
    row(label, torch_name, time_ms(case.torch_step, args.iters), floor_bytes)
    ours = functools.partial(case.triton_step, args.block, args.num_warps)
    row(
        label,
        f"multi_tensor_adamw_ (block {args.block or 'auto'})",
        time_ms(ours, args.iters),
        floor_bytes,
    )

    case.fill(seed=1)
    case.torch_step()
    expected = [t.clone() for t in case.result()]
    case.fill(seed=1)
    ours()
    diff = max(
        (a.float() - b.float()).abs().max().item()
        for a, b in zip(case.result(), expected, strict=True)
    )
    differ = (
        sum((a != b).sum().item() for a, b in zip(case.result(), expected, strict=True))
        / case.numel
    )
    what = "masters" if case.mixed else "params"
    print(f"|   one step from the same state: max |{what} torch - ours| = {diff:.3g}, "
          f"{100 * differ:.4f} % of elements differ")  # fmt: skip


def copy_bandwidth() -> float:
    x = torch.empty(2**31, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), 10)
    return 2 * x.numel() * x.element_size() / ms / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the small preset's tensors")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--block", type=int, default=None, help="default: the kernel's")
    parser.add_argument("--num-warps", type=int, default=8)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}: device copy {copy_bandwidth():.0f} GB/s (read + write)")
    print(f"| {'parameters':<46} | {'method':<36} | {'ms':>8} | {'GB/s':>7} | of 4.2 TB/s |")
    print(f"|{'-' * 48}|{'-' * 38}|{'-' * 10}|{'-' * 9}|{'-' * 13}|")
    sets = [("small preset (91 tensors)", small_shapes())]
    if not args.quick:
        sets.append(("expert-heavy", large_shapes(layers=24)))
    for name, shapes in sets:
        for signature in ("bf16-adamw", "mixed"):
            numel = sum(torch.Size(s).numel() for s in shapes)
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info()[0]
            if PEAK_BYTES[signature] * numel > 0.9 * free:
                print(f"| {signature} at {numel / 1e9:.1f}B needs about "
                      f"{PEAK_BYTES[signature] * numel / 1e9:.0f} GB, {free / 1e9:.0f} GB free: "
                      f"run at 2.5B instead")  # fmt: skip
                bench(name, large_shapes(layers=12), signature, args)
            else:
                bench(name, shapes, signature, args)


if __name__ == "__main__":
    main()
