"""`moetrain` command line: parse arguments, call the library, print. No training logic here."""

from __future__ import annotations

import argparse
import json
import os
import sys

from moetrain.bench.cli import add_bench_parser
from moetrain.config import RunConfig
from moetrain.convert.cli import add_convert_parsers
from moetrain.plan import add_plan_parser
from moetrain.plot import add_plot_parser
from moetrain.presets import PRESETS
from moetrain.presets import load_config as layered_config

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
    """--preset (default: demo) and/or CONFIG.yaml layered on it (or on the preset it names),
    then --set overrides; an unset model.vocab_size (and, with document masking, data.eos_id)
    is taken from the tokenizer."""
    from moetrain.data.loader import resolve_eos_id, resolve_vocab_size

    config = layered_config(args.preset, getattr(args, "config", None))
    return resolve_eos_id(resolve_vocab_size(config.with_overrides(args.set or [])))


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


def cmd_train(args: argparse.Namespace) -> int:
    from moetrain.train.trainer import Trainer, TrainingStopped

    check_device(args.device)
    config = load_config(args)
    if args.dry_run:
        from moetrain.dry_run import run_dry_run

        return run_dry_run(config, args)
    if args.resume:
        config = _resume_config(args, config)
    from moetrain.train.fits import check_fits

    check_fits(config, args.device, force=args.force)
    trainer = Trainer(
        config,
        args.run_dir,
        resume=args.resume,
        init_from=args.init_from,
        device=args.device,
        progress=not args.quiet,
        overwrite=args.overwrite,
    )
    if trainer.is_main and trainer.step >= trainer.config.train.steps:
        print(
            f"note: the run in {trainer.run_dir} is already at train.steps "
            f"({trainer.config.train.steps}): nothing to train; continue it with --resume --set "
            "train.steps=N (a larger N)",
            file=sys.stderr,
        )
    summary = None
    try:
        summary = trainer.train()
    except TrainingStopped as exc:  # raised on every rank: they still shut down together
        print(f"error: {exc}", file=sys.stderr)
    trainer.shutdown()
    if summary is None:
        return 1
    if trainer.is_main:
        print(json.dumps(summary))
    return 0


def _resume_config(args: argparse.Namespace, requested: RunConfig) -> RunConfig:
    """--resume trains with the run's own config.yaml plus the --set changes it allows
    (moetrain/config_resume.py), printed; a --preset or YAML given again must agree with it.
    Without a config.yaml (a first start under a requeue-safe --resume) the requested config."""
    from pathlib import Path

    from moetrain.config_resume import resume_config

    run_dir = Path(args.run_dir or Path("runs") / requested.name)
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return requested
    given = [f"--preset {args.preset}"] if args.preset else []
    given += [args.config] if getattr(args, "config", None) else []
    config, changes = resume_config(
        RunConfig.load_yaml(saved),
        args.set or [],
        str(saved),
        requested=requested if given else None,
        requested_from=" and ".join(given),
    )
    if changes and os.environ.get("RANK", "0") == "0":  # once, not once per rank
        print(f"--resume: changes to {saved}: " + "; ".join(changes), file=sys.stderr)
    args.run_dir = str(run_dir)
    return config


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
    )
    print(json.dumps(result))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from moetrain.checkpoint.manager import resolve
    from moetrain.inference import checkpoint_tokenizer, generate, load_model

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

    config = load_config(args)
    counts = param_counts(config)
    dp = config.parallel.dp or 1
    edp = max(dp // config.parallel.ep, 1)
    # bf16 params + bf16 grads + fp32 master and two fp32 moments (12 B) sharded with the optimizer
    sharded = config.train.optimizer == "sharded"
    dense_states = counts.dense * 12 / (dp if sharded else 1)
    expert_states = counts.experts / config.parallel.ep * 12 / (edp if sharded else 1)
    weights = (counts.dense + counts.experts / config.parallel.ep) * 2 * 2
    info = {
        "name": config.name,
        "total_params": counts.total,
        "active_params": counts.active,
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

    config = load_config(args)
    base = args.preset or (None if args.config else DEFAULT_PRESET)
    source = f"preset {base}" if base else args.config
    print(f"# moetrain config of {source}; edit it and run: moetrain train FILE.yaml")
    data = config.to_dict()
    print(yaml.safe_dump({"preset": base, **data} if base else data, sort_keys=False), end="")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moetrain.data import prepare
    from moetrain.data.documents import load_named_dataset
    from moetrain.data.tokens import check_not_prepared

    if args.pretokenized:
        return _prepare_pretokenized(args)
    if not args.hf_dataset:
        unused = [f for f in ("hf_config", "hf_split") if getattr(args, f) is not None]
        if unused:
            raise ValueError(f"--{unused[0].replace('_', '-')} needs --hf-dataset NAME")
    if not args.files and not args.hf_dataset:
        raise ValueError(
            "prepare needs input files, --hf-dataset NAME (or --pretokenized TOKEN_FILES)"
        )
    inputs = list(args.files)
    if args.hf_dataset:
        check_not_prepared(Path(args.out), args.overwrite)  # before a download, not after
        inputs.append(load_named_dataset(args.hf_dataset, args.hf_config, args.hf_split or "train"))
    out = prepare(
        inputs,
        args.out,
        tokenizer=args.tokenizer or "byte",
        val_fraction=args.val_fraction,
        progress=not args.quiet,
        overwrite=args.overwrite,
        text_field=args.text_field,
        workers=args.workers,
    )
    print(f"wrote {out}")
    return 0


# prepare's options that only text inputs take
_TEXT_ONLY = ("text_field", "workers", "hf_dataset", "hf_config", "hf_split")


def _prepare_pretokenized(args: argparse.Namespace) -> int:
    from moetrain.data.pretokenized import prepare_pretokenized

    if args.files:
        raise ValueError(
            f"prepare: give text inputs ({' '.join(args.files)}) or --pretokenized token files, "
            "not both"
        )
    needed = ("dtype", "eos_id", "vocab_size")
    missing = ["--" + n.replace("_", "-") for n in needed if getattr(args, n) is None]
    if missing:
        raise ValueError(f"prepare --pretokenized needs {', '.join(missing)}")
    given = [
        f"--{f.replace('_', '-')}" for f in _TEXT_ONLY if getattr(args, f) not in (None, "text")
    ]
    if given:
        raise ValueError(f"{', '.join(given)} does not apply to --pretokenized")
    out = prepare_pretokenized(
        args.pretokenized,
        args.out,
        dtype=args.dtype,
        eos_id=args.eos_id,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        overwrite=args.overwrite,
        tokenizer=args.tokenizer,
    )
    print(f"wrote {out} (an index of the token files; they are not copied)")
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
        "--overwrite",
        action="store_true",
        help="start over in a run directory that holds an earlier run (deletes its checkpoints "
        "and metrics); without it that is an error",
    )
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
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
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "config",
        help="print a full config YAML (a starter to edit: moetrain config --preset tiny)",
    )
    _add_config_args(p)
    p.set_defaults(func=cmd_config)

    p = sub.add_parser(
        "prepare", help="tokenize text, JSON lines, Parquet or HF datasets into a token directory"
    )
    p.add_argument(
        "files",
        nargs="*",
        help="files, directories or glob patterns: .txt (one document each), .jsonl/.json "
        "(optionally .gz/.zst), .parquet, or a Hugging Face dataset saved with save_to_disk",
    )
    p.add_argument(
        "--text-field", default="text", help="JSON field or column holding the text (default text)"
    )
    p.add_argument(
        "--hf-dataset",
        metavar="NAME",
        help="a Hugging Face dataset by name, through datasets.load_dataset (a Hub name, or a "
        "local directory of data files; needs the data extra); read after the files",
    )
    p.add_argument("--hf-config", help="--hf-dataset: its configuration (subset), if it has some")
    p.add_argument("--hf-split", help="--hf-dataset: the split to read (default train)")
    p.add_argument(
        "--workers",
        type=int,
        help="tokenizing processes (default: one per core, at most one per 8 MiB of input; "
        "1 = in this process). An interrupted prepare leaves OUT.partial; the same command "
        "resumes from it",
    )
    p.add_argument(
        "--pretokenized",
        nargs="+",
        metavar="TOKEN_FILES",
        help="index existing token files (.npy or headerless .npy/.bin memory maps; files, "
        "directories or globs) without copying them; needs --dtype, --eos-id, --vocab-size",
    )
    p.add_argument("--dtype", choices=["uint16", "uint32"], help="--pretokenized: token type")
    p.add_argument("--eos-id", type=int, help="--pretokenized: the id ending each document")
    p.add_argument("--vocab-size", type=int, help="--pretokenized: the tokenizer's vocabulary")
    p.add_argument("--out", required=True)
    p.add_argument(
        "--tokenizer",
        help="byte (the default), or a Hugging Face tokenizer.json; with --pretokenized, the "
        "tokenizer the files were made with (optional: recorded so that generate can decode)",
    )
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing token directory at --out (runs trained on it cannot resume)",
    )
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_prepare)

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
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
