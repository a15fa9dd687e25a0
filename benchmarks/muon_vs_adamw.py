"""Muon against AdamW on the same tokens: validation curves, each optimizer at its best of a few
learning rates, and the tokens each needs to reach AdamW's final validation loss.

    python benchmarks/muon_vs_adamw.py [--preset demo] [--steps N] [--eval-every 20]
        [--adamw-lrs 1.5e-3,3e-3,6e-3] [--muon-lrs 3e-3,6e-3,1.2e-2] [--set key=value ...]
        [--runs-dir DIR] [--json OUT.json] [--png OUT.png]
    python benchmarks/muon_vs_adamw.py --plot OUT.json --png OUT.png

Runs one after the other in this process (the default device: the CPU here). Every run trains
the preset from the same seed on the same batches (the loader depends on the seed, never on the
optimizer), evaluates the same validation windows every --eval-every steps, and differs only in
train.optimizer and train.lr. A finished run's curve is kept in --runs-dir (RUN/curve.json), so
an interrupted sweep resumes where it stopped. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moetrain.config.presets import get_preset
from moetrain.train.trainer import Trainer


def run(preset: str, optimizer: str, lr: float, args: argparse.Namespace) -> dict:
    run_dir = Path(args.runs_dir) / f"{optimizer}-lr{lr:g}"
    cached = run_dir / "curve.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    config = get_preset(preset).with_overrides(
        [
            *args.set,
            *([f"train.steps={args.steps}"] if args.steps else []),
            f"train.optimizer={optimizer}",
            f"train.lr={lr}",
            f"train.eval_every={args.eval_every}",
            "train.checkpoint_every=0",
        ]
    )
    trainer = Trainer(config, run_dir, progress=False, overwrite=True)
    trainer.train()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = {
        "preset": preset,
        "optimizer": optimizer,
        "lr": lr,
        "tokens_per_step": trainer.tokens_per_step,
        "steps": config.train.steps,
        "val": [(r["step"], r["val_loss"]) for r in records if r["kind"] == "eval"],
        "train": [(r["step"], r["loss"]) for r in records if r["kind"] == "train"],
    }
    cached.write_text(json.dumps(curve))
    return curve


def tokens_to_reach(curve: dict, target: float) -> float | None:
    """Tokens at which the validation curve first reaches `target`, interpolated linearly
    between evaluations; None if it never does."""
    previous = None
    for step, loss in curve["val"]:
        if loss <= target:
            if previous is None:
                return step * curve["tokens_per_step"]
            s0, l0 = previous
            frac = (l0 - target) / (l0 - loss)
            return (s0 + frac * (step - s0)) * curve["tokens_per_step"]
        previous = (step, loss)
    return None


def summarize(curves: list[dict]) -> dict:
    best = {}
    for curve in curves:
        name = curve["optimizer"]
        if name not in best or curve["val"][-1][1] < best[name]["val"][-1][1]:
            best[name] = curve
    target = best["adamw"]["val"][-1][1]
    return {
        "best": {name: c["lr"] for name, c in best.items()},
        "target": target,
        "tokens_to_target": {name: tokens_to_reach(c, target) for name, c in best.items()},
    }


def table(curves: list[dict], summary: dict) -> str:
    lines = [
        "| optimizer | lr | final val loss | final train loss | tokens to AdamW's final val loss |",
        "|---|---|---|---|---|",
    ]
    for c in curves:
        is_best = summary["best"][c["optimizer"]] == c["lr"]
        reach = tokens_to_reach(c, summary["target"])
        lines.append(
            f"| {c['optimizer']} | {c['lr']:g}{' (best)' if is_best else ''} | "
            f"{c['val'][-1][1]:.4f} | {c['train'][-1][1]:.4f} | "
            f"{'not reached' if reach is None else f'{reach:,.0f}'} |"
        )
    return "\n".join(lines)


def plot(curves: list[dict], summary: dict, png: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = {"adamw": "tab:blue", "muon": "tab:red"}
    for c in curves:
        is_best = summary["best"][c["optimizer"]] == c["lr"]
        tokens = [step * c["tokens_per_step"] / 1e6 for step, _ in c["val"]]
        ax.plot(
            tokens,
            [loss for _, loss in c["val"]],
            color=colors.get(c["optimizer"], "gray"),
            alpha=1.0 if is_best else 0.35,
            linewidth=2.0 if is_best else 1.0,
            marker="o" if is_best else None,
            markersize=3,
            label=f"{c['optimizer']} lr {c['lr']:g}{' (best)' if is_best else ''}",
        )
    ax.axhline(summary["target"], color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{curves[0]['preset']}: Muon vs AdamW on the same tokens")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.savefig(png, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--steps", type=int, default=None, help="default: the preset's")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--adamw-lrs", default="1.5e-3,3e-3,6e-3")
    parser.add_argument("--muon-lrs", default="3e-3,6e-3,1.2e-2")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--runs-dir", default="runs/muon_vs_adamw")
    parser.add_argument("--json", default=None, help="write every curve and the summary here")
    parser.add_argument("--png", default=None)
    parser.add_argument("--plot", metavar="JSON", help="only plot (and print) this --json file")
    args = parser.parse_args()
    if args.plot:
        curves = json.loads(Path(args.plot).read_text())["curves"]
    else:
        curves = [
            run(args.preset, optimizer, float(lr), args)
            for optimizer, lrs in (("adamw", args.adamw_lrs), ("muon", args.muon_lrs))
            for lr in lrs.split(",")
        ]
    summary = summarize(curves)
    if args.json:
        Path(args.json).write_text(json.dumps({"curves": curves, "summary": summary}, indent=1))
    if args.png:
        plot(curves, summary, args.png)
    print(table(curves, summary))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
