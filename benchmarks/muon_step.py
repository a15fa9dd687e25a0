"""The optimizer step of Muon against AdamW on one GPU, and Muon's share of a whole step.

    python benchmarks/muon_step.py [--presets small,olmoe8,scale-E128] [--whole-step olmoe8]
        [--micro-batches 32] [--steps 5] [--set model.num_layers=4 ...] [--json OUT.jsonl]

Per preset and optimizer (train.optimizer adamw, then muon; bf16 parameters, fp32 masters, the
Triton AdamW kernel: `moetrain bench`'s "mixed"), the trainer is built as `moetrain bench` builds
it (random tokens, 3 warm-up steps, its step captured as a CUDA graph where it can be) and:
- the optimizer step alone (clip + update, on the gradients of one backward) is timed eagerly
  under `torch.cuda.set_sync_debug_mode("error")` (a host sync raises), then captured alone in a
  CUDA graph and its replays timed;
- Muon's Newton-Schulz alone: the batches its step forms, timed, against model/flops.py's count;
- for the presets in --whole-step, the whole graphed step with --micro-batches accumulation
  micro-batches, both optimizers, and Muon's added share of it.
--set applies config overrides to every preset (e.g. fewer layers where a GPU's memory holds
only part of a preset; each record names them). Prints a markdown table; --json appends one
record per preset and optimizer.
"""

from __future__ import annotations

import argparse
import json
from statistics import median

import torch

from moetrain.config.presets import get_preset
from moetrain.model.flops import muon_flops
from moetrain.optim.muon import Muon, MuonTensor, matrix_batches
from moetrain.optim.newton_schulz import newton_schulz
from moetrain.tools.bench.harness import release, warmed_trainer
from moetrain.tools.bench.timing import time_steps
from moetrain.train import step as train_step


def optimizer_step_ms(trainer, it, steps: int) -> dict[str, float | bool]:
    """Eager (no host sync allowed) and graph-captured optimizer steps on one backward's
    gradients (repeated steps move the weights; the work is the same)."""
    opt, device = trainer.optimizer, trainer.device
    train_step.forward_backward(trainer.model, it, 1, opt.no_sync)
    opt.finish_grad_sync()
    lr = torch.tensor(1e-4, dtype=torch.float64, device=device)
    skip = torch.zeros((), dtype=torch.bool, device=device)
    clip = trainer.config.train.grad_clip

    def step() -> None:
        opt.step(lr, clip, skip=skip)

    side = torch.cuda.Stream(device)  # warm-up off the capture stream, as train/graph.py does
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = time_steps(step, 1, steps, device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    replays = time_steps(graph.replay, 1, steps, device)
    graph.reset()
    opt.zero_grad()
    return {"eager_ms": median(eager), "graphed_ms": median(replays), "no_host_sync": True}


def newton_schulz_ms(optimizer: Muon, steps: int) -> float:
    """The Newton-Schulz calls of one Muon step (its batches of equal-shaped matrices)."""
    s = optimizer.settings
    tensors = [
        MuonTensor(w, torch.randn_like(w), m, layout, 1.0, 0.0)
        for w, m, layout in zip(
            optimizer.masters, optimizer.momenta, optimizer.layouts, strict=True
        )
    ]
    batches = [torch.cat([tensors[i].layout.to_matrices(tensors[i].grad) for i in b]) for b in matrix_batches(tensors)]  # fmt: skip

    def run() -> None:
        for x in batches:
            newton_schulz(x, s.ns_steps, s.ns_dtype)

    return median(time_steps(run, 1, steps, optimizer.masters[0].device))


def measure(preset: str, optimizer: str, args: argparse.Namespace) -> dict:
    config = get_preset(preset).with_overrides([*args.set, f"train.optimizer={optimizer}"])
    record: dict = {"preset": preset, "optimizer": optimizer, "gpu": torch.cuda.get_device_name()}
    record["overrides"] = list(args.set)
    micro = args.micro_batches if preset in args.whole_step.split(",") else 1
    with warmed_trainer(config, "mixed", micro_batches=micro) as (trainer, it):
        graph = trainer.step_graph
        record["step_graphed"] = graph is not None and graph.graph is not None
        if micro > 1:
            times = time_steps(lambda: trainer.train_step(it), 0, args.steps, trainer.device)
            record.update(micro_batches=micro, whole_step_ms=median(times))
        record.update(optimizer_step_ms(trainer, it, args.steps))
        if isinstance(trainer.optimizer, Muon):
            record["ns_tflop"] = muon_flops(config) / 1e12
            record["ns_ms"] = newton_schulz_ms(trainer.optimizer, args.steps)
            record["ns_tflops_per_s"] = record["ns_tflop"] / (record["ns_ms"] / 1e3)
        record["peak_gib"] = torch.cuda.max_memory_allocated(trainer.device) / 2**30
        release(trainer)
    torch.cuda.reset_peak_memory_stats()
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="small,olmoe8,scale-E128")
    parser.add_argument("--whole-step", default="olmoe8", help="presets timed as whole steps")
    parser.add_argument("--micro-batches", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], help="a config override")
    parser.add_argument("--json", default=None, help="append one JSON record per run here")
    args = parser.parse_args()
    records = []
    for preset in args.presets.split(","):
        for optimizer in ("adamw", "muon"):
            record = measure(preset, optimizer, args)
            records.append(record)
            print(json.dumps(record), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(record) + "\n")
    print("\n| preset | optimizer | step graphed | optimizer step eager / graphed (ms) | NS ms (TFLOP, TFLOP/s) | whole step ms (micro-batches) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in records:
        ns = f"{r['ns_ms']:.1f} ({r['ns_tflop']:.1f}, {r['ns_tflops_per_s']:.0f})" if "ns_ms" in r else "-"  # fmt: skip
        whole = f"{r['whole_step_ms']:.0f} ({r['micro_batches']})" if "whole_step_ms" in r else "-"
        print(f"| {r['preset']} | {r['optimizer']} | {r['step_graphed']} | {r['eager_ms']:.1f} / {r['graphed_ms']:.1f} | {ns} | {whole} |")  # fmt: skip
    for preset in args.whole_step.split(","):
        pair = {
            r["optimizer"]: r for r in records if r["preset"] == preset and "whole_step_ms" in r
        }
        if len(pair) == 2:
            a, m = pair["adamw"]["whole_step_ms"], pair["muon"]["whole_step_ms"]
            print(f"{preset}: Muon's whole step {m:.0f} ms vs AdamW's {a:.0f} ms: {100 * (m / a - 1):+.1f}%")  # fmt: skip


if __name__ == "__main__":
    main()
