"""Fused qk-norm + RoPE: launch configurations of the Triton kernels of
moetrain/kernels/qk_norm_rope_triton.py against the compiled torch path they replaced and a copy.

    PYTHONPATH=$PWD python3 benchmarks/qk_norm_rope_bench.py [--shapes small olmoe8] [--reps 20]
        [--tiles 1024 2048 4096 8192] [--warps 2 4 8] [--warps-per-sm 8 16 32] [--no-compile]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 benchmarks/qk_norm_rope_bench.py --smoke  # CPU

One q (or k) projection x_BSD in bf16 (~N(0, 2)), a bf16 norm weight (1 + N(0, 1/4), as the
trainer's bf16 parameters), the fp32 tables of `RotaryEmbedding`, a random grad_y. Shapes:
`small` B=8 S=2048 N=16 H=64 (D=1024), `olmoe8` B=4 S=4096 N=16 H=128 (D=2048). Timed (median of
`--reps` CUDA-event samples after warm-up; a sleep kernel queued before each sample hides host
launch latency, then, unless --no-flush, a 128 MB write evicts L2 so that x comes from memory):
- a device copy of x (the floor: one read and one write);
- the Triton forward `launch_qk_norm_rope_forward`, called directly with `config=`, over tile
  elements {1024, 2048, 4096, 8192} (BLOCK_M = tile // (2 * BLOCK_C)) x num_warps {2, 4, 8}
  (plus `num_warps_for(tile)`), skipping tiles of more than 64 rows or 64 elements a thread;
- the Triton backward `launch_qk_norm_rope_backward` over the same tiles and warps x programs
  for {8, 16, 32} warps an SM (the op's `num_programs` uses WARPS_PER_SM = 32): the kernel alone,
  and with the op's `partial_PD.sum(0)`;
- the torch path (`rms_norm` with the weight, then `apply_rope` with `RotaryEmbedding.cos_sin`
  tables in bf16) under torch.compile: forward alone (x requiring grad, as in training) and
  backward alone (autograd.grad with retain_graph; if that fails, forward+backward - forward).
The op's default configuration is marked `*`. % is of 4.2 TB/s for the bytes floor: forward
reads x and writes y (2 + 2 bytes an element) and 4 bytes a row of rstd; backward reads grad_y and
x and writes grad_x (6 bytes an element), reads rstd and writes the (P, D) fp32 partials.
Every Triton result is checked against `qk_norm_rope_reference` run in fp32 and its fp32
autograd (y and rstd; grad_x, and grad_weight = partials summed): ok = within 2 bf16 ulps of each
element plus 2^-14 of the tensor's largest value (grad_weight: 2^-14 of the sum of its terms'
magnitudes), so a fast wrong kernel shows; unwritten outputs are NaN. The torch path rounds
between norm and RoPE and uses bf16 tables: its diff is printed for information only.
Measured in the `small` training step on an H200: 31 us forward, 37 us backward per tensor at
the defaults.
"""

from __future__ import annotations

import argparse
import time

import torch

from moetrain.bench.timing import kernel_ms
from moetrain.kernels import qk_norm_rope_triton as qk
from moetrain.nn.attention import qk_norm_rope_reference
from moetrain.nn.norm import rms_norm
from moetrain.nn.rope import RotaryEmbedding, apply_rope

PEAK_GBPS = 4200.0
EPS = 1e-5
T0 = time.perf_counter()
SHAPES = {  # B, S, N, H
    "small": (8, 2048, 16, 64),
    "olmoe8": (4, 4096, 16, 128),
}
SMOKE_SHAPES = {"smoke-even": (2, 24, 4, 16), "smoke-tail": (1, 40, 3, 16)}  # D = 64, 48
TILES = (1024, 2048, 4096, 8192)
WARPS = (2, 4, 8)
WARPS_PER_SM = (8, 16, 32)
SMOKE_SMS = 2  # the interpreter has no SMs: programs as for a two-SM device


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


class Timer:
    def __init__(self, reps: int, device: str, flush: bool):
        self.reps = reps
        self.cuda = device == "cuda"
        self.scratch = torch.empty(64 * 2**20, dtype=torch.int16, device=device) if flush and self.cuda else None  # fmt: skip

    def prep(self) -> None:
        if self.scratch is not None:
            self.scratch.fill_(1)  # 128 MB: evicts the 60 MB L2

    def ms(self, fn, warmup: int = 3, sleep_cycles: int = 2_000_000) -> float:
        return kernel_ms(fn, self.reps, warmup, self.prep, sleep_cycles)


def pct(nbytes: int, ms: float) -> float:
    return 100 * nbytes / ms / 1e6 / PEAK_GBPS


def within(got: torch.Tensor, want: torch.Tensor, floor: float, ulps: float = 2.0):
    """(max |got - want|, every element within `ulps` bf16 ulps of want plus `floor`)."""
    d = (got.float() - want.float()).abs()
    tol = ulps * 2.0**-8 * want.float().abs() + floor
    return float(d.max()), bool((d <= tol).all())


def sm_count(device: str) -> int:
    if device == "cuda":
        return torch.cuda.get_device_properties(0).multi_processor_count
    return SMOKE_SMS


def configs(D: int, with_warps_per_sm: bool, tiles=TILES, warps_set=WARPS, per_sm=WARPS_PER_SM):
    """(tile, config, warps an SM or None) of the sweep, distinct configurations only."""
    block_c = qk.triton.next_power_of_2(max(D // 2, 1))
    seen = set()
    for tile in tiles:
        if not 1 <= tile // (2 * block_c) <= 64:  # less than a row, or more than 64 rows
            continue
        base = qk.launch_config(D, tile)  # BLOCK_M = tile // (2 * BLOCK_C)
        tile = 2 * base["BLOCK_M"] * block_c  # the elements a program holds
        for warps in sorted({*warps_set, base["num_warps"]}):
            if tile // (32 * warps) > 64 or tile < 32 * warps:
                continue
            cfg = dict(base, num_warps=warps)
            for wps in per_sm if with_warps_per_sm else (None,):
                key = (cfg["BLOCK_M"], warps, wps)
                if key not in seen:
                    seen.add(key)
                    yield tile, cfg, wps


def backward_programs(num_rows: int, cfg: dict, warps_per_sm: int, sms: int) -> tuple[int, int]:
    """(programs, tiles a program) as `num_programs` and the launch (`tiles_per_program`) choose
    them, with `warps_per_sm` for WARPS_PER_SM and this config's tile and warps."""
    max_programs = max(1, warps_per_sm * sms // cfg["num_warps"])
    tiles = qk.tiles_per_program(num_rows, cfg["BLOCK_M"], max_programs)
    P = max(1, qk.triton.cdiv(num_rows, cfg["BLOCK_M"] * tiles))
    return P, qk.tiles_per_program(num_rows, cfg["BLOCK_M"], P)


class Bench:
    def __init__(self, name: str, shape, timer: Timer, device: str, sweep: dict):
        B, S, N, H = shape
        self.name, self.B, self.S, self.N, self.H, self.D = name, B, S, N, H, N * H
        self.M, self.device, self.timer, self.sweep = B * S, device, timer, sweep
        gen = torch.Generator(device=device).manual_seed(0)
        bf16 = torch.bfloat16
        self.x = (2 * torch.randn(B, S, self.D, device=device, generator=gen)).to(bf16)
        self.w = (1 + torch.randn(self.D, device=device, generator=gen) / 4).to(bf16)
        self.gy = torch.randn(B, S, self.D, device=device, generator=gen).to(bf16)
        self.rope = RotaryEmbedding(H, max_positions=S).to(device)
        self.cos, self.sin = self.rope.cos_SH.contiguous(), self.rope.sin_SH.contiguous()
        self.x_MD, self.gy_MD = self.x.view(-1, self.D), self.gy.view(-1, self.D)
        self.y_MD = torch.empty_like(self.x_MD)
        self.gx_MD = torch.empty_like(self.x_MD)
        self.rstd_M = torch.empty(self.M, device=device, dtype=torch.float32)
        e = self.x.element_size()
        self.copy_bytes = 2 * e * self.M * self.D
        self.fwd_bytes = 2 * e * self.M * self.D + 4 * self.M
        self.sms = sm_count(device)
        self.default = qk.launch_config(self.D)
        self.backward_default = qk.launch_config(self.D, qk.BACKWARD_TILE)
        self.fwd_results, self.bwd_results = [], []  # (us, description, default?)
        self._reference()

    def _reference(self) -> None:
        """fp32 y, rstd, grad_x, grad_weight of the reference and the check floors."""
        x32 = self.x.float().requires_grad_()
        w32 = self.w.float().requires_grad_()
        y32 = qk_norm_rope_reference(x32, w32, EPS, self.cos, self.sin, self.H)
        gx32, gw32 = torch.autograd.grad(y32, (x32, w32), self.gy.float())
        self.ref_y, self.ref_gx, self.ref_gw = y32.detach().view(-1, self.D), gx32.view(-1, self.D), gw32  # fmt: skip
        x = self.x_MD.float()
        self.ref_rstd = torch.rsqrt(x.square().mean(-1) + EPS)
        g = self.gy_MD.float().abs().view(self.M, self.N, 2, self.H // 2)
        g_pairs = g.sum(2, keepdim=True).expand(-1, -1, 2, -1).reshape(self.M, self.D)
        self.gw_scale = (g_pairs * (x * self.ref_rstd[:, None]).abs()).sum(0)
        self.floor = {k: 2.0**-14 * float(t.abs().max()) for k, t in (("y", self.ref_y), ("gx", self.ref_gx))}  # fmt: skip
        del x32, w32, y32

    def header(self, title: str, cols: str) -> None:
        print(f"\n### {self.name} (B={self.B} S={self.S} N={self.N} H={self.H}, D={self.D}, M={self.M}): {title}\n", flush=True)  # fmt: skip
        print(cols)
        print("|" + "---|" * (cols.count("|") - 1), flush=True)

    # --- forward --------------------------------------------------------------------------

    def forward(self, cfg: dict) -> None:
        self.y_MD.fill_(float("nan"))
        self.rstd_M.fill_(float("nan"))
        fn = lambda: qk.launch_qk_norm_rope_forward(  # noqa: E731
            self.x_MD, self.w, self.cos, self.sin, self.y_MD, self.rstd_M, self.S, self.H, EPS,
            config=cfg,
        )  # fmt: skip
        fn()
        diff, ok_y = within(self.y_MD, self.ref_y, self.floor["y"])
        _, ok_rstd = within(self.rstd_M, self.ref_rstd, 0.0, ulps=2.0**-6)  # 2^-14 relative
        return fn, diff, ok_y and ok_rstd

    def sweep_forward(self) -> None:
        self.header("Triton forward", "| tile | BLOCK_M | warps | programs | us | % of 4.2 TB/s | y diff | check |")  # fmt: skip
        for tile, cfg, _ in configs(self.D, False, **self.sweep):
            default = cfg == self.default
            try:
                fn, diff, ok = self.forward(cfg)
                ms = self.timer.ms(fn)
            except Exception as e:  # noqa: BLE001 - a config that fails to compile or launch
                print(f"| {tile} | {cfg['BLOCK_M']} | {cfg['num_warps']} | | failed: {type(e).__name__}: {str(e)[:120]} | | | |", flush=True)  # fmt: skip
                continue
            mark = "*" if default else ""
            programs = qk.triton.cdiv(self.M, cfg["BLOCK_M"])
            print(f"| {tile}{mark} | {cfg['BLOCK_M']} | {cfg['num_warps']} | {programs} | {1e3 * ms:.1f} | {pct(self.fwd_bytes, ms):.1f}% | {diff:.3g} | {'ok' if ok else '**WRONG**'} |", flush=True)  # fmt: skip
            if ok:
                desc = f"tile={tile} BLOCK_M={cfg['BLOCK_M']} warps={cfg['num_warps']}"
                self.fwd_results.append((1e3 * ms, desc, default))

    # --- backward -------------------------------------------------------------------------

    def sweep_backward(self) -> None:
        # rstd of the default forward (checked there)
        qk.launch_qk_norm_rope_forward(
            self.x_MD, self.w, self.cos, self.sin, self.y_MD, self.rstd_M, self.S, self.H, EPS
        )
        self.header(
            "Triton backward (kernel alone; + sum: with the op's partial_PD.sum(0))",
            "| tile | BLOCK_M | warps | warps/SM | programs | tiles/prog | us | % of 4.2 TB/s | + sum us | grad_x diff | grad_w diff | check |",  # fmt: skip
        )
        for tile, cfg, wps in configs(self.D, True, **self.sweep):
            P, tiles = backward_programs(self.M, cfg, wps, self.sms)
            default = cfg == self.backward_default and wps == qk.WARPS_PER_SM
            nbytes = 3 * self.x.element_size() * self.M * self.D + 4 * self.M + 4 * P * self.D
            partial_PD = torch.full((P, self.D), float("nan"), device=self.device)
            self.gx_MD.fill_(float("nan"))
            kernel = lambda c=cfg, p=partial_PD: qk.launch_qk_norm_rope_backward(  # noqa: E731
                self.gy_MD, self.x_MD, self.w, self.rstd_M, self.cos, self.sin, self.gx_MD, p,
                self.S, self.H, config=c,
            )  # fmt: skip
            with_sum = lambda k=kernel, p=partial_PD: (k(), p.sum(0).to(self.w.dtype))  # noqa: E731
            try:
                kernel()
                gx_diff, ok_x = within(self.gx_MD, self.ref_gx, self.floor["gx"])
                gw = partial_PD.sum(0)
                gw_diff = float((gw - self.ref_gw).abs().max())
                ok_w = bool(((gw - self.ref_gw).abs() <= 2.0**-14 * self.gw_scale).all())
                ms, ms_sum = self.timer.ms(kernel), self.timer.ms(with_sum)
            except Exception as e:  # noqa: BLE001
                print(f"| {tile} | {cfg['BLOCK_M']} | {cfg['num_warps']} | {wps} | {P} | {tiles} | failed: {type(e).__name__}: {str(e)[:120]} | | | | | |", flush=True)  # fmt: skip
                continue
            ok = ok_x and ok_w
            mark = "*" if default else ""
            print(f"| {tile}{mark} | {cfg['BLOCK_M']} | {cfg['num_warps']} | {wps} | {P} | {tiles} | {1e3 * ms:.1f} | {pct(nbytes, ms):.1f}% | {1e3 * ms_sum:.1f} | {gx_diff:.3g} | {gw_diff:.3g} | {'ok' if ok else '**WRONG**'} |", flush=True)  # fmt: skip
            if ok:
                desc = f"tile={tile} BLOCK_M={cfg['BLOCK_M']} warps={cfg['num_warps']} warps/SM={wps} P={P}"  # fmt: skip
                self.bwd_results.append((1e3 * ms_sum, desc, default))

    # --- references -----------------------------------------------------------------------

    def copy_row(self) -> None:
        self.header("floor", "| operation | us | % of 4.2 TB/s |")
        out = torch.empty_like(self.x)
        ms = self.timer.ms(lambda: out.copy_(self.x))
        print(f"| device copy of x | {1e3 * ms:.1f} | {pct(self.copy_bytes, ms):.1f}% |", flush=True)  # fmt: skip

    def torch_rows(self, compile_: bool) -> None:
        B, S, N, H, rope = self.B, self.S, self.N, self.H, self.rope

        def torch_path(x_BSD, weight):
            y_BNSH = rms_norm(x_BSD, weight, EPS).view(B, S, N, H).transpose(1, 2)
            return apply_rope(y_BNSH, *rope.cos_sin(S, x_BSD.dtype))

        fn = torch.compile(torch_path, dynamic=False) if compile_ else torch_path
        label = "torch.compile" if compile_ else "eager torch"
        x = self.x.detach().clone().requires_grad_()
        w = self.w.detach().clone().requires_grad_()
        gy_BNSH = self.gy.view(B, S, N, H).transpose(1, 2)
        t = time.perf_counter()
        y = fn(x, w)
        gx, gw = torch.autograd.grad(y, (x, w), gy_BNSH)
        log(
            f"{self.name}: {label} path's first forward + backward took {time.perf_counter() - t:.1f}s"
        )
        y_diff = float(
            (y.detach().transpose(1, 2).reshape(-1, self.D).float() - self.ref_y).abs().max()
        )
        gx_diff = float((gx.view(-1, self.D).float() - self.ref_gx).abs().max())
        gw_diff = float((gw.float() - self.ref_gw).abs().max())
        self.header(
            f"the torch path it replaced ({label}; bf16 tables, rounded between norm and RoPE)",
            "| operation | us | % of 4.2 TB/s | max diff to fp32 reference |",
        )
        ms = self.timer.ms(lambda: fn(x, w))
        print(f"| forward (x requires grad) | {1e3 * ms:.1f} | {pct(self.fwd_bytes, ms):.1f}% | y {y_diff:.3g} |", flush=True)  # fmt: skip
        out = fn(x, w)
        try:
            torch.autograd.grad(out, (x, w), gy_BNSH, retain_graph=True)
            bwd = self.timer.ms(lambda: torch.autograd.grad(out, (x, w), gy_BNSH, retain_graph=True))  # fmt: skip
            how = "backward alone (retain_graph)"
        except Exception:  # noqa: BLE001 - a compiled graph that frees its saved tensors
            both = self.timer.ms(lambda: torch.autograd.grad(fn(x, w), (x, w), gy_BNSH))
            bwd, how = both - ms, "backward = (forward + backward) - forward"
        nbytes = 3 * self.x.element_size() * self.M * self.D + 4 * self.M
        print(f"| {how} | {1e3 * bwd:.1f} | {pct(nbytes, bwd):.1f}% | grad_x {gx_diff:.3g}, grad_w {gw_diff:.3g} |", flush=True)  # fmt: skip

    def best(self) -> None:
        print(f"\n### {self.name}: best configurations (default marked *)\n")
        print("| direction | rank | config | us | vs default |")
        print("|---|---:|---|---:|---:|")
        for direction, results in (("forward", self.fwd_results), ("backward + sum", self.bwd_results)):  # fmt: skip
            default = [us for us, _, d in results if d]
            ranked = sorted(results, key=lambda r: r[0])
            for i, (us, desc, is_default) in enumerate(ranked[:4]):
                vs = f"{default[0] / us:.2f}x" if default else ""
                print(f"| {direction} | {i + 1} | {desc}{' *' if is_default else ''} | {us:.1f} | {vs} |")  # fmt: skip
            if default and not any(d for _, _, d in ranked[:4]):
                rank = 1 + [d for _, _, d in ranked].index(True)
                print(f"| {direction} | {rank} | default * | {default[0]:.1f} | 1.00x |")
        print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tiles", type=int, nargs="+", default=list(TILES))
    parser.add_argument("--warps", type=int, nargs="+", default=list(WARPS))
    parser.add_argument("--warps-per-sm", type=int, nargs="+", default=list(WARPS_PER_SM))
    parser.add_argument("--no-flush", action="store_true", help="keep L2 warm between samples")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, TRITON_INTERPRET=1, tiny shapes: tests this script",
    )
    args = parser.parse_args()
    if args.smoke:
        if not qk.triton_available() or not qk._interpreting():
            print("qk_norm_rope_bench --smoke: needs Triton and TRITON_INTERPRET=1")
            return
        shapes, device, args.reps = SMOKE_SHAPES, "cpu", 1
        print("smoke run under Triton's interpreter: times are meaningless")
    elif not (torch.cuda.is_available() and qk.triton_available()):
        print("qk_norm_rope_bench: needs a CUDA GPU and Triton; nothing to time here.")
        return
    else:
        shapes, device = {name: SHAPES[name] for name in args.shapes}, "cuda"
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        print(f"{torch.cuda.get_device_name()}, {sms} SMs, torch {torch.__version__}, triton {qk.triton.__version__}")  # fmt: skip
    flush = not args.no_flush
    print(f"bf16, {args.reps} reps, median; L2 {'flushed' if flush and device == 'cuda' else 'warm'} before each sample; default: tile {qk.TILE} (backward {qk.BACKWARD_TILE}), WARPS_PER_SM {qk.WARPS_PER_SM}", flush=True)  # fmt: skip
    timer = Timer(args.reps, device, flush)
    benches = []
    for name, shape in shapes.items():  # the Triton sweeps first: they are what the run is for
        log(f"{name}: reference")
        sweep = dict(tiles=args.tiles, warps_set=args.warps, per_sm=args.warps_per_sm)
        b = Bench(name, shape, timer, device, sweep)
        benches.append(b)
        b.copy_row()
        log(f"{name}: Triton forward sweep")
        b.sweep_forward()
        log(f"{name}: Triton backward sweep")
        b.sweep_backward()
        b.best()
    if not args.no_compile:
        for b in benches:
            log(f"{b.name}: torch path")
            b.torch_rows(compile_=device == "cuda")
    log("done")


if __name__ == "__main__":
    main()
