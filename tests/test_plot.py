"""`moetrain plot`: charts from a synthetic metrics.jsonl (2 MoE layers, 4 experts)."""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from moetrain.tools.plot import _nested, add_plot_parser, plot_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir, num_steps=8, num_layers=2, num_experts=4):
    rng = np.random.default_rng(0)
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
                    "tokens_per_expert": counts.tolist(),
                }
            )
        lines.append(
            {
                "kind": "train",
                "step": step,
                "loss": 5.0 - 0.3 * i,
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
