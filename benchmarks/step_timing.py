"""Where a timed step's milliseconds go outside the kernels: the host's share of a graphed step.

    python benchmarks/step_timing.py [--preset small] [--optimizer bf16-adamw] [--steps 20]

The trainer is built exactly as `moetrain bench` builds it. Then, after warm-up, each variant is
timed with CUDA events (all samples printed):
1. `train_step`, synchronized after each step (what `moetrain bench` reports);
2. the captured graph's `replay()` alone, synchronized after each (the inputs stay in the graph's
   static buffers: no loader, no copies, no learning-rate fill);
3. `--burst` replays back to back between two events (no host gap between replays at all);
plus the host's own time: `next(loader)`, and `train_step` without a synchronization.
The difference 1 - 2 is host work the GPU waits for; 2 - 3 is the launch of the graph.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moetrain.bench.harness import warmed_trainer
from moetrain.bench.timing import time_steps
from moetrain.presets import get_preset


def event_ms(fn, steps: int) -> list[float]:
    return time_steps(fn, warmup=0, steps=steps, device=torch.device("cuda"))


def show(label: str, times: list[float]) -> None:
    times_s = " ".join(f"{t:.2f}" for t in times)
    print(f"{label:<34} median {statistics.median(times):7.3f} ms  [{times_s}]", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--optimizer", default="bf16-adamw")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--burst", type=int, default=10)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    config = get_preset(args.preset).with_overrides(args.set)
    with warmed_trainer(config, args.optimizer) as (trainer, it):
        graph = trainer.step_graph.graph if trainer.step_graph is not None else None
        print(f"{args.preset} {args.optimizer}: graphed {graph is not None}")
        show("train_step, synchronized", event_ms(lambda: trainer.train_step(it), args.steps))
        if graph is not None:
            show("graph.replay() alone", event_ms(graph.replay, args.steps))

            def burst() -> None:
                for _ in range(args.burst):
                    graph.replay()

            show(
                f"{args.burst} replays / {args.burst}", [t / args.burst for t in event_ms(burst, 3)]
            )
        host = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            next(it)
            host.append((time.perf_counter() - t0) * 1e3)
        show("host: next(loader)", host)
        host = []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            trainer.train_step(it)
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        show("host: train_step, not synchronized", host)
        show(
            "train_step, synchronized (again)", event_ms(lambda: trainer.train_step(it), args.steps)
        )


if __name__ == "__main__":
    main()
