"""On a GPU: `bench --calibrate` and `bench --project` run end to end on `tiny` (the compiled,
CUDA-graphed step of a rank model with a BalancedDispatcher included), and what they write is
sane: positive rates, a sustained rate no faster than the short one, projected rows for every
layout and link model."""

import json

import pytest

from moetrain.cli import main
from moetrain.plan import calibration as cal
from moetrain.plan.compare import LAYOUTS

pytestmark = pytest.mark.gpu


def test_calibrate_and_project_tiny(tmp_path):
    path = tmp_path / "cal.json"
    argv = ["bench", "--calibrate", "--check-presets", "tiny", "--calibration", str(path)]
    argv += ["--project", "--project-presets", "tiny", "--gpus", "4", "--out", str(tmp_path)]
    assert main([*argv, "--steps", "2", "--warmup", "3"]) == 0
    measured = cal.load(path)
    rates = measured.shapes["tiny"]
    assert min(rates.dense_tflops, rates.grouped_tflops, rates.attention_tflops) > 0
    assert 0 < rates.activation_factor < 2
    assert measured.sustained_tflops <= 1.05 * measured.matmul_tflops
    rows = json.loads((tmp_path / "projection.json").read_text())["rows"]
    assert {(r["layout"], r["links"]) for r in rows} == {
        (lay, link) for lay in LAYOUTS for link in ("h200", "b300")
    }
    assert all(r["peak_gib"] > 0 and r["tokens_per_s_overlapped"] > 0 for r in rows)
