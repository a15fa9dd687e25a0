"""Top GPU kernels of one training step of a preset, for finding where time goes.

python benchmarks/profile_step.py --preset small [--set parallel.compile=true] [--top 40]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from moetrain.config.presets import get_preset
from moetrain.tools.bench.harness import warmed_trainer
from moetrain.tools.bench.phases import classify


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--optimizer", default="mixed")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--ops", type=int, default=0, help="also list the top N aten ops by shape")
    parser.add_argument("--trace", default="", help="also write a Chrome trace of the step here")
    args = parser.parse_args()
    config = get_preset(args.preset).with_overrides(args.set)
    with warmed_trainer(config, args.optimizer) as (trainer, it):
        with profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True
        ) as prof:
            trainer.train_step(it)
            torch.cuda.synchronize()
    if args.trace:
        prof.export_chrome_trace(args.trace)
    if args.ops:
        print(
            prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_device_time_total",
                row_limit=args.ops,
                max_name_column_width=40,
                max_shapes_column_width=60,
            )
        )
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name, []).append(e.device_time_total / 1e3)
    total = sum(sum(v) for v in kernels.values())
    print(
        f"total GPU kernel time {total:.1f} ms over {sum(len(v) for v in kernels.values())} kernels"
    )
    for name, times in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[: args.top]:
        print(f"{sum(times):8.2f} ms {len(times):5d}x  [{classify(name)[:12]:12s}] {name[:150]}")
    phases: dict[str, float] = {}
    for name, times in kernels.items():
        phases[classify(name)] = phases.get(classify(name), 0.0) + sum(times)
    print("by phase (tools/bench/phases.py's rules):")
    for phase, ms in sorted(phases.items(), key=lambda kv: -kv[1]):
        print(f"{ms:8.2f} ms  {phase}")


if __name__ == "__main__":
    main()
