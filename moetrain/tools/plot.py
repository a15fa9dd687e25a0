"""`moetrain plot RUN_DIR [RUN_DIR ...]`: PNG charts of runs from their metrics.jsonl.

Charts: loss.png (train, validation, per-source and evaluation-set losses), tasks.png (task
accuracies), throughput.png, lr.png, and for MoE runs expert_load.png: for one run, per layer a
heatmap of each expert's share of the routes at every log step under curves of max/mean load
(the interval's, and its worst step's `max_mean_peak` where recorded); for several runs, per
layer each run's max/mean curves. Several runs share each chart's axes, one colour and its name
per run. matplotlib is optional (the `plot` extra); figures use its Agg canvas without pyplot
(no global state).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moetrain.train.metrics_jsonl import read_metrics


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the charts of `run_dir` into `out_dir` (default RUN_DIR/plots); return their paths."""
    return plot_runs([run_dir], out_dir)


def plot_runs(run_dirs: Sequence[str | Path], out_dir: str | Path | None = None) -> list[Path]:
    """Write the charts of one run, or of several overlaid on the same axes (each curve labelled
    by its run's name), into `out_dir` (one run: default RUN_DIR/plots; several need it);
    return their paths."""
    figures = run_figures(run_dirs)
    if out_dir is None and len(run_dirs) > 1:
        raise ValueError(f"plotting {len(run_dirs)} runs together needs --out DIR")
    out = Path(out_dir) if out_dir is not None else Path(run_dirs[0]) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in figures.items():
        fig.savefig(out / name, dpi=120)
        written.append(out / name)
    return written


def run_figures(run_dirs: Sequence[str | Path]) -> dict[str, Any]:
    """{file name: matplotlib Figure} of the runs' charts: loss, tasks (if any run has tasks),
    throughput, lr, expert_load (if any run is MoE). One run's curves take matplotlib's colour
    cycle; with several runs each run has one colour and its name in every label."""
    runs = {}
    for run_dir in map(Path, run_dirs):
        train, evals = read_metrics(run_dir)
        if not train and not evals:
            raise ValueError(f"{run_dir} has no train or eval records to plot")
        runs[_run_label(run_dir, run_dirs)] = (train, evals)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError(
            "plotting needs matplotlib: pip install matplotlib (or pip install 'moetrain[plot]')"
        ) from None

    def new_axes(what: str, ylabel: str, **kwargs: Any) -> Any:
        fig = Figure(figsize=(7, 3.5), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ax.set(xlabel="step", ylabel=ylabel, title=f"{', '.join(runs)}: {what}", **kwargs)
        return fig, ax

    several = len(runs) > 1
    styles = {
        name: ({"color": f"C{i}"}, f"{name} " if several else "") for i, name in enumerate(runs)
    }
    figures: dict[str, Any] = {}
    fig, ax = new_axes("loss", "loss")
    for name, (train, evals) in runs.items():
        color, prefix = styles[name]
        _line(ax, train, "loss", label=prefix + "train", **color)
        _line(ax, evals, "val_loss", label=prefix + "validation", marker="o", **color)
        for group, kind in (("val_loss_per_source", "validation: "), ("eval_sets", "")):
            for curve, points in _nested(evals, group).items():
                label = prefix + kind + curve
                ax.plot(*points, label=label, marker=".", linestyle="--", **color)
    ax.legend()
    figures["loss.png"] = fig

    if any(_nested(evals, "tasks") for _, evals in runs.values()):
        fig, ax = new_axes("tasks", "accuracy", ylim=(0, 1))
        for name, (_, evals) in runs.items():
            color, prefix = styles[name]
            for curve, points in _nested(evals, "tasks").items():
                ax.plot(*points, label=prefix + curve, marker="o", **color)
        ax.legend()
        figures["tasks.png"] = fig

    for key, file_name, ylabel in (
        ("tokens_per_s", "throughput.png", "tokens/s"),
        ("lr", "lr.png", "lr"),
    ):
        fig, ax = new_axes(ylabel, ylabel)
        for name, (train, _) in runs.items():
            _line(ax, train, key, label=name, **styles[name][0])
        if several:
            ax.legend()
        figures[file_name] = fig

    loads = {name: _expert_loads(train) for name, (train, _) in runs.items()}
    loads = {name: layers for name, layers in loads.items() if layers}
    if loads and several:
        figures["expert_load.png"] = _load_curves_figure(Figure, FigureCanvasAgg, loads)
    elif loads:
        ((name, layers),) = loads.items()
        fig = Figure(figsize=(7, 1.8 * len(layers) + 2.5), layout="constrained")
        FigureCanvasAgg(fig)
        figures["expert_load.png"] = _expert_load_figure(fig, layers, name)
    return figures


def _run_label(run_dir: Path, run_dirs: Sequence[str | Path]) -> str:
    """The run's directory name, or its path where two runs share a name."""
    names = [Path(d).name for d in run_dirs]
    return str(run_dir) if names.count(run_dir.name) > 1 else run_dir.name


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


def _expert_loads(
    train: list[dict[str, Any]],
) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """layer -> (steps_N, share_NE, peak_N): each expert's share of the layer's routes at each
    log step, and the record's max_mean_peak (the worst step's max/mean; NaN where absent)."""
    per_layer: dict[int, tuple[list[int], list[np.ndarray], list[float]]] = {}
    for record in train:
        for moe in record.get("moe") or ():
            counts = np.asarray(moe["tokens_per_expert"], dtype=np.float64)
            total = counts.sum()
            share = counts / total if total > 0 else np.full_like(counts, np.nan)
            steps, shares, peaks = per_layer.setdefault(int(moe["layer"]), ([], [], []))
            steps.append(int(record["step"]))
            shares.append(share)
            peak = moe.get("max_mean_peak")
            peaks.append(float(peak) if isinstance(peak, int | float) else np.nan)
    return {
        layer: (np.asarray(steps), np.stack(shares), np.asarray(peaks))
        for layer, (steps, shares, peaks) in sorted(per_layer.items())
    }


def _max_mean(share_NE: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return share_NE.max(axis=1) * share_NE.shape[1]  # max / mean == max share * E


def _load_lines(
    ax: Any, steps: np.ndarray, share_NE: np.ndarray, peak_N: np.ndarray, label: str, **kwargs: Any
) -> None:
    """The interval's max/mean load (solid) and, where recorded, its worst step's (dashed)."""
    (line,) = ax.plot(steps, _max_mean(share_NE), label=label, **kwargs)
    if np.isfinite(peak_N).any():
        ax.plot(steps, peak_N, label=f"{label} step peak", linestyle="--", color=line.get_color())


def _step_edges(steps: np.ndarray) -> np.ndarray:
    """Cell edges for a heatmap column per log step: midpoints between steps, padded at the ends."""
    if len(steps) == 1:
        return np.array([steps[0] - 0.5, steps[0] + 0.5])
    mid = (steps[:-1] + steps[1:]) / 2
    return np.concatenate([[2 * steps[0] - mid[0]], mid, [2 * steps[-1] - mid[-1]]])


def _expert_load_figure(
    fig: Any, loads: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]], title: str
) -> Any:
    """One run's expert load: per layer a heatmap of the experts' shares, under them the
    max/mean load of every layer."""
    num_layers = len(loads)
    axes = fig.subplots(num_layers + 1, 1, sharex=True, height_ratios=[1.0] * num_layers + [1.2])
    finite = [share[np.isfinite(share)] for _, share, _ in loads.values()]
    vmax = max((float(v.max()) for v in finite if v.size), default=1.0)  # one scale for all layers
    mesh = None
    for ax, (layer, (steps, share_NE, _)) in zip(axes[:-1], loads.items(), strict=False):
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
    for layer, (steps, share_NE, peak_N) in loads.items():
        _load_lines(ax, steps, share_NE, peak_N, f"layer {layer}")
    ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax.set(xlabel="step", ylabel="max / mean load")
    ax.legend(fontsize=7, ncols=min(num_layers, 4))
    fig.suptitle(f"{title}: expert load")
    return fig


def _load_curves_figure(
    figure: Any, canvas: Any, loads: dict[str, dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]]
) -> Any:
    """Several runs' expert load: per layer an axes of each run's max/mean load curves."""
    layers = sorted({layer for run in loads.values() for layer in run})
    fig = figure(figsize=(7, 2.2 * len(layers) + 1), layout="constrained")
    canvas(fig)
    axes = np.atleast_1d(fig.subplots(len(layers), 1, sharex=True))
    for ax, layer in zip(axes, layers, strict=True):
        for i, (name, run) in enumerate(loads.items()):
            if layer in run:
                _load_lines(ax, *run[layer], name, color=f"C{i}")
        ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
        ax.set(ylabel=f"layer {layer}\nmax / mean load")
        ax.legend(fontsize=7)
    axes[-1].set(xlabel="step")
    fig.suptitle(f"{', '.join(loads)}: expert load")
    return fig


def add_plot_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `plot RUN_DIR [RUN_DIR ...] [--out DIR]`; the handler is set as the `func`
    default."""
    parser = subparsers.add_parser(
        "plot",
        help="draw PNG charts of a run, or of several overlaid (loss, tasks, throughput, lr, "
        "expert load)",
        description="Draw PNG charts of runs from RUN_DIR/metrics.jsonl (needs matplotlib); "
        "several runs are overlaid on the same axes, each labelled by its name.",
    )
    parser.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="output folder (one run: RUN_DIR/plots; several runs need it)",
    )
    parser.set_defaults(func=plot_command)
    return parser


def plot_command(args: argparse.Namespace) -> int:
    """The `moetrain plot` handler. User errors (no matplotlib, no metrics) raise ValueError."""
    for path in plot_runs(args.run_dirs, args.out):
        print(path)
    return 0
