"""The 8-GPU projection's measurement side: the depth extrapolation, the reference-shaped preset, the calibration file and the planner's use of it,
and `moetrain bench --project` end to end on the CPU (timings meaningless there)."""

import argparse
import dataclasses
import json

import pytest

from moetrain.cli import main
from moetrain.config.presets import get_preset
from moetrain.model.flops import param_counts
from moetrain.tools import plan as P
from moetrain.tools.bench.measure_rank import extrapolate
from moetrain.tools.bench.timing import steady_rate, sustained_matmul
from moetrain.tools.plan import calibration as cal
from moetrain.tools.plan.links import Links
from moetrain.tools.plan.rank_compute import FSDP, RESIDENT, rank_experts

LINKS = Links(nvlink_gbps=450, internode_gbps=50, latency_us=0)


def test_layer_extrapolation_and_bad_layouts():
    assert extrapolate((1, 2), [5.0, 7.0], 16) == pytest.approx(35.0)
    assert extrapolate((16,), [3.0], 16) == 3.0
    with pytest.raises(ValueError, match="must be the model"):
        extrapolate((4,), [3.0], 16)
    with pytest.raises(ValueError, match="must divide moe.num_experts"):
        rank_experts(get_preset("small"), 3, fsdp=False)


def test_reference_shaped_preset_and_the_scale_series():
    ref = param_counts(get_preset("ref-47b"))
    assert abs(ref.total / 47e9 - 1) < 0.02
    assert abs((ref.active + ref.embedding) / 3.2e9 - 1) < 0.02  # the reference counts it
    with8 = get_preset("ref-47b").with_overrides(["moe.num_experts=8"])
    assert abs(param_counts(with8).total / 4.6e9 - 1) < 0.02
    e8, e128 = (param_counts(get_preset(f"scale-E{e}")) for e in (8, 128))
    assert e8.active == pytest.approx(e128.active, rel=0.01)
    assert 9 < e128.total / e8.total < 12  # the reference: 4.6B -> 47B, 10.2x
    assert get_preset("scale-E8").moe.top_k == get_preset("scale-E128").moe.top_k == 4


def test_sustained_rate_arithmetic_and_cpu():
    overall, late = steady_rate(10.0, [1.0, 1.0, 2.0, 2.0])  # 10 units a chunk, ms
    assert overall == pytest.approx(40 / 6e-3)
    assert late == pytest.approx(10 / 2e-3)
    import torch

    assert sustained_matmul(torch.device("cpu")) is None


def _calibration(**shapes):
    return cal.Calibration(
        gpu="h200",
        device_name="hand-written",
        date="2026-12-03",
        matmul_tflops=800.0,
        sustained_tflops=640.0,
        hbm_tbps=4.0,
        shapes={k: cal.ShapeRates(*v) for k, v in shapes.items()},
    )


def test_calibration_round_trip_and_use(tmp_path):
    written = _calibration(small=(600.0, 500.0, 400.0, 0.5), olmoe8=(700.0, 600.0, 300.0, 0.7))
    path = cal.save(written, tmp_path / "c.json")
    read = cal.load(path)
    assert read == written
    cluster = P.Cluster(gpu=P.GPUS["h200"], num_gpus=1)
    small = cal.calibrated_cluster(cluster, read, "small")
    assert small.matmul_efficiency == pytest.approx(600 * 0.8 / 989)  # x sustained / short
    assert small.grouped_efficiency == pytest.approx(500 * 0.8 / 989)
    assert small.attention_efficiency == pytest.approx(400 * 0.8 / 989)
    assert small.hbm_bps == 4e12 and small.activation_factor == 0.5
    other = cal.calibrated_cluster(cluster, read, "scale-E8")  # the median of the entries
    assert other.matmul_efficiency == pytest.approx(650 * 0.8 / 989)
    with pytest.raises(ValueError, match="measured on h200"):
        cal.calibrated_cluster(P.Cluster(gpu=P.GPUS["b300"], num_gpus=1), read, "small")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="calibration file"):
        cal.load(tmp_path / "bad.json")

    # the planner's time and memory follow: halving every rate doubles the products' time
    config = get_preset("small")
    layout = P.Layout(pp=1, dp=1, ep=1, micro_batch_size=8)
    tokens = 8 * 2048
    base = P.estimate(config, small, layout, tokens)
    halved = dataclasses.replace(
        small,
        matmul_efficiency=small.matmul_efficiency / 2,
        grouped_efficiency=small.grouped_efficiency / 2,
        attention_efficiency=small.attention_efficiency / 2,
    )
    assert P.estimate(config, halved, layout, tokens).matmul_s == pytest.approx(2 * base.matmul_s)
    uncalibrated = P.estimate(config, cluster, layout, tokens)
    assert base.peak_stage.memory.activations == pytest.approx(
        0.5 * uncalibrated.peak_stage.memory.activations, abs=1
    )


def _plan(argv):
    parser = argparse.ArgumentParser()
    P.add_plan_parser(parser.add_subparsers(dest="command"))
    return P.run_plan(parser.parse_args(["plan", *argv]))


def test_plan_reads_the_calibration_file_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    argv = ["--preset", "small", "--gpus", "1", "--json"]
    assert _plan(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["calibration"] is None
    cal.save(_calibration(small=(300.0, 250.0, 200.0, 0.5)), cal.default_path("h200"))
    assert _plan(argv) == 0
    calibrated = json.loads(capsys.readouterr().out)
    assert "calibration-h200.json" in calibrated["calibration"]
    calibrated_best, plain_best = calibrated["best"], plain["best"]
    assert calibrated_best["overrides"] == plain_best["overrides"]  # the same row, slower, smaller
    assert calibrated_best["step_s"] > plain_best["step_s"]
    assert calibrated_best["peak_gib"] < plain_best["peak_gib"]
    assert _plan([*argv, "--no-calibration"]) == 0
    assert json.loads(capsys.readouterr().out)["calibration"] is None
    assert _plan(["--preset", "small", "--gpus", "1"]) == 0
    assert "calibrated: " in capsys.readouterr().out
    assert _plan([*argv, "--calibration", str(tmp_path / "none.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_bench_project_runs_end_to_end_on_cpu(tmp_path, capsys):
    """tiny on 4 'GPUs': two rank models (2 experts a layer; all 8) timed on the CPU, the
    dispatcher's costs, every variant projected on the 'measuring' GPU's and the B300's links,
    written to --out (timings meaningless on the CPU)."""
    argv = [
        "bench",
        "--project",
        "--project-presets",
        "tiny",
        "--gpus",
        "4",
        "--expert-load",
        "1.5",
    ]
    assert main([*argv, "--steps", "1", "--warmup", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| resident | 4 x h200 | pp 1, dp 4, ep 4 |" in out and "| fsdp2 | 4 x b300 |" in out
    assert "1.5 x T K rows" in out and "reference fsdp2" in out and "| 2.5 |" in out
    record = json.loads((tmp_path / "projection.json").read_text())["presets"]["tiny"]
    assert set(record["measurements"]) == {
        "tiny 2 experts/layer",
        "tiny 8 experts/layer",
        "dispatcher",
    }
    for gpu in ("h200", "b300"):
        best = record["rows"][gpu]["best"]
        assert set(best) == {v.name for v in (*RESIDENT, *FSDP) if not v.hsdp}
        assert all(row["pp"] == 1 and row["tokens_per_s_per_gpu"] > 0 for row in best.values())
    assert (tmp_path / "report.md").read_text().count("| resident |") == 2


def test_a_deep_model_is_timed_at_two_depths_and_extrapolated():
    from moetrain.tools.bench.measure_rank import measure_rank

    config = get_preset("tiny").with_overrides(["model.num_layers=4"])
    measured, runs = measure_rank(config, 2, depths=(1, 2), steps=1, warmup=1, device="cpu")
    assert measured.depths == (1, 2) and len(runs) == 2
    t1, t2 = (r.stats["median_ms"] / 1e3 for r in runs)
    assert measured.forward_backward_s == pytest.approx(t1 + 3 * (t2 - t1))


def test_calibration_check_plans_and_times_a_preset_on_cpu():
    from moetrain.tools.bench.calibrate import CHECK_HEADER, check

    result = check(get_preset("tiny"), _calibration(), steps=1, warmup=1, device="cpu")
    assert result.preset == "tiny" and result.predicted_ms > 0 and result.measured_ms > 0
    assert result.floor_ms > 0 and result.row().startswith("| tiny |")
    assert CHECK_HEADER.count("|---") == 9
