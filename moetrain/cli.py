"""`moetrain` command line: parse arguments, call the library, print. No training logic here."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moetrain.config import RunConfig
from moetrain.config.presets import PRESETS, names_field
from moetrain.config.presets import load_config as layered_config
from moetrain.data.cli import add_prepare_parser
from moetrain.tools.bench.cli import add_bench_parser
from moetrain.tools.convert.cli import add_convert_parsers
from moetrain.tools.plan import add_plan_parser
from moetrain.tools.plot import add_plot_parser

DEFAULT_PRESET = "demo"


def version() -> str:
    """The installed distribution's version (pyproject.toml), without importing torch."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("moetrain")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def load_config(args: argparse.Namespace) -> RunConfig:
    """--preset (default: demo) and/or CONFIG.yaml layered on it (or on its base YAML or
    preset), then --set overrides; model.vocab_size unset, or the preset's where neither the
    YAML nor --set names it, is taken from the data's tokenizer (`resolve_vocab_size`), and so
    is data.eos_id with document masking: what the trainer will use."""
    from moetrain.data.loader import resolve_eos_id, resolve_vocab_size

    path = getattr(args, "config", None)
    overrides = args.set or []
    for item in overrides:
        if "=" not in item:  # `--set train.steps 2` leaves "2" as the config file
            value = path if path is not None and not Path(path).is_file() else "VALUE"
            raise ValueError(f"--set {item} needs a value: write --set {item}={value}")
    config = layered_config(args.preset, path).with_overrides(overrides)
    given = names_field("model.vocab_size", path, overrides)
    return resolve_eos_id(resolve_vocab_size(config, given=given))


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config",
        nargs="?",
        help="run config YAML, layered on the preset its `preset:` key or --preset names",
    )
    p.add_argument(
        "--preset",
        choices=list(PRESETS),
        help=f"named config, or the base of the YAML (default {DEFAULT_PRESET})",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="SECTION.FIELD=VALUE",
        help="override a config field; repeatable, e.g. --set train.lr=1e-3",
    )


def check_device(device: str | None) -> None:
    """A CUDA device this machine lacks is a one-line error, not a traceback from deep inside."""
    if device is None or not device.startswith("cuda"):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = device.partition(":")[2]
    if count == 0:
        raise ValueError(
            f"--device {device}: this machine has no CUDA device (torch {torch.__version__}); "
            "use --device cpu, or leave --device out to pick one"
        )
    if index and (not index.isdigit() or int(index) >= count):
        raise ValueError(f"--device {device}: this machine has CUDA devices cuda:0..{count - 1}")


def train_config(args: argparse.Namespace) -> RunConfig:
    """The config `train` runs: `load_config`'s, or with --resume the run's own config.yaml
    with the --set changes it allows, validated against that config (a --preset or YAML given
    again must agree with it; without a config.yaml, a first start, the requested config).
    Sets `args.run_dir` to the directory a resume reads."""
    if args.resume and args.overwrite:
        raise ValueError(
            "--resume continues the run in its directory and --overwrite deletes it: "
            "pass --resume to go on with the run, or --overwrite to start it over"
        )
    if not args.resume:
        return load_config(args)
    from moetrain.data import resolve_data_paths
    from moetrain.train.resume_config import resume_run_config

    given = " and ".join(filter(None, [args.preset and f"--preset {args.preset}", args.config]))
    requested = load_config(args) if given else None
    names = [item.partition("=")[2] for item in args.set or [] if item.startswith("name=")]
    name = requested.name if requested else (names or [layered_config(DEFAULT_PRESET).name])[-1]
    args.run_dir = args.run_dir or str(Path("runs") / name)
    run_dir, overrides = Path(args.run_dir), args.set or []
    if requested is None and not (run_dir / "config.yaml").is_file():
        requested = load_config(args)  # a first start under a requeue-safe --resume
    return resume_run_config(run_dir, requested, overrides, given, resolve_data_paths)


def cmd_train(args: argparse.Namespace) -> int:
    from moetrain.train.trainer import Trainer, TrainingStopped

    config = train_config(args)
    if args.dry_run:  # builds nothing: --device may name a device this machine lacks
        from moetrain.tools.dry_run import run_dry_run

        return run_dry_run(config, args)
    check_device(args.device)
    from moetrain.tools.fits import check_fits

    check_fits(config, args.device, force=args.force)
    trainer = Trainer(
        config,
        args.run_dir,
        resume=args.resume,
        init_from=args.init_from,
        device=args.device,
        progress=not args.quiet,
        overwrite=args.overwrite,
        allow_lr_increase=args.allow_lr_increase,
    )
    if trainer.is_main and trainer.step >= trainer.config.train.steps:
        print(
            f"note: the run in {trainer.run_dir.path} is already at train.steps "
            f"({trainer.config.train.steps}): nothing to train; continue it with --resume --set "
            "train.steps=N (a larger N)",
            file=sys.stderr,
        )
    summary = None
    try:
        summary = trainer.train()
    except TrainingStopped as exc:  # raised on every rank: they still shut down together
        if trainer.is_main:
            print(f"error: {exc}", file=sys.stderr)
    trainer.shutdown()
    if summary is None:
        return 1
    if trainer.is_main:
        print(json.dumps(summary))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from moetrain.train.evaluate import evaluate_checkpoint

    if args.sequences is not None and args.sequences < 1:
        raise ValueError(f"--sequences ({args.sequences}) must be >= 1")
    check_device(args.device)
    result = evaluate_checkpoint(
        args.checkpoint,
        device=args.device or "cpu",
        data=args.data,
        tasks=args.tasks,
        sequences=args.sequences,
        per_item=args.per_item,
    )
    print(json.dumps(result))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from moetrain.checkpoint.manager import resolve
    from moetrain.checkpoint.trained_model import checkpoint_tokenizer, load_model
    from moetrain.tools.generate import generate

    check_device(args.device)
    path = resolve(args.checkpoint)
    model, config = load_model(path, args.device or "cpu")
    tokenizer = checkpoint_tokenizer(path, config)
    new_ids = generate(
        model,
        tokenizer.encode(args.prompt),
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        eos_id=tokenizer.eos_id,
        seed=args.seed,
    )
    print(args.prompt + tokenizer.decode(new_ids))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from moetrain.model.flops import flops_per_token, param_counts

    config = inspected_config(args)
    counts = param_counts(config)
    dp = config.parallel.dp or 1
    edp = max(dp // config.parallel.ep, 1)
    # bf16 params + bf16 grads + fp32 master and two fp32 moments (12 B; Muon's matrices one
    # momentum, 8 B) sharded with the optimizer
    sharded = config.train.optimizer in ("sharded", "muon_sharded")
    muon = config.train.optimizer in ("muon", "muon_sharded")
    dense_muon = counts.muon - counts.experts if muon else 0
    dense_states = (counts.dense * 12 - dense_muon * 4) / (dp if sharded else 1)
    expert_states = (
        counts.experts / config.parallel.ep * (8 if muon else 12) / (edp if sharded else 1)
    )
    weights = (counts.dense + counts.experts / config.parallel.ep) * 2 * 2
    info = {
        "name": config.name,
        "vocab_size": config.model.vocab_size,
        "total_params": counts.total,
        "active_params": counts.active,
        "embedding_params": counts.embedding,  # active_params leaves the input embedding out
        "expert_params": counts.experts,
        "flops_per_token": flops_per_token(config),
        "optimizer_state_bytes_per_rank": int(dense_states + expert_states),
        "weights_and_grads_bytes_per_rank": int(weights),
    }
    if args.json:
        print(json.dumps(info))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"moetrain inspect: {config.name}", show_header=False)
    for key, value in info.items():
        if key.endswith("_bytes_per_rank"):
            table.add_row(key.replace("_bytes_", "_"), format_bytes(value))
        else:
            table.add_row(key, f"{value:,}" if isinstance(value, int) else str(value))
    Console().print(table)
    return 0


def inspected_config(args: argparse.Namespace) -> RunConfig:
    """`load_config`, or with --hf-config the model of a Hugging Face config.json (the families
    `moetrain import` reads) with --set over it."""
    if args.hf_config is None:
        return load_config(args)
    if args.config or args.preset:
        raise ValueError("--hf-config replaces a config file or --preset: give one of them")
    from moetrain.config import read_yaml
    from moetrain.tools.convert.hf import run_config_from_hf

    hf_config = read_yaml(args.hf_config)  # JSON is YAML
    if not isinstance(hf_config, dict):
        raise ValueError(f"{args.hf_config} must hold a config.json mapping")
    name = Path(args.hf_config).resolve().parent.name
    return run_config_from_hf(hf_config, name=name).with_overrides(args.set or [])


def format_bytes(num_bytes: float) -> str:
    """1536 -> '1.5 KiB'; binary units, three significant digits."""
    value, unit = float(num_bytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            break
        value /= 1024
    return f"{value:.0f} B" if unit == "B" else f"{value:.3g} {unit}"


def cmd_config(args: argparse.Namespace) -> int:
    """Print a complete config YAML: a starting point to edit, or what a YAML resolves to."""
    import yaml

    from moetrain.config.presets import yaml_chain

    config = load_config(args)
    base = args.preset or (None if args.config else DEFAULT_PRESET)
    source = " on ".join(str(p) for p, _ in yaml_chain(args.config)) if args.config else ""
    source = " on ".join(filter(None, [source, base and f"preset {base}"]))
    print(f"# moetrain config of {source}, resolved; edit it and run: moetrain train FILE.yaml")
    data = config.to_dict()
    print(yaml.safe_dump({"preset": base, **data} if base else data, sort_keys=False), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moetrain", description="Train Mixture-of-Experts LMs.")
    parser.add_argument("--version", action="version", version=f"moetrain {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "train",
        help="train a model (default: the demo preset on the embedded corpus)",
        description="Train a model. With no arguments: the demo preset on the "
        "embedded corpus, on the GPU if there is one.",
    )
    _add_config_args(p)
    p.add_argument("--run-dir", help="where config, metrics and checkpoints go (default runs/NAME)")
    p.add_argument(
        "--resume", action="store_true", help="continue from the newest complete checkpoint"
    )
    p.add_argument("--init-from", help="start from the weights of this checkpoint (e.g. imported)")
    p.add_argument(
        "--allow-lr-increase",
        action="store_true",
        help="--resume: go on when a changed schedule (train.steps, lr, ...) raises the LR above "
        "its last value (a re-warm); without it that is an error saying what the LR would do",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a run directory that holds an earlier run (deletes its checkpoints "
        "and metrics); without it that is an error",
    )
    p.add_argument(
        "--device",
        help="cpu, cuda, cuda:1 ... (default: cuda if available); with --dry-run the device "
        "planned for, which this machine need not have",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="start even when the predicted memory exceeds what the device has free",
    )
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="build this rank's model on the meta device, print its shapes and memory, and exit",
    )
    p.add_argument("--world-size", type=int, help="dry run: number of GPUs (default pp)")
    p.add_argument("--rank", type=int, default=0, help="dry run: which rank to show")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "eval",
        help="score a checkpoint: its run's validation data, eval sets and tasks by default",
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint dir or run dir")
    p.add_argument("--data", metavar="DIR", help="score this token directory (both splits) instead")
    p.add_argument(
        "--tasks",
        nargs="+",
        metavar="TASK",
        help="multiple-choice tasks instead of the run's train.eval_tasks: JSON-lines files or "
        "built-in names (continuation)",
    )
    p.add_argument(
        "--sequences", type=int, help="sequences to score (default: train.eval_sequences)"
    )
    p.add_argument(
        "--per-item",
        metavar="FILE",
        help="write each task item as a JSON line: its choices' log-likelihoods, the prediction, "
        "the answer and whether it is correct",
    )
    p.add_argument("--device")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("generate", help="sample text from a checkpoint")
    p.add_argument("--checkpoint", required=True, help="checkpoint dir or run dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("inspect", help="parameters, FLOPs per token and memory of a config")
    _add_config_args(p)
    p.add_argument(
        "--hf-config",
        metavar="FILE",
        help="the model of a Hugging Face config.json (OLMoE, Qwen3-MoE, Mixtral) instead",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "config",
        help="print a full config YAML (a starter to edit: moetrain config --preset tiny)",
    )
    _add_config_args(p)
    p.set_defaults(func=cmd_config)

    add_prepare_parser(sub)
    add_plan_parser(sub)
    add_convert_parsers(sub)
    add_plot_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        from moetrain.error_report import report_error

        report_error(f"error: {exc}")
        return 2
    except KeyboardInterrupt:  # training stops on its own at Ctrl-C; this is everything else
        print(f"moetrain {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
