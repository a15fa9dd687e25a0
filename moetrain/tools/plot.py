"""`moetrain plot RUN_DIR`: PNG charts of a run from its metrics.jsonl.

Charts: loss.png (train, validation, per-source and evaluation-set losses), tasks.png (task
accuracies), throughput.png, lr.png, and for MoE runs expert_load.png: per layer a heatmap of
each expert's share of the routes at every log step under a curve of max/mean load. matplotlib
is optional (the `plot` extra); figures use its Agg canvas without pyplot (no global state).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from moetrain.train.metrics_jsonl import read_metrics


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the charts of `run_dir` into `out_dir` (default RUN_DIR/plots); return their paths."""
    run_dir = Path(run_dir)
    train, evals = read_metrics(run_dir)
    if not train and not evals:
        raise ValueError(f"{run_dir} has no train or eval records to plot")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError(
            "plotting needs matplotlib: pip install matplotlib (or pip install 'moetrain[plot]')"
        ) from None

    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)

    def new_figure(height: float = 3.5) -> Any:
        fig = Figure(figsize=(7, height), layout="constrained")
        FigureCanvasAgg(fig)
        return fig

    def save(fig: Any, name: str) -> Path:
        path = out / name
        fig.savefig(path, dpi=120)
        return path

    written = []
    fig = new_figure()
    ax = fig.add_subplot()
    _line(ax, train, "loss", label="train")
    _line(ax, evals, "val_loss", label="validation", marker="o")
    for group, prefix in (("val_loss_per_source", "validation: "), ("eval_sets", "")):
        for name, points in _nested(evals, group).items():
            ax.plot(*points, label=prefix + name, marker=".", linestyle="--")
    ax.set(xlabel="step", ylabel="loss", title=f"{run_dir.name}: loss")
    ax.legend()
    written.append(save(fig, "loss.png"))

    tasks = _nested(evals, "tasks")
    if tasks:
        fig = new_figure()
        ax = fig.add_subplot()
        for name, points in tasks.items():
            ax.plot(*points, label=name, marker="o")
        ax.set(xlabel="step", ylabel="accuracy", title=f"{run_dir.name}: tasks", ylim=(0, 1))
        ax.legend()
        written.append(save(fig, "tasks.png"))

    for key, name, ylabel in (
        ("tokens_per_s", "throughput.png", "tokens/s"),
        ("lr", "lr.png", "lr"),
    ):
        fig = new_figure()
        ax = fig.add_subplot()
        _line(ax, train, key)
        ax.set(xlabel="step", ylabel=ylabel, title=f"{run_dir.name}: {ylabel}")
        written.append(save(fig, name))

    loads = _expert_loads(train)
    if loads:
        written.append(
            save(_expert_load_figure(new_figure, loads, run_dir.name), "expert_load.png")
        )
    return written


def _line(ax: Any, records: list[dict[str, Any]], key: str, **kwargs: Any) -> None:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float)]
    if points:
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, **kwargs)


def _nested(records: list[dict[str, Any]], group: str) -> dict[str, tuple[list, list]]:
    """name -> (steps, values) of a record's mapping `group`: {name: float} curves (a mix's
    sources, eval sets), or {task: {"acc": float, ...}} curves named "task/acc"."""
    curves: dict[str, tuple[list, list]] = {}
    for record in records:
        for name, value in (record.get(group) or {}).items():
            items = value.items() if isinstance(value, dict) else [(None, value)]
            for key, number in items:
                if isinstance(number, int | float):
                    steps, values = curves.setdefault(
                        name if key is None else f"{name}/{key}", ([], [])
                    )
                    steps.append(record["step"])
                    values.append(number)
    return curves


def _expert_loads(train: list[dict[str, Any]]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """layer -> (steps_N, share_NE): each expert's share of the layer's routes at each log step."""
    per_layer: dict[int, tuple[list[int], list[np.ndarray]]] = {}
    for record in train:
        for moe in record.get("moe") or ():
            counts = np.asarray(moe["tokens_per_expert"], dtype=np.float64)
            total = counts.sum()
            share = counts / total if total > 0 else np.full_like(counts, np.nan)
            steps, shares = per_layer.setdefault(int(moe["layer"]), ([], []))
            steps.append(int(record["step"]))
            shares.append(share)
    return {
        layer: (np.asarray(steps), np.stack(shares))
        for layer, (steps, shares) in sorted(per_layer.items())
    }


def _step_edges(steps: np.ndarray) -> np.ndarray:
    """Cell edges for a heatmap column per log step: midpoints between steps, padded at the ends."""
    if len(steps) == 1:
        return np.array([steps[0] - 0.5, steps[0] + 0.5])
    mid = (steps[:-1] + steps[1:]) / 2
    return np.concatenate([[2 * steps[0] - mid[0]], mid, [2 * steps[-1] - mid[-1]]])


def _expert_load_figure(
    new_figure: Any, loads: dict[int, tuple[np.ndarray, np.ndarray]], title: str
) -> Any:
    num_layers = len(loads)
    fig = new_figure(height=1.8 * num_layers + 2.5)
    axes = fig.subplots(num_layers + 1, 1, sharex=True, height_ratios=[1.0] * num_layers + [1.2])
    finite = [share[np.isfinite(share)] for _, share in loads.values()]
    vmax = max((float(v.max()) for v in finite if v.size), default=1.0)  # one scale for all layers
    mesh = None
    for ax, (layer, (steps, share_NE)) in zip(axes[:-1], loads.items(), strict=False):
        num_experts = share_NE.shape[1]
        mesh = ax.pcolormesh(
            _step_edges(steps.astype(np.float64)),
            np.arange(num_experts + 1) - 0.5,
            share_NE.T,
            vmin=0.0,
            vmax=vmax,
            cmap="viridis",
            shading="flat",
        )
        ax.set_ylabel(f"layer {layer}\nexpert")
        ax.set_title(f"share of routes per expert (balanced = 1/{num_experts})", fontsize=9)
    fig.colorbar(mesh, ax=axes[:-1], label="share of routes")

    ax = axes[-1]
    for layer, (steps, share_NE) in loads.items():
        with np.errstate(invalid="ignore"):
            max_mean = share_NE.max(axis=1) * share_NE.shape[1]  # max / mean == max share * E
        ax.plot(steps, max_mean, label=f"layer {layer}")
    ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax.set(xlabel="step", ylabel="max / mean load")
    ax.legend(fontsize=7, ncols=min(num_layers, 4))
    fig.suptitle(f"{title}: expert load")
    return fig


def add_plot_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `plot RUN_DIR [--out DIR]`; the handler is set as the `func` default."""
    parser = subparsers.add_parser(
        "plot",
        help="draw PNG charts of a run (loss, tasks, throughput, lr, expert load)",
        description="Draw PNG charts of a run from RUN_DIR/metrics.jsonl (needs matplotlib).",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    parser.add_argument(
        "--out", type=Path, default=None, metavar="DIR", help="output folder (RUN_DIR/plots)"
    )
    parser.set_defaults(func=plot_command)
    return parser


def plot_command(args: argparse.Namespace) -> int:
    """The `moetrain plot` handler. User errors (no matplotlib, no metrics) raise ValueError."""
    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0
