"""`moetrain bench`: argument parsing and printing for the benchmark harness."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from moetrain.config.presets import PRESETS, get_preset

SCALE_SERIES = ["scale-E8", "scale-E16", "scale-E32", "scale-E64", "scale-E128"]
CHECK_PRESETS = ["small", "olmoe8", "scale-E8", "scale-E128"]
PROJECT_PRESETS = ["olmoe-1b-7b", "ref-47b", *SCALE_SERIES]


def add_bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="time training steps (GPU), optionally against peers",
        description="Time full training steps (forward + backward + optimizer) on "
        "uniform random token ids, as in docs/benchmarks.md.",
    )
    p.add_argument("--preset", choices=list(PRESETS), default="small")
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE")
    p.add_argument(
        "--routing",
        type=_routing,
        default="learned",
        help="learned, random, or a routes file or directory to replay (moe.replay_routes; "
        "recorded at the preset's shape with moe.record_routes)",
    )
    p.add_argument(
        "--optimizer",
        choices=["mixed", "bf16-adamw", "both"],
        default="both",
        help="mixed: bf16 params + fp32 master (moetrain's default); bf16-adamw: the "
        "peers' setting (bf16 params and states)",
    )
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="micro-batches per timed step (gradient accumulation; 1: the peers' setting)",
    )
    p.add_argument("--compare", choices=["hf", "hf-compiled"], action="append", default=[])
    p.add_argument(
        "--sweep", action="store_true", help="run the expert-scaling series scale-E8..E128"
    )
    p.add_argument("--profile", action="store_true", help="per-phase GPU time of one step")
    p.add_argument("--json", help="write results as JSON here")
    p.add_argument("--results-md", help="append a dated table to this markdown file")
    p.add_argument("--device")
    g = p.add_argument_group("calibration and the N-GPU projection (docs/plan.md)")
    g.add_argument(
        "--calibrate",
        action="store_true",
        help="measure the planner's rates on this GPU, write the calibration file, and check "
        "the planner against bench on --check-presets",
    )
    g.add_argument("--check-presets", nargs="+", default=CHECK_PRESETS, metavar="PRESET")
    g.add_argument(
        "--calibration", help="calibration file to write (default: ~/.cache/moetrain/...)"
    )
    g.add_argument(
        "--project",
        action="store_true",
        help="resident experts against FSDP2 on --gpus GPUs of this kind and B300s: one rank's "
        "compute measured here, the rest from moetrain.tools.plan.compare (docs/plan.md)",
    )
    g.add_argument("--project-presets", nargs="+", default=PROJECT_PRESETS, metavar="PRESET")
    g.add_argument("--gpus", type=int, default=8)
    g.add_argument(
        "--link-efficiency",
        type=float,
        default=0.8,
        help="share of the datasheet link bandwidth NCCL collectives reach",
    )
    g.add_argument("--overlap", help="measured overlap pairs (default: benchmarks/overlap.json)")
    g.add_argument(
        "--expert-load",
        type=float,
        default=1.25,
        help="the busiest rank's expert rows over the mean (capacity factor or measured)",
    )
    g.add_argument(
        "--compute-scale",
        type=float,
        help="speed of the B300 rows' compute over the measured (default: datasheet ratios)",
    )
    g.add_argument("--out", help="write calibration, check and projection files here")
    p.set_defaults(func=run_bench)


def _routing(value: str) -> str:
    if value in ("learned", "random") or os.path.exists(value):
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is not learned, random or a routes file")


def run_bench(args: argparse.Namespace) -> int:
    import torch

    from moetrain.tools.bench import harness
    from moetrain.tools.bench.calibrate import sustained_line
    from moetrain.tools.bench.gpu_state import describe
    from moetrain.tools.bench.timing import matmul_tflops, sustained_matmul

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        print("note: no GPU; CPU timings are for smoke tests only", file=sys.stderr)
    if args.calibrate or args.project:
        return run_calibrate_and_project(args, device)
    mm = matmul_tflops(device)
    sustained = sustained_matmul(device)
    presets = SCALE_SERIES if args.sweep else [args.preset]
    optimizers = ["mixed", "bf16-adamw"] if args.optimizer == "both" else [args.optimizer]
    results, extra = [], {}
    if mm:
        extra["measured BF16 8192^3 matmul TFLOP/s"] = f"{mm:.0f}"
    if sustained:
        extra["the same matmul sustained (power limit)"] = sustained_line(sustained, mm)
    for name in presets:
        config = get_preset(name).with_overrides(args.set or [])
        for opt in optimizers:
            r = harness.bench_moetrain(
                config,
                routing=args.routing,
                optimizer=opt,
                steps=args.steps,
                warmup=args.warmup,
                device=str(device),
                mm_tflops=mm,
                profile=args.profile,
                micro_batches=args.micro_batches,
            )
            if sustained:
                r.mfu_sustained = r.tflops / sustained["tflops_second_half"]
            results.append(r)
            floor = harness.optimizer_floor_ms(config, opt)
            extra[f"{name} {opt} split"] = (
                ", ".join(f"{k} {v:.1f}" for k, v in r.split_ms.items())
                + f" (optimizer memory-traffic floor {floor:.1f} ms)"
                + ("; timed steps: CUDA graph replays, split: eager" if r.cuda_graph else "")
            )
            if r.phases_ms:
                busy = sum(r.phases_ms.values())
                extra[f"{name} {opt} phases (ms)"] = (
                    ", ".join(f"{k} {v:.1f}" for k, v in r.phases_ms.items())
                    + f"; GPU idle {r.profile['step_ms'] - busy:.1f} of {r.profile['step_ms']:.1f}"
                )
            if r.gpu_state:
                extra[f"{name} {opt} GPU during the timed steps"] = describe(r.gpu_state)
            print(harness.markdown_table([r]), flush=True)
            torch.cuda.empty_cache() if device.type == "cuda" else None
        for peer in args.compare:
            try:
                hr = harness.bench_hf(
                    config,
                    steps=args.steps,
                    warmup=args.warmup,
                    device=str(device),
                    mm_tflops=mm,
                    compile_model=peer == "hf-compiled",
                )
            except ValueError as exc:
                print(f"skipping {peer}: {exc}", file=sys.stderr)
                continue
            results.append(hr)
            if hr.gpu_state:
                extra[f"{name} {hr.system} GPU during the timed steps"] = describe(hr.gpu_state)
            ours = (r for r in results if r.system == "moetrain" and r.preset == config.name)
            same = next((r for r in ours if r.optimizer == "bf16-adamw"), results[-2])
            extra[f"{name} moetrain / {hr.system} (same optimizer)"] = (
                f"{same.tokens_per_s / hr.tokens_per_s:.2f}x tokens/s, peak memory "
                f"{same.peak_mem_gib:.1f} vs {hr.peak_mem_gib:.1f} GiB"
            )
    if args.sweep:
        base = {r.optimizer: r.tokens_per_s for r in results if r.preset == "scale-E8"}
        for r in results:
            if r.preset != "scale-E8" and r.system == "moetrain":
                extra[f"{r.preset} {r.optimizer} vs scale-E8"] = (
                    f"{100 * (r.tokens_per_s / base[r.optimizer] - 1):+.1f}% tokens/s"
                )
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 reports for all
        return 0
    print(harness.markdown_table(results))
    for key, value in extra.items():
        print(f"{key}: {value}")
    command = "moetrain " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    harness.write_outputs(results, command, args.json, args.results_md, extra)
    return 0


def run_calibrate_and_project(args: argparse.Namespace, device) -> int:
    """--calibrate and/or --project (in that order); with --out, every table and file there."""
    from pathlib import Path

    from moetrain.tools.bench import calibrate, measure_rank
    from moetrain.tools.plan import calibration
    from moetrain.tools.plan.overlap import overlap_from

    out = Path(args.out) if args.out else None
    report: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        report.append(text)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "report.md").write_text("\n".join(report) + "\n")

    bench_kw = {"steps": args.steps, "warmup": args.warmup, "device": str(device)}
    if args.calibrate:
        if device.type != "cuda":
            print("error: --calibrate measures a GPU", file=sys.stderr)
            return 2
        configs = [get_preset(n).with_overrides(args.set or []) for n in args.check_presets]
        cal = calibrate.calibrate(configs, device)
        path = Path(args.calibration) if args.calibration else calibration.default_path(cal.gpu)
        calibration.save(cal, path)
        if out is not None:
            calibration.save(cal, out / path.name)
        say(f"calibration written to {path}:\n{cal.to_json()}")
        say(f"sustained matmul: {cal.sustained_tflops} TFLOP/s (short: {cal.matmul_tflops:.0f})")
        say(
            "\nplanner (calibrated) against bench in mixed precision: time with the replicated "
            "AdamW (CUDA-graphed, as the time model assumes), memory with ShardedAdamW (what "
            f"the memory model holds):\n{calibrate.CHECK_HEADER}"
        )
        for config in configs:
            say(calibrate.check(config, cal, **bench_kw).row())
    if args.project:
        optimizer = "mixed" if args.optimizer == "both" else args.optimizer
        configs = [get_preset(n).with_overrides(args.set or []) for n in args.project_presets]
        say(f"\nprojection onto {args.gpus} GPUs ({optimizer}; compute measured on {device}):")
        measure_rank.run_projection(
            configs,
            gpus=args.gpus,
            optimizer=optimizer,
            out_dir=str(out) if out is not None else None,
            efficiency=args.link_efficiency,
            overlap=overlap_from(args.overlap),
            expert_load=args.expert_load,
            compute_scale=args.compute_scale,
            print_fn=say,
            **bench_kw,
        )
    return 0
