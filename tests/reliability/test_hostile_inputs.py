"""Broken inputs are clear errors before any work is lost. Token files and manager-level shape
checks have their own tests (tests/data, tests/checkpoint); these add the trainer and CLI level
and fuzz the config loader."""

import pytest
import yaml
from _bench import inputs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moetrain import cli
from moetrain.checkpoint import manager
from moetrain.config import SECTIONS, RunConfig


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inputs.config_dicts)
def test_config_loader_builds_or_names_the_problem(data):
    """Random sections, keys (field names, junk, non-strings) and value types: from_dict builds a
    RunConfig or raises a ValueError naming a field or section, never another exception."""
    if inputs.check_config_dict(data):
        RunConfig.from_dict(RunConfig.from_dict(data).to_dict())  # what it built round-trips


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([f"{s}.{f}" for s in SECTIONS for f in inputs.FIELDS[s]] + ["name", "x.y"]),
    st.text(max_size=12),
)
def test_overrides_build_or_name_the_field(key, raw):
    """`--set section.field=<any text>` parses as YAML and builds or names the field."""
    try:
        RunConfig().with_overrides([f"{key}={raw}"])
    except ValueError as exc:
        assert key.split(".")[0] in str(exc) or "override" in str(exc), str(exc)


def test_broken_inputs_to_a_run_with_a_checkpoint(tmp_path, module_cache):
    """Truncated, wrong-dtype and out-of-vocabulary token files, a corpus smaller than a batch,
    another model shape, an unknown config key and a wrongly typed value, each given to
    `--resume` of a run that has a checkpoint, and an empty input to prepare: a ValueError that
    names the problem, and the run's checkpoints untouched."""
    outcome = inputs.hostile_inputs(tmp_path)
    assert outcome.injected == outcome.survived == 8, outcome.details


def test_cli_resume_into_another_model_shape(tmp_path, module_cache, capsys):
    """`moetrain train --resume` with a different d_model: exit code 2, the field and both
    values in the message, and the run's checkpoint and config.yaml as they were."""
    run = tmp_path / "run"
    common = ["train", "--preset", "tiny", "--quiet", "--run-dir", str(run)]
    fast = ["--set", "train.steps=2", "--set", "train.eval_every=0"]
    assert cli.main([*common, *fast]) == 0
    config_before = (run / "config.yaml").read_text()
    capsys.readouterr()
    assert cli.main([*common, *fast, "--resume", "--set", "model.d_model=96"]) == 2
    err = capsys.readouterr().err
    assert "model.d_model cannot change on --resume (64 in " in err and "96 now" in err
    assert (run / "config.yaml").read_text() == config_before
    assert yaml.safe_load(config_before)["model"]["d_model"] == 64
    manager.verify(run / "checkpoints" / "step-2")


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"train": {"lr": float("nan")}}, r"train\.lr \(nan\) must be a finite number"),
        ({"train": {"lr": 10**400}}, r"train\.lr .* must be a finite number"),
        ({"train": {"spike_window": 1}}, r"train\.spike_window \(1\) must be >= 2"),
        ({"train": {"spike_sigma": -1.0}}, r"train\.spike_sigma \(-1\.0\) must be >= 0"),
        ({1: {}, "extra": {}}, r"unknown config section\(s\) \['1', 'extra'\]"),
    ],
)
def test_config_values_and_keys_that_used_to_slip_through(data, match):
    """Unknown section keys of mixed types made the error message itself a TypeError (the
    fuzzer's find); NaN, and an int beyond the float range (OverflowError), reached the run."""
    with pytest.raises(ValueError, match=match):
        RunConfig.from_dict(data)
