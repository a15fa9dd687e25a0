"""`moetrain` command line: parse arguments, call the library, print. No training logic here."""

from __future__ import annotations

import argparse
import json
import sys

from moetrain.bench.cli import add_bench_parser
from moetrain.config import RunConfig
from moetrain.convert.cli import add_convert_parsers
from moetrain.plan import add_plan_parser
from moetrain.plot import add_plot_parser
from moetrain.presets import PRESETS, get_preset

DEFAULT_PRESET = "demo"


def load_config(args: argparse.Namespace) -> RunConfig:
    """CONFIG.yaml or --preset (default: demo), then --set overrides; an unset model.vocab_size
    is taken from the tokenizer."""
    from moetrain.data.loader import resolve_vocab_size

    if getattr(args, "config", None):
        config = RunConfig.load_yaml(args.config)
    else:
        config = get_preset(args.preset or DEFAULT_PRESET)
    return resolve_vocab_size(config.with_overrides(args.set or []))


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="run config YAML (default: the preset)")
    p.add_argument(
        "--preset", choices=list(PRESETS), help=f"named config (default {DEFAULT_PRESET})"
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="SECTION.FIELD=VALUE",
        help="override a config field; repeatable, e.g. --set train.lr=1e-3",
    )


def cmd_train(args: argparse.Namespace) -> int:
    from moetrain.train.trainer import Trainer, TrainingStopped

    config = load_config(args)
    if args.dry_run:
        from moetrain.dry_run import run_dry_run

        return run_dry_run(config, args)
    if args.resume:
        config = _resume_config(args, config)
    trainer = Trainer(
        config,
        args.run_dir,
        resume=args.resume,
        init_from=args.init_from,
        device=args.device,
        progress=not args.quiet,
        overwrite=args.overwrite,
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
    if changes:
        print(f"--resume: changes to {saved}: " + "; ".join(changes), file=sys.stderr)
    args.run_dir = str(run_dir)
    return config


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from moetrain.data import SequenceLoader, open_data
    from moetrain.inference import load_model
    from moetrain.train.step import evaluate

    model, config = load_model(args.checkpoint, args.device or "cpu")
    _, val_tokens, _ = open_data(config.data, config.model.vocab_size)
    loader = SequenceLoader(
        val_tokens,
        config.train.seq_len,
        config.train.micro_batch_size,
        seed=config.train.seed,
        device=next(model.parameters()).device,
    )
    n = min(args.batches, loader.batches_per_epoch)
    loss = evaluate(model, iter(loader), n).item()
    print(
        json.dumps(
            {"val_loss": loss, "batches": n, "perplexity": float(torch.exp(torch.tensor(loss)))}
        )
    )
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from moetrain.checkpoint.manager import resolve
    from moetrain.inference import checkpoint_tokenizer, generate, load_model

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
        table.add_row(key, f"{value:,}" if isinstance(value, int) else str(value))
    Console().print(table)
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from moetrain.data import prepare

    out = prepare(
        args.files,
        args.out,
        tokenizer=args.tokenizer,
        val_fraction=args.val_fraction,
        progress=not args.quiet,
        overwrite=args.overwrite,
    )
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moetrain", description="Train Mixture-of-Experts LMs.")
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
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="build this rank's model on the meta device, print its shapes and memory, and exit",
    )
    p.add_argument("--world-size", type=int, help="dry run: number of GPUs (default pp)")
    p.add_argument("--rank", type=int, default=0, help="dry run: which rank to show")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="validation loss of a checkpoint")
    p.add_argument("--checkpoint", required=True, help="checkpoint dir or run dir")
    p.add_argument("--batches", type=int, default=50)
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

    p = sub.add_parser("prepare", help="tokenize text/JSONL files into a token directory")
    p.add_argument("files", nargs="+", help=".txt (one document each) or .jsonl (a text field)")
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default="byte", help="byte, or a Hugging Face tokenizer.json")
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
