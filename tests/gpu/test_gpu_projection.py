"""On a GPU: `bench --calibrate` and `bench --project` run end to end on `tiny` (the compiled,
CUDA-graphed step of a rank model with a BalancedDispatcher included, its profile split by kind,
the dispatchers' costs timed), and what they write is sane: positive rates, a sustained rate no
faster than the short one, shares of the step that add up, every variant projected on this GPU's
links and the B300's."""

import json

import pytest

from moetrain.cli import main
from moetrain.tools.plan import calibration as cal
from moetrain.tools.plan.rank_compute import FSDP, RESIDENT

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
    record = json.loads((tmp_path / "projection.json").read_text())["presets"]["tiny"]
    for key, m in record["measurements"].items():
        if key == "dispatcher":
            assert m["no_sync_s"] > 0 and m["balanced_s"] > 0 and m["host_sync_s"] >= 0
            continue
        shares = m["rank_compute"]["shares"]
        assert sum(shares.values()) == pytest.approx(1.0)
        assert shares["experts"] > 0 and shares["products"] > 0
    assert set(record["rows"]) == {measured.gpu, "b300"}
    for rows in record["rows"].values():
        assert set(rows["best"]) == {v.name for v in (*RESIDENT, *FSDP) if not v.hsdp}
        assert all(r["peak_gib"] > 0 and r["tokens_per_s_per_gpu"] > 0 for r in rows["sweep"])
