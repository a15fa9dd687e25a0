"""What overlapping communication with compute costs and hides, measured on one GPU.

    PYTHONPATH=. python benchmarks/overlap.py [--out benchmarks/overlap.json] [--cpu]

One GPU has no NVLink traffic to overlap, so stand-in kernels move the bytes the real transfer
would move, at the link's rate (--link-gbps, per direction: 450 for H100/H200 NVLink), on a side
stream:
- `sm{k}` (k = 8, 16, 24, 32): a Triton copy on a persistent grid of k programs (one SM each), each
  program waiting on the global timer before each tile so that together they stay at the link
  rate: the SMs an NCCL all-to-all occupies, and the memory traffic it makes.
- `ce`: cudaMemcpyAsync pieces (device to device: the driver's copy path, the copy engines where
  it uses them) with `torch.cuda._sleep` gaps, paced to the same rate; on SMs it occupies one.
For each pairing of compute with a transfer this records the compute alone, the transfer alone,
both together and the compute while a longer transfer runs all through it, and from them
  sigma = t_compute_with_comm / t_compute_alone - 1   (the compute's slowdown)
  eta = (t_comp + t_comm - t_pair) / min(t_comp, t_comm)   (the share of the shorter one hidden)
Pairings at `ref-47b`'s per-rank shapes at ep 8 (a chunk: 2 of the micro-batch's 4 sequences, its
16 local experts, all-to-all bytes 7/8 of T K D 2 per chunk):
- a2a: attention of one chunk (forward; backward) and its shared expert against a dispatch, the
  experts of one chunk against a combine, the experts' backward against the next dispatch;
- fsdp_gather / fsdp_reduce_scatter: a whole block (128 experts, the full micro-batch) forward
  against the all-gather of the next block's bf16 parameters (7/8 of them), its backward against
  a reduce-scatter of as many gradient bytes (the stand-in copies; the reduction's extra read is
  not emulated).
Then whole blocks, forward + backward, with moe.overlap none and two_chunk, each with every
stand-in moving the all-to-alls through the loopback transport (moetrain.parallel.loopback), and
without (the compute alone): `ref-47b`'s per-rank block, and `olmoe8` at ep 1 (the target: two_chunk
with the stand-in within 5% of the compute alone).

Blocks run eagerly (`--compile` compiles them; minutes of compile time). Every variant goes into
`detail`, the losers too; `pairs` carries, per pair kind, the time-weighted sigma and eta of the
stand-in with the lowest sigma among those that kept the link rate (>= 95%). The JSON is rewritten
after every measurement, so a run that is stopped leaves what it measured. `--cpu` runs every
code path on tiny shapes (plain copies, host timers; the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moetrain.config import RunConfig
from moetrain.config.presets import get_preset
from moetrain.model.transformer import Block
from moetrain.moe.layer import MoELayer
from moetrain.nn.mlp import SwiGLU
from moetrain.nn.rope import RotaryEmbedding
from moetrain.parallel.ep_dispatch import NoSyncDispatcher
from moetrain.parallel.loopback import LoopbackTransport
from moetrain.parallel.overlap import two_chunk_forward
from moetrain.tools.bench.timing import time_steps

STAND_INS = ("sm8", "sm16", "sm24", "sm32", "ce")
PAIRS = ("a2a", "fsdp_gather", "fsdp_reduce_scatter")

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _now():
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )

    @triton.jit
    def _paced_copy(src, dst, num_words, ns_per_tile, TILE: tl.constexpr):
        """Program p copies tiles p, p + k, ...; its i-th tile waits until i * ns_per_tile
        after its start, so k programs move k tiles per ns_per_tile (the global timer is coarse,
        so a program catches up in bursts; the mean rate holds)."""
        pid, k = tl.program_id(0), tl.num_programs(0)
        start = _now()
        offsets = tl.arange(0, TILE)
        i = 0
        for tile in range(pid, tl.cdiv(num_words, TILE), k):
            deadline = start + i * ns_per_tile
            now = _now()
            while now < deadline:
                now = _now()
            idx = tile * TILE + offsets
            mask = idx < num_words
            tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)
            i += 1

except ImportError:  # the CPU mode needs none of it
    _paced_copy = None


class StandIn:
    """Moves n bytes between two scratch buffers at `rate` (B/s) on the current stream."""

    TILE = 4096  # int32 words: 16 KiB a tile

    def __init__(self, kind: str, max_bytes: int, rate: float, device: torch.device) -> None:
        self.kind, self.rate, self.device = kind, rate, device
        words = math.ceil(max_bytes / 4)
        self.src = torch.randint(0, 2**30, (words,), dtype=torch.int32, device=device)
        self.dst = torch.empty_like(self.src)
        if kind == "ce" and device.type == "cuda":
            self.ce_rate, self.cycles_per_s = self._calibrate()

    def __call__(self, nbytes: int) -> None:
        words = min(math.ceil(nbytes / 4), self.src.numel())
        if self.device.type != "cuda":
            self.dst[:words].copy_(self.src[:words])
        elif self.kind == "ce":
            pieces = 8
            per = math.ceil(words / pieces)
            gap_s = max(0.0, 4 * per / self.rate - 4 * per / self.ce_rate)
            for i in range(0, words, per):
                self.dst[i : i + per].copy_(self.src[i : i + per])
                torch.cuda._sleep(int(gap_s * self.cycles_per_s))
        else:
            k = int(self.kind[2:])
            ns_per_tile = int(4 * self.TILE * k / self.rate * 1e9)
            _paced_copy[(k,)](self.src, self.dst, words, ns_per_tile, TILE=self.TILE, num_warps=4)

    def _calibrate(self) -> tuple[float, float]:
        """The copy path's unpaced rate (B/s) and the sleep kernel's cycles per second."""
        n = self.src.numel() // 2
        copy_ms = median_ms(lambda: self.dst[:n].copy_(self.src[:n]), self.device, reps=5)
        cycles = 20_000_000
        sleep_ms = median_ms(lambda: torch.cuda._sleep(cycles), self.device, reps=3)
        return 4 * n / (copy_ms * 1e-3), cycles / (sleep_ms * 1e-3)


def median_ms(fn: Callable[[], object], device: torch.device, reps: int = 7, warmup: int = 2) -> float:  # fmt: skip
    """Median ms of `reps` calls queued back to back (one synchronize at the end, so the GPU
    never idles between calls); host timers off CUDA."""
    if device.type != "cuda":
        return statistics.median(time_steps(fn, warmup, reps, device))
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]  # fmt: skip
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in events)


def together(compute: Callable, comm: Callable, device: torch.device) -> tuple[Callable, list]:
    """fn running `comm` on a side stream while `compute` runs on the current one, and the
    list its calls append the compute's own (start, end) events to."""
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    marks: list = []

    def fn():
        if side is None:
            comm()
            compute()
            return
        main = torch.cuda.current_stream(device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            comm()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        compute()
        end.record()
        marks.append((start, end))
        main.wait_stream(side)

    return fn, marks


def measure_pair(compute: Callable, stand_in: StandIn, nbytes: int, device: torch.device) -> dict:
    t_comp = median_ms(compute, device)
    t_comm = median_ms(lambda: stand_in(nbytes), device)
    pair, _ = together(compute, lambda: stand_in(nbytes), device)
    t_pair = median_ms(pair, device)
    # sigma: a transfer that outlasts the compute, so that all of it runs contended
    repeats = max(1, math.ceil(1.3 * t_comp / max(t_comm, 1e-6)))
    covered, marks = together(compute, lambda: [stand_in(nbytes) for _ in range(repeats)], device)
    median_ms(covered, device, reps=5)
    if marks:
        torch.cuda.synchronize(device)
        t_under = statistics.median(s.elapsed_time(e) for s, e in marks[-5:])
    else:
        t_under = t_comp
    return {
        "t_comp_ms": t_comp,
        "t_comm_ms": t_comm,
        "t_pair_ms": t_pair,
        "t_comp_with_comm_ms": t_under,
        "sigma": t_under / t_comp - 1,
        "eta": (t_comp + t_comm - t_pair) / max(min(t_comp, t_comm), 1e-9),
        "comm_gbps": nbytes / (t_comm * 1e-3) / 1e9,
    }


def make_block(config: RunConfig, device: torch.device, dtype: torch.dtype) -> Block:
    """One MoE block of `config`, random weights (normal 0.02, norms 1), in `dtype`."""
    with torch.device(device):
        block = Block(config, 0)
    with torch.no_grad():
        for name, param in block.named_parameters():
            param.fill_(1.0) if name.endswith("norm.weight") else param.normal_(0, 0.02)
    for module in block.modules():
        if isinstance(module, RotaryEmbedding):
            module.init_weights()
        elif isinstance(module, MoELayer):
            module.reset_buffers()
    return block.to(dtype)


def with_moe(config: RunConfig, **moe) -> RunConfig:
    return dataclasses.replace(config, moe=dataclasses.replace(config.moe, **moe))


def shapes(cpu: bool) -> dict:
    """Per-rank shapes: ref-47b at ep 8 (and its whole block for FSDP), olmoe8 at ep 1."""
    if cpu:
        sizes = ["model.d_model=64", "moe.expert_hidden=64", "train.micro_batch_size=4"]
        tiny = get_preset("tiny").with_overrides([*sizes, "train.seq_len=32"])
        return {"olmoe8": (tiny, 1), "ref-47b": (tiny, 2)}
    # olmoe8 first: the target case, measured before a compiled run's time runs out
    return {"olmoe8": (get_preset("olmoe8"), 1), "ref-47b": (get_preset("ref-47b"), 8)}


class Recorder:
    def __init__(self, path: Path, meta: dict) -> None:
        self.path, self.meta, self.detail = path, meta, []

    def add(self, row: dict) -> None:
        self.detail.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
        self.write()

    def write(self) -> None:
        best = {k: best_stand_in([r for r in self.detail if r.get("pair") == k]) for k in PAIRS}
        pairs = {k: v for k, v in best.items() if v is not None}
        out = {**self.meta, "pairs": pairs, "detail": self.detail}
        self.path.write_text(json.dumps(out, indent=1) + "\n")


def best_stand_in(rows: list[dict]) -> dict | None:
    """The time-weighted sigma and eta over a kind's pairings, for the stand-in with the lowest
    sigma among those that kept >= 95% of the link rate (else all)."""
    rows = [r for r in rows if "sigma" in r]
    by_kind: dict[str, list] = {}
    for r in rows:
        by_kind.setdefault(r["stand_in"], []).append(r)
    summary = {}
    for kind, rs in by_kind.items():
        comp = sum(r["t_comp_ms"] for r in rs)
        hidden = sum(r["t_comp_ms"] + r["t_comm_ms"] - r["t_pair_ms"] for r in rs)
        shorter = sum(min(r["t_comp_ms"], r["t_comm_ms"]) for r in rs)
        summary[kind] = {
            "sigma": sum(r["t_comp_with_comm_ms"] for r in rs) / comp - 1,
            "eta": hidden / max(shorter, 1e-9),
            "at_rate": all(r["comm_gbps"] >= 0.95 * r["link_gbps"] for r in rs),
            "pairings": sorted({r["compute"] for r in rs}),
        }
    if not summary:
        return None
    fast = {k: v for k, v in summary.items() if v["at_rate"]} or summary
    kind = min(fast, key=lambda k: fast[k]["sigma"])
    s = fast[kind]
    note = (
        f"stand-in {kind} (lowest sigma of those at the link rate: "
        f"{', '.join(sorted(fast))}); time-weighted over {', '.join(s['pairings'])}"
    )
    return {"sigma": round(s["sigma"], 4), "eta": round(s["eta"], 4), "note": note}


def pairings(rec: Recorder, args, device, dtype, deadline: float) -> None:
    config, ep = shapes(args.cpu)["ref-47b"]
    m, moe, t = config.model, config.moe, config.train
    D, K = m.d_model, moe.top_k
    T_chunk = t.micro_batch_size // 2 * t.seq_len
    local = with_moe(config, num_experts=moe.num_experts // ep)
    block = make_block(local, device, dtype)
    x = torch.randn(t.micro_batch_size // 2, t.seq_len, D, device=device, dtype=dtype)
    shared = SwiGLU(D, moe.expert_hidden).to(device=device, dtype=dtype)
    e = moe.num_experts // ep
    rows = torch.randn(T_chunk * K, D, device=device, dtype=dtype, requires_grad=True)
    counts = torch.bincount(torch.randint(0, e, (T_chunk * K,), device=device), minlength=e)
    offsets = counts.cumsum(0).to(torch.int32)
    experts = block.ffn.experts

    def backward_of(forward: Callable[[], torch.Tensor]) -> Callable[[], None]:
        out = forward()
        grad = torch.randn_like(out)
        return lambda: torch.autograd.backward(out, grad, retain_graph=True)

    xg = x.detach().requires_grad_()
    attn = lambda: block.attn(block.attn_norm(xg))  # noqa: E731
    experts_fwd = lambda: experts(rows, offsets)  # noqa: E731
    a2a_bytes = 7 * T_chunk * K * D * 2 // 8
    computes = {
        "attention_fwd": attn,
        "shared_expert_fwd": lambda: shared(xg.view(-1, D)),
        "experts_fwd": experts_fwd,
        "experts_bwd": backward_of(experts_fwd),
        "attention_bwd": backward_of(attn),
    }
    full = make_block(config, device, dtype)  # FSDP: every expert, the whole micro-batch
    x_full = torch.randn(t.micro_batch_size, t.seq_len, D, device=device, dtype=dtype)
    block_bytes = 7 * sum(p.numel() for p in full.parameters()) * 2 // 8
    fsdp = {
        "block_fwd": (lambda: full(x_full), "fsdp_gather"),
        "block_bwd": (backward_of(lambda: full(x_full)), "fsdp_reduce_scatter"),
    }
    max_bytes = max(a2a_bytes, block_bytes)
    for kind in STAND_INS:
        if time.time() > deadline:
            rec.add({"skipped": f"pairings with {kind}: out of time"})
            continue
        try:
            stand_in = StandIn(kind, max_bytes, args.link_gbps * 1e9, device)
        except Exception as exc:  # a stand-in that fails is recorded, the others still run
            rec.add({"stand_in": kind, "error": repr(exc)[:300]})
            continue
        jobs = [(n, fn, "a2a", a2a_bytes) for n, fn in computes.items()]
        jobs += [(n, fn, pair, block_bytes) for n, (fn, pair) in fsdp.items()]
        for name, fn, pair, nbytes in jobs:
            try:
                row = measure_pair(fn, stand_in, nbytes, device)
            except Exception as exc:
                row = {"error": repr(exc)[:300]}
            rec.add({"pair": pair, "compute": name, "stand_in": kind, "bytes": nbytes,
                     "link_gbps": args.link_gbps, "shape": "ref-47b per rank, ep 8", **row})  # fmt: skip
        del stand_in
    full.zero_grad(set_to_none=True)


def layers(rec: Recorder, args, device, dtype, deadline: float) -> None:
    """Whole blocks, forward + backward: overlap none / two_chunk, with each stand-in moving
    7/8 of every exchange's bytes through the loopback transport, and without."""
    for preset, (config, ep) in shapes(args.cpu).items():
        moe = config.moe
        local = with_moe(config, num_experts=moe.num_experts // ep)
        e = local.moe.num_experts
        block = make_block(local, device, dtype)
        transport = LoopbackTransport()
        # a group of one with cf = e / K: every route kept, blocks of exactly T K rows
        block.ffn.dispatcher = NoSyncDispatcher(e, None, 0, e / moe.top_k, transport=transport)
        own_forward, chunked_forward = block.forward, two_chunk_forward(block)
        if args.compile:
            block.compile()
        t = config.train
        x = torch.randn(t.micro_batch_size, t.seq_len, config.model.d_model, device=device, dtype=dtype)  # fmt: skip
        grad = torch.randn_like(x)
        rows = t.micro_batch_size * t.seq_len * moe.top_k
        max_bytes = 7 * rows * config.model.d_model * 2 // 8

        def step(block=block, x=x, grad=grad):
            block(x).backward(grad)

        for kind in (None, *STAND_INS):
            if time.time() > deadline:
                rec.add({"skipped": f"{preset} layers with {kind}: out of time"})
                break
            try:
                stand_in = None if kind is None else StandIn(kind, max_bytes, args.link_gbps * 1e9, device)  # fmt: skip
            except Exception as exc:
                rec.add({"layer": preset, "stand_in": kind, "error": repr(exc)[:300]})
                continue
            transport.stand_in = None if stand_in is None else (
                lambda x_RD, s=stand_in: s(7 * x_RD.numel() * x_RD.element_size() // 8)
            )  # fmt: skip
            for overlap in ("none", "two_chunk"):
                block.forward = chunked_forward if overlap == "two_chunk" else own_forward
                try:
                    ms = median_ms(step, device, reps=5)
                    row = {"fwd_bwd_ms": ms}
                except Exception as exc:
                    row = {"error": repr(exc)[:300]}
                rec.add({"layer": preset, "ep": ep, "overlap": overlap, "stand_in": kind or "off",
                         "compiled": args.compile, "link_gbps": args.link_gbps, **row})  # fmt: skip
                block.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/overlap.json")
    parser.add_argument("--link-gbps", type=float, default=450.0)
    parser.add_argument("--budget-s", type=float, default=230.0, help="stop starting new parts")
    parser.add_argument("--compile", action="store_true", help="compile the blocks")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes, code paths only")
    parser.add_argument("--parts", default="pairs,layers", help="pairs, layers or both")
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    start = time.time()
    meta = {
        "gpu": "cpu" if args.cpu else torch.cuda.get_device_name(device),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "command": "python benchmarks/overlap.py "
        + " ".join(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "out"),
    }
    rec = Recorder(Path(args.out), meta)
    torch.manual_seed(0)
    parts = args.parts.split(",")
    if "pairs" in parts:
        pairings(rec, args, device, dtype, start + (0.55 if "layers" in parts else 1) * args.budget_s)  # fmt: skip
    if "layers" in parts:
        layers(rec, args, device, dtype, start + args.budget_s)
    summary(rec)


def summary(rec: Recorder) -> None:
    print("\npair kind            sigma    eta   (" + str(rec.path) + ")")
    for kind, v in json.loads(rec.path.read_text())["pairs"].items():
        print(f"{kind:20s} {v['sigma']:6.3f} {v['eta']:6.3f}")
    print("layer      stand-in  none ms  two_chunk ms  (vs the compute alone: none, stand-in off)")
    rows = [r for r in rec.detail if "fwd_bwd_ms" in r]
    for preset in dict.fromkeys(r["layer"] for r in rows):
        ms = {(r["stand_in"], r["overlap"]): r["fwd_bwd_ms"] for r in rows if r["layer"] == preset}
        alone = ms.get(("off", "none"), float("nan"))
        for kind in dict.fromkeys(k for k, _ in ms):
            a, b = ms.get((kind, "none"), float("nan")), ms.get((kind, "two_chunk"), float("nan"))
            print(f"{preset:10s} {kind:8s} {a:8.2f} ({a / alone - 1:+6.1%}) {b:8.2f} ({b / alone - 1:+6.1%})")  # fmt: skip


if __name__ == "__main__":
    main()
