"""Loss curves of one preset under each expert-GEMM precision recipe, on the embedded corpus.

    python benchmarks/precision_curves.py --preset tiny --steps 300 [--device cpu]
        [--recipes bf16,fp8_rowwise,mxfp8,fp8_rowwise+fp8_dispatch] [--set key=value ...]

A recipe is a `precision.experts` value, optionally with "+fp8_dispatch" (precision.dispatch=fp8).
On CPU the FP8 and MXFP8 recipes run as emulations (quantize, dequantize, higher-precision math),
which reproduce their numerics, not their speed. Prints a markdown table of the final training
and validation losses and their difference to the unquantized run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from moetrain.presets import get_preset
from moetrain.train.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default=None)
    parser.add_argument("--recipes", default="bf16,fp8_rowwise,mxfp8,fp8_rowwise+fp8_dispatch")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    rows = []
    for recipe in args.recipes.split(","):
        experts, _, dispatch = recipe.partition("+")
        config = get_preset(args.preset).with_overrides(
            [
                *args.set,
                f"train.steps={args.steps}",
                f"precision.experts={experts}",
                f"precision.dispatch={'fp8' if dispatch == 'fp8_dispatch' else 'bf16'}",
                "train.log_every=25",
                f"train.eval_every={args.steps}",
                "train.checkpoint_every=0",
            ]
        )
        with tempfile.TemporaryDirectory() as run_dir:
            summary = Trainer(config, run_dir, device=args.device, progress=False).train()
            lines = [
                json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
            ]
        curve = [round(r["loss"], 3) for r in lines if r["kind"] == "train"]
        rows.append((recipe, summary["final_loss"], summary["final_val_loss"], curve))
        print(recipe, curve, flush=True)
    base = rows[0][2]
    print("\n| recipe | final train loss | final val loss | val vs unquantized |")
    print("|---|---|---|---|")
    for recipe, train, val, _ in rows:
        print(f"| {recipe} | {train:.4f} | {val:.4f} | {100 * (val / base - 1):+.2f}% |")


if __name__ == "__main__":
    main()
