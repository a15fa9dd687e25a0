"""`moetrain plan` on the command line: flags, the cluster they describe, and the one ranking of
every layout family (plan/ranking.py) with its answer, caveats and the best row's command
(plan/answer.py), or all of it as JSON (`--json`). rich is imported only to print the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from moetrain.config import RunConfig
from moetrain.config.presets import load_config as layered_config
from moetrain.tools.plan import answer, calibration
from moetrain.tools.plan.layout import CHECKPOINTING, GPUS, SCHEDULES, Cluster
from moetrain.tools.plan.memory import resolved_dispatcher
from moetrain.tools.plan.overlap import overlap_from
from moetrain.tools.plan.rank_compute import Setting
from moetrain.tools.plan.ranking import default_expert_load, global_batch, rank

_CLUSTER_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Cluster)}
PLANNED_VOCAB_SIZE = 50304  # a config that leaves the vocabulary to the tokenizer


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="which layout to train with: every family ranked, the best one's command",
        description="Rank every layout (DDP with replicated or resident experts, ZeRO-1 or "
        "replicated AdamW, pipeline stages; FSDP2; HSDP) by modelled memory and step time at one "
        "global batch, and print the answer, its caveats and the command that runs it.",
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
    p.add_argument(
        "--overlap",
        help="overlap pairs measured by bench (default: benchmarks/overlap.json when it exists)",
    )
    p.add_argument(
        "--expert-load",
        type=float,
        help="the busiest expert rank's routed rows over the mean (default 1.25, 1 for "
        "moe.routing random): a capacity factor or a measured imbalance",
    )
    p.add_argument("--top", type=int, default=10, help="rows shown, and each family's best")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--details", action="store_true", help="the model's assumptions and #1's step in parts"
    )
    p.add_argument("--compare-fsdp", action="store_true", help=argparse.SUPPRESS)  # the old mode
    p.set_defaults(func=run_plan)
    return p


def load_config(
    config: str | None, preset: str | None, overrides: list[str]
) -> tuple[RunConfig, tuple[str, ...]]:
    """--preset, a config file (layered on the preset it names, or on --preset), then --set; and
    the --set items the planner added: a vocabulary left to the tokenizer is PLANNED_VOCAB_SIZE
    (the planner reads no data)."""
    if config is None and preset is None:
        raise ValueError("give a config file or --preset NAME")
    run = layered_config(preset, config)
    run = run.with_overrides(overrides) if overrides else run
    assumed: tuple[str, ...] = ()
    if run.model.vocab_size is None:
        assumed = (f"model.vocab_size={PLANNED_VOCAB_SIZE}",)
        run = run.with_overrides(list(assumed))
    return run, assumed


def run_plan(args: argparse.Namespace) -> int:
    try:
        config, assumed = load_config(args.config, args.preset, args.set)
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
        tokens, batch_source = global_batch(config, args.global_batch_tokens)
        load = args.expert_load
        setting = Setting(
            cluster=cluster,
            global_batch_tokens=tokens,
            overlap=overlap_from(args.overlap),
            expert_load=default_expert_load(config) if load is None else load,
            load_source="--expert-load" if load is not None else _load_source(config),
            dispatcher="no_sync" if resolved_dispatcher(config, 2) == "no_sync" else "all_to_all",
        )
        ranking = rank(
            config,
            setting,
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
    if args.compare_fsdp:
        print(
            "note: --compare-fsdp is no longer needed: every plan ranks FSDP2 and HSDP with the "
            "resident layouts",
            file=sys.stderr,
        )
    source = answer.Source(args.preset, args.config, tuple(args.set), assumed)
    if args.json:
        print(json.dumps(answer.to_json(config, ranking, source, args.top, calibrated), indent=1))
        return 0
    if calibrated:
        print(f"calibrated: {calibrated}")
    print("\n".join(answer.header(config, ranking, batch_source)))
    wide_console().print(answer.table(ranking, args.top))
    print("\n".join(answer.verdict(ranking)))
    print("Caveats:\n" + "\n".join(f"- {line}" for line in answer.caveats(
        ranking, calibrated, source)))  # fmt: skip
    if ranking.rows:
        best = ranking.rows[0]
        print("\n".join(answer.commands(best, source, args.gpus, args.nodes_of)))
    if args.details:
        print("\n".join(answer.details(config, ranking)))
    return 0


def _load_source(config: RunConfig) -> str:
    if config.moe.routing == "random":
        return "the default for moe.routing random: even"
    return "the default for learned routing: a recorded router's, benchmarks/RESULTS.md"


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


def wide_console() -> Any:
    """A rich console; piped, rich would assume 80 columns and squeeze the tables, so 150."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=150)
