"""`moetrain plot`: charts from a synthetic metrics.jsonl (2 MoE layers, 4 experts)."""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from moetrain.tools.plot import _nested, add_plot_parser, plot_run, plot_runs, run_figures

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir, num_steps=8, num_layers=2, num_experts=4, seed=0):
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(num_steps):
        step = 10 * (i + 1)
        moe = []
        for layer in range(num_layers):
            counts = rng.integers(0, 100, size=num_experts)
            counts[0] += 20 * i * layer  # layer 1 drifts towards expert 0
            moe.append(
                {
                    "layer": layer,
                    "max_mean": float(counts.max() / counts.mean()),
                    "max_mean_peak": float(counts.max() / counts.mean()) + 1.0 + rng.random(),
                    "tokens_per_expert": counts.tolist(),
                }
            )
        lines.append(
            {
                "kind": "train",
                "step": step,
                "loss": 5.0 - 0.3 * i + rng.random(),
                "lr": 1e-3 * min(1.0, (i + 1) / 3),
                "tokens_per_s": 1000.0 + 10 * i,
                "mfu": None,
                "moe": moe,
            }
        )
        if step % 40 == 0:
            tasks = {"qa": {"acc": 0.1 * i, "acc_norm": 0.2}}
            lines.append(
                {
                    "kind": "eval",
                    "step": step,
                    "val_loss": 5.1 - 0.3 * i,
                    "eval_sets": {"wiki": 6.0 - i},
                    "tasks": tasks,
                }
            )
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"kind": "train", "st'
    (run_dir / "metrics.jsonl").write_text(text)


def _assert_pngs(paths, names):
    assert sorted(p.name for p in paths) == sorted(names)
    for path in paths:
        data = path.read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_SIGNATURE)


def test_plot_run_writes_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    _write_run(tmp_path)
    paths = plot_run(tmp_path)
    assert all(p.parent == tmp_path / "plots" for p in paths)
    _assert_pngs(paths, ["loss.png", "tasks.png", "throughput.png", "lr.png", "expert_load.png"])
    # the curves drawn besides validation: each eval set's loss, each task's acc and acc_norm
    from moetrain.train.metrics_jsonl import read_metrics

    evals = read_metrics(tmp_path)[1]
    assert _nested(evals, "eval_sets") == {"wiki": ([40, 80], [3.0, -1.0])}
    tasks = _nested(evals, "tasks")
    assert tasks == {
        "qa/acc": ([40, 80], pytest.approx([0.3, 0.7])),
        "qa/acc_norm": ([40, 80], [0.2, 0.2]),
    }


def test_plot_without_moe_records_skips_expert_load(tmp_path):
    pytest.importorskip("matplotlib")
    record = {"kind": "train", "step": 1, "loss": 3.0, "lr": 1e-3, "tokens_per_s": 5.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    _assert_pngs(plot_run(tmp_path, tmp_path / "out"), ["loss.png", "throughput.png", "lr.png"])


def test_plot_cli(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _write_run(tmp_path)
    parser = argparse.ArgumentParser(prog="moetrain")
    add_plot_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plot", str(tmp_path), "--out", str(tmp_path / "charts")])
    assert args.run_dirs == [tmp_path]
    assert args.func(args) == 0
    printed = capsys.readouterr().out.split()
    assert len(printed) == 5
    assert all(Path(p).parent == tmp_path / "charts" and Path(p).is_file() for p in printed)


def test_plot_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="no metrics file"):
        plot_run(tmp_path)
    _write_run(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now fails
    with pytest.raises(ValueError, match="pip install matplotlib"):
        plot_run(tmp_path)


def _curves(ax) -> dict[str, tuple[list, list]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}


def test_plot_overlays_runs_each_labelled_by_its_name(tmp_path):
    """Two runs share each chart's axes: every curve carries its run's name and that run's
    numbers, one colour per run; the expert-load chart draws each record's max_mean_peak
    beside the interval's max/mean."""
    pytest.importorskip("matplotlib")
    from moetrain.train.metrics_jsonl import read_metrics

    runs = [tmp_path / "dense-lr", tmp_path / "moe-lr"]
    for seed, run in enumerate(runs):
        run.mkdir()
        _write_run(run, num_steps=4 + 4 * seed, seed=seed)
    figures = run_figures(runs)
    assert sorted(figures) == [
        "expert_load.png",
        "loss.png",
        "lr.png",
        "tasks.png",
        "throughput.png",
    ]
    loss = _curves(figures["loss.png"].axes[0])
    colours = {line.get_label(): line.get_color() for line in figures["loss.png"].axes[0].lines}
    load_axes = figures["expert_load.png"].axes
    for run in runs:
        train, evals = read_metrics(run)
        name = run.name
        assert loss[f"{name} train"] == ([r["step"] for r in train], [r["loss"] for r in train])
        assert loss[f"{name} validation"][1] == [r["val_loss"] for r in evals]
        assert colours[f"{name} train"] == colours[f"{name} validation"] == colours[f"{name} wiki"]
        assert _curves(figures["lr.png"].axes[0])[name][1] == [r["lr"] for r in train]
        assert f"{name} qa/acc" in _curves(figures["tasks.png"].axes[0])
        for layer, ax in enumerate(load_axes):
            moe = [r["moe"][layer] for r in train]
            curves = _curves(ax)
            assert curves[name][1] == pytest.approx([m["max_mean"] for m in moe])
            assert curves[f"{name} step peak"][1] == [m["max_mean_peak"] for m in moe]
    assert colours["dense-lr train"] != colours["moe-lr train"]
    _assert_pngs(plot_runs(runs, tmp_path / "both"), list(figures))
    with pytest.raises(ValueError, match="needs --out DIR"):
        plot_runs(runs)


def test_one_runs_expert_load_shows_the_step_peak(tmp_path):
    pytest.importorskip("matplotlib")
    from moetrain.train.metrics_jsonl import read_metrics

    _write_run(tmp_path)
    train = read_metrics(tmp_path)[0]
    curves = _curves(run_figures([tmp_path])["expert_load.png"].axes[2])  # under 2 heatmaps
    for layer in range(2):
        moe = [r["moe"][layer] for r in train]
        assert curves[f"layer {layer}"][1] == pytest.approx([m["max_mean"] for m in moe])
        assert curves[f"layer {layer} step peak"][1] == [m["max_mean_peak"] for m in moe]
