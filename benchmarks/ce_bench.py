"""Cross-entropy chunk: the Triton kernel of moetrain/kernels/cross_entropy_triton.py against the
compiled torch chunk it replaced on CUDA (moetrain/nn/loss.py) and a device copy.

    PYTHONPATH=$PWD python3 benchmarks/ce_bench.py [--rows 4096] [--vocab 50304] [--reps 20]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 benchmarks/ce_bench.py --smoke   # CPU, tests it

One chunk of logits (rows x vocab, bf16, ~N(0, 2)) and random targets; each operation computes
the summed loss and the gradient scale * (softmax - onehot). Timed (median of `--reps` CUDA-event
samples after warm-up; a sleep kernel queued before each sample hides host launch latency, then
a copy re-creates the logits, as the LM-head GEMM would have just written them):
- a device copy of the chunk (the op's floor: one read and one write);
- V0: `_chunk_loss_and_grad` under torch.compile;
- the Triton kernel, num_warps {8, 16, 32} x block {4096, 8192} x hints {False, True}.
% is of 4.2 TB/s for one read plus one write of the chunk. Every Triton result is checked against
V0 (max |loss diff|, max |grad diff|; "ok" = within 1e-5 relative on the loss and one bf16 ulp
of `scale` on the gradient), so that a fast wrong kernel shows. Measured on an H200 (4096 x 50304):
copy 0.195 ms, V0 0.465 ms, Triton 0.304 ms at the defaults (block 8192, 32 warps, hints).
"""

from __future__ import annotations

import argparse
import time

import torch

from moetrain.bench.timing import kernel_ms
from moetrain.kernels import cross_entropy_triton as ce
from moetrain.nn.loss import _chunk_loss_and_grad, _compiled_torch_chunk

PEAK_GBPS = 4200.0
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def time_ms(fn, prep, reps: int, warmup: int = 3, sleep_cycles: int = 3_000_000) -> float:
    return kernel_ms(fn, reps=reps, warmup=warmup, prep=prep, sleep_cycles=sleep_cycles)


class Bench:
    def __init__(self, rows: int, vocab: int, reps: int, device: str):
        gen = torch.Generator(device=device).manual_seed(0)
        self.src = (2 * torch.randn(rows, vocab, device=device, generator=gen)).to(torch.bfloat16)
        self.targets = torch.randint(0, vocab, (rows,), device=device, generator=gen)
        self.x = torch.empty_like(self.src)  # the working logits, re-copied before each sample
        self.out = torch.empty_like(self.src)  # the device copy's destination
        self.scale = 1.0 / (4 * rows)
        self.reps = reps
        self.nbytes = 2 * self.src.numel() * self.src.element_size()
        self.results = []  # (ms, cfg)
        self.ref = None

    def prep(self):
        self.x.copy_(self.src)

    def diffs(self, loss, grad):
        ref_loss, ref_grad = self.ref
        loss_diff = abs(float(loss) - float(ref_loss))
        grad_diff = 0.0
        for r in range(0, grad.shape[0], 512):  # in row blocks: fp32 copies of the chunk are big
            d = (grad[r : r + 512].float() - ref_grad[r : r + 512].float()).abs().max()
            grad_diff = max(grad_diff, float(d))
        ok = loss_diff <= 1e-5 * abs(float(ref_loss)) and grad_diff <= self.scale * 2.0**-7
        return loss_diff, grad_diff, ok

    def header(self, title: str) -> None:
        print(f"\n### {title}\n", flush=True)
        print("| variant | config | ms | % of 4.2 TB/s | loss diff | grad diff | check |")
        print("|---|---|---:|---:|---:|---:|---|", flush=True)

    def row(self, name, cfg, ms, loss_diff=None, grad_diff=None, ok=None) -> None:
        pct = 100 * self.nbytes / ms / 1e6 / PEAK_GBPS
        cfg_s = " ".join(f"{k}={v}" for k, v in cfg.items())
        check = "" if ok is None else ("ok" if ok else "**WRONG**")
        diffs = ("", "") if loss_diff is None else (f"{loss_diff:.3g}", f"{grad_diff:.3g}")
        print(f"| {name} | {cfg_s} | {ms:.3f} | {pct:.1f}% | {diffs[0]} | {diffs[1]} | {check} |", flush=True)  # fmt: skip

    def run_v0(self):
        fn = _compiled_torch_chunk() if self.x.is_cuda else _chunk_loss_and_grad
        t = time.perf_counter()
        self.prep()
        loss, grad = fn(self.x, self.targets, self.scale)
        if self.x.is_cuda:
            torch.cuda.synchronize()
        log(f"V0 compiled in {time.perf_counter() - t:.1f}s")
        self.ref = (loss.clone(), grad.clone())
        self.header("V0 and a device copy (reference)")
        self.row("device copy of the chunk", {}, time_ms(lambda: self.out.copy_(self.x), self.prep, self.reps))  # fmt: skip
        self.row("V0 torch.compile chunk", {}, time_ms(lambda: fn(self.x, self.targets, self.scale), self.prep, self.reps))  # fmt: skip

    def triton(self, cfg: dict) -> None:
        """Checks and times one configuration of the Triton kernel."""

        def fn():
            return ce.chunk_loss_and_grad_triton(self.x, self.targets, self.scale, **cfg)

        try:
            self.prep()
            loss, grad = fn()
            loss_diff, grad_diff, ok = self.diffs(loss, grad)
            ms = time_ms(fn, self.prep, self.reps)
        except Exception as e:  # noqa: BLE001 - a config that fails to compile or launch
            print(f"| triton | {cfg} | failed: {type(e).__name__}: {str(e)[:120]} | | | | |", flush=True)  # fmt: skip
            return
        self.row("triton", cfg, ms, loss_diff, grad_diff, ok)
        if ok:
            self.results.append((ms, dict(cfg)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, TRITON_INTERPRET=1, tiny chunk: tests this script",
    )
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.vocab, args.reps, device = 6, 300, 1, "cpu"
        print("smoke run under Triton's interpreter: times are meaningless")
    elif not (torch.cuda.is_available() and ce.triton_available()):
        print("ce_bench: needs a CUDA GPU and Triton; nothing to time here.")
        return
    else:
        device = "cuda"
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        print(f"{torch.cuda.get_device_name()}, {sms} SMs, torch {torch.__version__}, triton {ce.triton.__version__}")  # fmt: skip
    print(f"chunk {args.rows} x {args.vocab} bf16, {args.reps} reps, median", flush=True)
    b = Bench(args.rows, args.vocab, args.reps, device)
    b.run_v0()

    log("Triton: one program per row")
    b.header("Triton kernel (sub=8)")
    for hints in (False, True):
        for warps in (8, 16, 32):
            for block in (4096, 8192):
                b.triton(dict(block=block, num_warps=warps, hints=hints))

    print("\n### best configurations\n")
    print("| rank | config | ms | % of 4.2 TB/s |")
    print("|---:|---|---:|---:|")
    for i, (ms, cfg) in enumerate(sorted(b.results, key=lambda r: r[0])[:4]):
        pct = 100 * b.nbytes / ms / 1e6 / PEAK_GBPS
        cfg_s = " ".join(f"{k}={v}" for k, v in cfg.items())
        print(f"| {i + 1} | {cfg_s} | {ms:.3f} | {pct:.1f}% |")
    log("done")


if __name__ == "__main__":
    main()
