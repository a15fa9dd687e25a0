"""Does a lower expert learning rate help? Train the same preset with train.expert_lr_mult = 1.0
and = top_k / num_experts, and compare final validation loss.

The rationale for the lower rate: each expert sees only top_k / num_experts of the tokens, so its
gradients average fewer samples. The reference system reported that this did not help; this
script checks the claim on our stack. Each setting runs for several seeds (differences between
seeds set the noise floor) on the embedded corpus. Results: a markdown table on stdout and in
OUT/RESULTS.md, and raw numbers in OUT/results.json.

    python benchmarks/expert_lr_experiment.py --preset tiny --steps 200 --seeds 0 1 2
    python benchmarks/expert_lr_experiment.py --preset demo --set train.eval_sequences=256
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from moetrain.config import RunConfig
from moetrain.presets import get_preset
from moetrain.train.observe import read_metrics


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="tiny (seconds) or demo (minutes)")
    parser.add_argument("--steps", type=int, default=None, help="override train.steps")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/expert_lr"))
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: automatic)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace run directories left by an earlier call"
    )
    return parser.parse_args(argv)


def settings(config: RunConfig) -> list[tuple[str, float]]:
    """(label, expert_lr_mult) pairs: the baseline and "fewer tokens per expert" scaling."""
    top_k, num_experts = config.moe.top_k, config.moe.num_experts
    return [("same as dense", 1.0), (f"top_k / E = {top_k}/{num_experts}", top_k / num_experts)]


def run_one(
    base: RunConfig, mult: float, seed: int, run_dir: Path, device: str | None
) -> dict[str, Any]:
    from moetrain.train.trainer import Trainer  # imports the whole training stack: keep it lazy

    config = base.with_overrides([f"train.expert_lr_mult={mult}", f"train.seed={seed}"])
    started = time.perf_counter()
    result = Trainer(config, run_dir=run_dir, device=device, progress=False).train()
    train_records, _ = read_metrics(run_dir)
    last_moe = train_records[-1].get("moe") if train_records else None
    return {
        "expert_lr_mult": mult,
        "seed": seed,
        "final_val_loss": result["final_val_loss"],
        "final_loss": result.get("final_loss"),
        # worst layer's max/mean load over the last log interval: did the rate change balance?
        "final_max_mean": max(layer["max_mean"] for layer in last_moe) if last_moe else None,
        "seconds": time.perf_counter() - started,
        "run_dir": str(run_dir),
    }


def markdown_table(base: RunConfig, rows: list[dict[str, Any]], seeds: list[int]) -> str:
    def fmt(value: float | None, digits: int = 4) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}"

    header = (
        "| expert_lr_mult | rule | "
        + " | ".join(f"val loss seed {s}" for s in seeds)
        + " | mean val loss | std | max/mean load (worst layer, mean) |"
    )
    lines = [header, "|" + " --- |" * (len(seeds) + 5)]
    for label, mult in settings(base):
        runs = {r["seed"]: r for r in rows if r["expert_lr_mult"] == mult}
        losses = [runs[s]["final_val_loss"] for s in seeds if runs[s]["final_val_loss"] is not None]
        loads = [runs[s]["final_max_mean"] for s in seeds if runs[s]["final_max_mean"] is not None]
        cells = [fmt(runs[s]["final_val_loss"]) for s in seeds]
        mean = statistics.fmean(losses) if losses else None
        std = statistics.stdev(losses) if len(losses) > 1 else None
        load = statistics.fmean(loads) if loads else None
        lines.append(
            f"| {mult:.4g} | {label} | "
            + " | ".join(cells)
            + f" | {fmt(mean)} | {fmt(std)} | {fmt(load, 2)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    base = get_preset(args.preset).with_overrides(overrides)
    if not base.train.eval_every:
        raise SystemExit("train.eval_every is 0: the comparison needs a final validation loss")

    rows = []
    for label, mult in settings(base):
        for seed in args.seeds:
            run_dir = args.out / f"{base.name}-mult{mult:.4g}-seed{seed}"
            if run_dir.exists():
                if not args.overwrite:
                    raise SystemExit(f"{run_dir} exists (metrics would mix); pass --overwrite")
                shutil.rmtree(run_dir)
            print(f"training {base.name}, expert_lr_mult={mult:.4g} ({label}), seed {seed}")
            row = run_one(base, mult, seed, run_dir, args.device)
            print(f"  final val loss {row['final_val_loss']}, {row['seconds']:.0f} s")
            rows.append(row)

    t = base.train
    report = "\n".join(
        [
            f"## expert_lr_mult: {base.name}, {t.steps} steps, seeds {args.seeds}",
            "",
            f"{time.strftime('%Y-%m-%d')}, device {args.device or 'auto'}, "
            f"E={base.moe.num_experts}, top_k={base.moe.top_k}, lr={t.lr}, "
            f"micro_batch_size={t.micro_batch_size}, seq_len={t.seq_len}",
            "",
            f"`python benchmarks/expert_lr_experiment.py {shlex.join(argv)}`",
            "",
            markdown_table(base, rows, args.seeds),
            "",
        ]
    )
    print()
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "RESULTS.md").write_text(report)
    (args.out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
