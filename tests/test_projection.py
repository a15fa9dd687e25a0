"""The 8-GPU projection: its communication and state arithmetic by hand, the depth
extrapolation, the reference-shaped preset, the calibration file and the planner's use of it,
and `moetrain bench --project` end to end on the CPU (timings meaningless there)."""

import argparse
import dataclasses
import json

import pytest

from moetrain import plan as P
from moetrain.bench.timing import steady_rate, sustained_matmul
from moetrain.cli import main
from moetrain.model.flops import param_counts
from moetrain.plan import calibration as cal
from moetrain.plan import compare as J
from moetrain.plan.links import Links
from moetrain.presets import get_preset

LINKS = Links(nvlink_gbps=450, internode_gbps=50, latency_us=0)


def test_ep_communication_by_hand():
    config = get_preset("olmoe-1b-7b")  # T = 4 x 4096, K = 8, D = 2048, 16 MoE layers
    T, K, D, L = 4 * 4096, 8, 2048, 16
    terms = {t.name: t for t in J.comm_terms(config, "ep-replicated", 8, LINKS)}
    # four exchanges of T K D bf16 values a layer, 7/8 of each over NVLink
    a2a = 4 * L * T * K * D * 2 * 7 / 8 / 450e9
    assert terms["all-to-alls"].seconds == pytest.approx(a2a)
    assert terms["all-to-alls"].hidden_by == "none"
    # the dense gradients all-reduced in fp32 over 8; experts have one replica each at ep 8
    dense = param_counts(config).dense
    assert terms["gradient all-reduce"].seconds == pytest.approx(2 * 7 / 8 * 4 * dense / 450e9)
    sharded = {t.name: t for t in J.comm_terms(config, "ep-sharded", 8, LINKS)}
    assert sharded["gradient reduce-scatter"].seconds == pytest.approx(7 / 8 * 4 * dense / 450e9)
    assert sharded["parameter all-gather"].seconds == pytest.approx(7 / 8 * 2 * dense / 450e9)
    # two micro-batches: twice the exchanges, the same gradient sync
    two = {t.name: t for t in J.comm_terms(config, "ep-replicated", 8, LINKS, microbatches=2)}
    assert two["all-to-alls"].seconds == pytest.approx(2 * a2a)
    assert two["gradient all-reduce"].seconds == terms["gradient all-reduce"].seconds


def test_fsdp2_communication_by_hand():
    config = get_preset("ref-47b")
    lp = P.layer_params(config)
    terms = {t.name: t.seconds for t in J.comm_terms(config, "fsdp2", 8, LINKS)}
    gather = 20 * lp.moe_layer.total * 2 * 7 / 8 / 450e9  # bf16 blocks, 20 layers
    assert terms["forward all-gathers"] == pytest.approx(gather)
    assert terms["backward all-gathers"] == pytest.approx(gather)
    assert terms["gradient reduce-scatters"] == pytest.approx(gather)  # bf16 gradients
    assert terms["root all-gather (first, exposed)"] == pytest.approx(
        lp.outside.total * 2 * 7 / 8 / 450e9
    )


def test_overlap_and_state_of_the_projection():
    config = get_preset("olmoe-1b-7b")
    measured = J.RankCompute(forward_backward_s=0.3, optimizer_s=0.03, peak_bytes=40 * P.GIB)
    rep = J.project(config, "ep-replicated", 8, measured, LINKS)
    comm = {t.name: t.seconds for t in rep.comm}
    assert rep.compute_s == pytest.approx(0.33)
    assert rep.no_overlap_s == pytest.approx(0.33 + sum(comm.values()))
    # the all-reduce hides in the backward (0.2 s), the all-to-alls do not
    assert rep.overlapped_s == pytest.approx(0.33 + comm["all-to-alls"])
    b = P.precision_bytes(config)
    dense, experts = J.rank_model_params(config, 8)
    ep_saved = 16 * 2 * 4 * 4096 * 8 * 2048  # the EP combine keeps a T K D a layer
    assert rep.peak_bytes == pytest.approx(40 * P.GIB + 4 * (dense + experts) + ep_saved)
    # sharded: the update covers 1/8 of the dense parameters and every local expert
    sh = J.project(config, "ep-sharded", 8, measured, LINKS)
    share = (dense / 8 + experts) / (dense + experts)
    assert sh.compute_s == pytest.approx(0.3 + 0.03 * share)
    assert sh.peak_bytes < rep.peak_bytes
    # FSDP2: 1/8 of the update and of the state, plus two gathered blocks
    fs = J.project(config, "fsdp2", 8, measured, LINKS)
    total = param_counts(config).total
    per = 2 * b.param + b.master + b.moments  # FSDP2's gradients have the parameters' dtype
    block = P.layer_params(config).moe_layer.total
    assert fs.compute_s == pytest.approx(0.3 + 0.03 / 8)
    assert fs.peak_bytes == pytest.approx(
        40 * P.GIB - per * total * 7 / 8 + 2 * block * 2 * b.param
    )
    assert fs.tokens_per_s() == pytest.approx(4 * 4096 / fs.overlapped_s)


def test_layer_extrapolation_and_bad_layouts():
    assert J.extrapolate((1, 2), [5.0, 7.0], 16) == pytest.approx(35.0)
    assert J.extrapolate((16,), [3.0], 16) == 3.0
    with pytest.raises(ValueError, match="must be the model"):
        J.extrapolate((4,), [3.0], 16)
    with pytest.raises(ValueError, match="layout"):
        J.local_experts(get_preset("small"), "tp", 8)
    with pytest.raises(ValueError, match="must divide moe.num_experts"):
        J.local_experts(get_preset("small"), "ep-replicated", 3)


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
    slower = calibrated["layouts"][0]["step_s"] > plain["layouts"][0]["step_s"]
    assert (
        slower
        and calibrated["layouts"][0]["peak_memory_gib"] < plain["layouts"][0]["peak_memory_gib"]
    )
    assert _plan([*argv, "--no-calibration"]) == 0
    assert json.loads(capsys.readouterr().out)["calibration"] is None
    assert _plan(["--preset", "small", "--gpus", "1"]) == 0
    assert "calibrated: " in capsys.readouterr().out
    assert _plan([*argv, "--calibration", str(tmp_path / "none.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_bench_project_runs_end_to_end_on_cpu(tmp_path, capsys):
    """tiny on 4 'GPUs': two rank models (2 experts a layer; all 8) timed on the CPU and
    projected under both link models, written to --out."""
    argv = ["bench", "--project", "--project-presets", "tiny", "--gpus", "4"]
    assert main([*argv, "--steps", "1", "--warmup", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| tiny | ep-replicated | 4 | h200 |" in out and "| tiny | fsdp2 | 4 | b300 |" in out
    assert "ep-replicated / fsdp2" in out
    record = json.loads((tmp_path / "projection.json").read_text())
    assert {(r["layout"], r["links"]) for r in record["rows"]} == {
        (lay, link) for lay in J.LAYOUTS for link in ("h200", "b300")
    }
    assert set(record["measurements"]) == {"tiny 2 experts/layer", "tiny 8 experts/layer"}
    assert (tmp_path / "report.md").read_text().count("| tiny |") == 6


def test_a_deep_model_is_timed_at_two_depths_and_extrapolated():
    from moetrain.bench.measure_rank import measure_rank

    config = get_preset("tiny").with_overrides(["model.num_layers=4"])
    measured, runs = measure_rank(config, 2, depths=(1, 2), steps=1, warmup=1, device="cpu")
    assert measured.depths == (1, 2) and len(runs) == 2
    t1, t2 = (r.stats["median_ms"] / 1e3 for r in runs)
    assert measured.forward_backward_s == pytest.approx(t1 + 3 * (t2 - t1))


def test_calibration_check_plans_and_times_a_preset_on_cpu():
    from moetrain.bench.calibrate import CHECK_HEADER, check

    result = check(get_preset("tiny"), _calibration(), steps=1, warmup=1, device="cpu")
    assert result.preset == "tiny" and result.predicted_ms > 0 and result.measured_ms > 0
    assert result.floor_ms > 0 and result.row().startswith("| tiny |")
    assert CHECK_HEADER.count("|---") == 9
