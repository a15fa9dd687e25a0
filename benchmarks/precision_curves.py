"""Loss curves of one preset under each expert-GEMM precision recipe, on the embedded corpus.

    python benchmarks/precision_curves.py --preset tiny --steps 300 [--device cpu]
        [--recipes bf16,fp8_rowwise,mxfp8,fp8_rowwise+fp8_dispatch] [--set key=value ...]
        [--json OUT.json]
    python benchmarks/precision_curves.py --plot A.json B.json ... --png OUT.png

A recipe is a `precision.experts` value, optionally with any of "+fp8_dispatch"
(precision.dispatch=fp8), "+fp8_linear" (precision.linear=fp8_rowwise), and "+fp8_head"
(precision.lm_head=fp8_rowwise).
On CPU the FP8 and MXFP8 recipes run as emulations (quantize, dequantize, higher-precision math),
which reproduce their numerics, not their speed. Prints a markdown table of the final training
and validation losses and their difference to the unquantized run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from moetrain.config.presets import get_preset
from moetrain.train.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default=None)
    parser.add_argument("--recipes", default="bf16,fp8_rowwise,mxfp8,fp8_rowwise+fp8_dispatch")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--json", help="also write the curves (step, loss) and final losses here")
    parser.add_argument("--plot", nargs="+", metavar="JSON", help="plot these --json files")
    parser.add_argument("--png", default="precision_curves.png")
    args = parser.parse_args()
    if args.plot:
        plot(args.plot, args.png)
        return
    rows = []
    for recipe in args.recipes.split(","):
        experts, *extras = recipe.split("+")
        config = get_preset(args.preset).with_overrides(
            [
                *args.set,
                f"train.steps={args.steps}",
                f"precision.experts={experts}",
                f"precision.dispatch={'fp8' if 'fp8_dispatch' in extras else 'bf16'}",
                f"precision.linear={'fp8_rowwise' if 'fp8_linear' in extras else 'bf16'}",
                f"precision.lm_head={'fp8_rowwise' if 'fp8_head' in extras else 'bf16'}",
                f"train.log_every={args.log_every}",
                f"train.eval_every={args.steps}",
                "train.checkpoint_every=0",
            ]
        )
        with tempfile.TemporaryDirectory() as run_dir:
            summary = Trainer(config, run_dir, device=args.device, progress=False).train()
            lines = [
                json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
            ]
        curve = [(r["step"], round(r["loss"], 4)) for r in lines if r["kind"] == "train"]
        rows.append((recipe, summary["final_loss"], summary["final_val_loss"], curve))
        print(recipe, [loss for _, loss in curve], flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"preset": args.preset, "runs": rows}))
    base = rows[0][2]
    print("\n| recipe | final train loss | final val loss | val vs unquantized |")
    print("|---|---|---|---|")
    for recipe, train, val, _ in rows:
        print(f"| {recipe} | {train:.4f} | {val:.4f} | {100 * (val / base - 1):+.2f}% |")


def plot(paths: list[str], png: str) -> None:
    """Training loss against step, one panel per preset, one line per recipe; the legend gives
    each run's final validation loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[str, list] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        runs.setdefault(data["preset"], []).extend(data["runs"])
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, (preset, rows) in zip(axes[0], runs.items(), strict=True):
        for recipe, _, val, curve in rows:
            steps, losses = zip(*curve, strict=True)
            ax.plot(steps, losses, label=f"{recipe} (val {val:.4f})", linewidth=1)
        ax.set(title=preset, xlabel="step", ylabel="training loss")
        ax.set_ylim(
            top=min(ax.get_ylim()[1], 2 * min(min(r[3], key=lambda c: c[1])[1] for r in rows))
        )
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
