"""`moetrain plan` on the command line: flags, the cluster they describe, and the ranked layouts
as a table or as JSON (`--json`). rich is imported only to print the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from moetrain.config import RunConfig
from moetrain.model.flops import ParamCounts, flops_per_token, param_counts
from moetrain.plan import calibration
from moetrain.plan.layout import (
    CHECKPOINTING,
    GIB,
    GPUS,
    SCHEDULES,
    Cluster,
    default_global_batch_tokens,
)
from moetrain.plan.search import Estimate, plan
from moetrain.presets import load_config as layered_config

_CLUSTER_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Cluster)}
COMPARE_INTERNODE_GBPS = 50.0  # --compare-fsdp without --internode-gbps: 400 Gb/s per GPU


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="rank parallel layouts by estimated memory and step time",
        description="Estimate per-GPU memory, traffic and step time of every valid "
        "(pp, dp, ep, micro-batch, checkpointing) layout and print the best.",
    )
    p.add_argument("config", nargs="?", help="a YAML run config")
    p.add_argument("--preset", help="a named preset instead of a config file")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--gpus", type=int, required=True, help="total number of GPUs")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    p.add_argument("--gpu-memory", type=float, help="usable GiB per GPU (default: datasheet)")
    p.add_argument("--nodes-of", type=int, default=8, help="GPUs per node (NVLink domain)")
    p.add_argument("--global-batch-tokens", type=int)
    p.add_argument("--pp", type=int)
    p.add_argument("--dp", type=int)
    p.add_argument("--ep", type=int)
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--checkpointing", choices=CHECKPOINTING)
    p.add_argument("--schedule", choices=SCHEDULES)
    for flag, field, what in (
        ("--efficiency", "matmul_efficiency", "dense products"),
        ("--grouped-efficiency", "grouped_efficiency", "expert grouped GEMMs"),
        ("--attention-efficiency", "attention_efficiency", "attention (model FLOPs)"),
        ("--fp8-efficiency", "fp8_efficiency", "FP8 products (of the FP8 peak)"),
    ):
        default = _CLUSTER_DEFAULTS[field]
        p.add_argument(flag, type=float, default=default, help=f"{what}: fraction of peak")
    p.add_argument("--nvlink-gbps", type=float, help="GB/s per direction per GPU in a node")
    p.add_argument("--internode-gbps", type=float, help="GB/s per GPU between nodes")
    p.add_argument(
        "--link-efficiency",
        type=float,
        default=_CLUSTER_DEFAULTS["link_efficiency"],
        help="share of the datasheet link bandwidth NCCL collectives reach",
    )
    p.add_argument("--overhead-gib", type=float, default=_CLUSTER_DEFAULTS["overhead_gib"])
    p.add_argument(
        "--calibration",
        help="rates measured by `moetrain bench --calibrate` (default: "
        "~/.cache/moetrain/calibration-<gpu>.json when it exists); they replace the efficiencies",
    )
    p.add_argument("--no-calibration", action="store_true", help="datasheet-derived rates only")
    g = p.add_argument_group("resident experts against FSDP2 (docs/plan.md)")
    g.add_argument(
        "--compare-fsdp",
        action="store_true",
        help="each resident-expert and FSDP2/HSDP variant at its best micro-batch and "
        "checkpointing that fits (the global batch: the config's, else 4M tokens)",
    )
    g.add_argument("--overlap", help="measured overlap pairs (default: benchmarks/overlap.json)")
    g.add_argument(
        "--expert-load",
        type=float,
        default=1.25,
        help="the busiest rank's expert rows over the mean: a capacity factor or a measured "
        "imbalance",
    )
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_plan)
    return p


def load_config(config: str | None, preset: str | None, overrides: list[str]) -> RunConfig:
    """--preset, a config file (layered on the preset it names, or on --preset), then --set."""
    if config is None and preset is None:
        raise ValueError("give a config file or --preset NAME")
    run = layered_config(preset, config)
    run = run.with_overrides(overrides) if overrides else run
    if run.model.vocab_size is None:  # the planner never reads data: the benchmark vocabulary
        run = run.with_overrides(["model.vocab_size=50304"])
    return run


def run_plan(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, args.preset, args.set)
        cluster = Cluster(
            gpu=GPUS[args.gpu],
            num_gpus=args.gpus,
            gpus_per_node=args.nodes_of,
            memory_gib=args.gpu_memory,
            nvlink_gbps=args.nvlink_gbps,
            internode_gbps=args.internode_gbps,
            link_efficiency=args.link_efficiency,
            matmul_efficiency=args.efficiency,
            grouped_efficiency=args.grouped_efficiency,
            attention_efficiency=args.attention_efficiency,
            fp8_efficiency=args.fp8_efficiency,
            overhead_gib=args.overhead_gib,
        )
        cluster, calibrated = apply_calibration(args, cluster, config.name)
        if args.compare_fsdp:
            return run_compare(args, config, cluster, calibrated)
        tokens = args.global_batch_tokens or default_global_batch_tokens(config, args.gpus)
        estimates = plan(
            config,
            cluster,
            tokens,
            pp=args.pp,
            dp=args.dp,
            ep=args.ep,
            micro_batch_size=args.micro_batch_size,
            checkpointing=args.checkpointing,
            schedule=args.schedule,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    counts = param_counts(config)
    best = estimates[: args.top]
    if args.json:
        print(
            json.dumps(
                {
                    "config": config.name,
                    "total_params": counts.total,
                    "active_params": counts.active,
                    "flops_per_token": flops_per_token(config),
                    "gpu": args.gpu,
                    "calibration": calibrated,
                    "num_gpus": args.gpus,
                    "gpus_per_node": args.nodes_of,
                    "memory_limit_gib": cluster.memory_bytes / GIB,
                    "global_batch_tokens": tokens,
                    "num_candidates": len(estimates),
                    "num_fitting": sum(e.fits for e in estimates),
                    "layouts": [e.to_dict() for e in best],
                },
                indent=2,
            )
        )
        return 0
    if calibrated:
        print(f"calibrated: {calibrated}")
    _print_table(config, cluster, tokens, estimates, best, counts)
    return 0


def run_compare(
    args: argparse.Namespace, config: RunConfig, cluster: Cluster, calibrated: str | None
) -> int:
    """--compare-fsdp: every variant's best point, the answer, the sweep in --json."""
    from moetrain.plan import compare_report as report
    from moetrain.plan.compare import best, sweep
    from moetrain.plan.overlap import overlap_from
    from moetrain.plan.rank_compute import FSDP, RESIDENT, Setting, global_batch_tokens

    if args.internode_gbps is None:  # the comparison's default network: 400 Gb/s per GPU
        cluster = dataclasses.replace(cluster, internode_gbps=COMPARE_INTERNODE_GBPS)
    setting = Setting(
        cluster=cluster,
        global_batch_tokens=args.global_batch_tokens or global_batch_tokens(config),
        overlap=overlap_from(args.overlap),
        expert_load=args.expert_load,
        load_source="--expert-load",
    )
    rows = sweep(config, setting, (RESIDENT[0], *RESIDENT[2:], *FSDP))
    if args.json:
        print(json.dumps(report.to_json(config, setting, rows) | {"calibration": calibrated}))
        return 0
    if calibrated:
        print(f"calibrated: {calibrated}")
    print("\n".join(report.assumptions(config, setting)))
    chosen = best(rows)
    print(report.markdown(list(chosen.values())))
    print("\n".join(report.answer(chosen)))
    if cluster.num_gpus == 8 and cluster.gpu.name == "b300":
        print("\n".join(report.reference(config, setting)[0]))
    return 0


def apply_calibration(
    args: argparse.Namespace, cluster: Cluster, config_name: str
) -> tuple[Cluster, str | None]:
    """The cluster with a calibration file's rates, and a line naming the file (None: none)."""
    if args.no_calibration:
        return cluster, None
    path = Path(args.calibration) if args.calibration else calibration.default_path(args.gpu)
    if not path.exists():
        if args.calibration:
            raise ValueError(f"--calibration {path}: no such file")
        return cluster, None
    measured = calibration.load(path)
    cluster = calibration.calibrated_cluster(cluster, measured, config_name)
    entry = "its own shapes" if config_name in measured.shapes else "the median of its entries"
    return cluster, (
        f"{path} ({measured.device_name}, {measured.date}; rates of {entry}: products at "
        f"{cluster.matmul_efficiency:.2f} / {cluster.grouped_efficiency:.2f} / "
        f"{cluster.attention_efficiency:.2f} of peak, {cluster.hbm_bps / 1e12:.1f} TB/s, "
        f"activations x {cluster.activation_factor:.2f})"
    )


def _print_table(
    config: RunConfig,
    cluster: Cluster,
    tokens: int,
    estimates: list[Estimate],
    best: list[Estimate],
    counts: ParamCounts,
) -> None:
    from rich.table import Table

    num_fit = sum(e.fits for e in estimates)
    table = Table(
        title=f"{config.name}: {counts.total / 1e9:,.1f}B params, {counts.active / 1e9:,.2f}B "
        f"active; {cluster.num_gpus} x {cluster.gpu.name} ({cluster.memory_bytes / GIB:.0f} GiB, "
        f"{cluster.gpus_per_node} per node); {tokens:,} tokens per step; "
        f"{num_fit} of {len(estimates)} layouts fit"
    )
    columns = ["pp", "dp", "ep", "mb", "ckpt", "micro", "step s", "tok/s/GPU", "TFLOP/s/GPU"]
    for name in columns + ["MFU", "dispatch", "rows/layer", "peak GiB", "fits"]:
        table.add_column(name, justify="left" if name in ("ckpt", "dispatch") else "right")
    for e in best:
        lay = e.layout
        table.add_row(
            *map(str, (lay.pp, lay.dp, lay.ep, lay.micro_batch_size)),
            lay.activation_checkpointing,
            str(e.num_microbatches),
            f"{e.step_s:.3f}",
            f"{e.tokens_per_s_per_gpu:,.0f}",
            f"{e.tflops_per_gpu:,.0f}",
            f"{e.mfu:.1%}",
            e.expert_rows.dispatcher,
            f"{e.expert_rows.rows:,}",
            f"{e.peak_memory / GIB:,.1f}",
            "yes" if e.fits else "[red]no[/red]",
        )
    console = wide_console()
    console.print(table)
    if best:
        e = best[0]
        console.print(
            f"best layout's step: products {e.matmul_s:.3f}s, elementwise {e.elementwise_s:.3f}s, "
            f"all-to-all + sends {e.comm_s:.3f}s, bubble {e.bubble_s:.3f}s ({e.layout.schedule}), "
            f"gradient sync {e.grad_sync_s:.3f}s, optimizer {e.optimizer_s:.3f}s"
        )
        console.print(f"best layout's expert buffers on a rank: {e.expert_rows.describe()}")


def wide_console() -> Any:
    """A rich console; piped, rich would assume 80 columns and squeeze the tables, so 150."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=150)
