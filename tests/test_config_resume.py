"""--resume trains with the run's own config.yaml: --set may change what is safe (printed), a
change of architecture or data is an error naming the field, and a preset given again must agree
with the run."""

import json

import pytest
import yaml

from moetrain.checkpoint import manager
from moetrain.cli import main
from moetrain.config.presets import tiny
from moetrain.data import resolve_data_paths
from moetrain.data.tokenizer_files import byte_tokenizer_json
from moetrain.train.resume import check_resume
from moetrain.train.resume_config import check_resumable, is_frozen, resume_run_config


def test_frozen_and_free_fields(tmp_path):
    assert is_frozen("model.d_model") and is_frozen("moe.top_k") and is_frozen("train.seq_len")
    assert is_frozen("data.tokenizer") and is_frozen("precision.master_weights")
    assert is_frozen("train.eval_sequences") and is_frozen("data.eval_sets")  # fix the eval rows
    free = ("train.steps", "train.lr", "train.log_every", "parallel.ep", "data.path", "name")
    assert not any(is_frozen(k) for k in (*free, "train.eval_every", "train.eval_tasks"))
    saved = tiny()
    lines = check_resumable(saved, saved.with_overrides(["train.steps=80"]), "run/config.yaml")
    assert lines == ["train.steps: 50 -> 80"]
    # resumable fields of frozen sections: the attention kernel, moved data, its split's share
    moved = ["model.attention_backend=math", "data.path=/elsewhere", "data.val_fraction=0.1"]
    assert len(check_resumable(saved, saved.with_overrides(moved), "c.yaml")) == 3
    with pytest.raises(ValueError, match=r"moe\.top_k cannot change on --resume \(2 in x.yaml"):
        check_resumable(saved, saved.with_overrides(["moe.top_k=1"]), "x.yaml")
    saved.with_overrides(["train.lr=1e-3"]).save_yaml(tmp_path / "config.yaml")
    with pytest.raises(ValueError, match=r"--preset tiny differs from it: train\.lr \(0\.003 "):
        resume_run_config(tmp_path, tiny(), [], "--preset tiny")


def test_a_mix_may_move_but_not_reweigh():
    saved = tiny().with_overrides(["data.sources=[{path: a, weight: 0.7}, {path: b, weight: 0.3}]"])
    moved = saved.with_overrides(
        ["data.sources=[{path: x/a, weight: 0.7}, {path: b, weight: 0.3}]"]
    )
    assert len(check_resumable(saved, moved, "c.yaml")) == 1
    for other in ("[{path: a, weight: 0.5}, {path: b, weight: 0.5}]", "[{path: a, weight: 0.7}]"):
        with pytest.raises(ValueError, match=r"data\.sources cannot change on --resume"):
            check_resumable(saved, saved.with_overrides([f"data.sources={other}"]), "c.yaml")


def test_a_tokenizer_may_be_named_by_another_path_only(tmp_path):
    for name, text in (("a", "{}"), ("b", "{}"), ("c", '{"other": 1}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text(text)
    saved = tiny().with_overrides([f"data.tokenizer={tmp_path / 'a'}"])
    same = [f"data.tokenizer={tmp_path / 'b' / 'tokenizer.json'}"]
    assert len(check_resumable(saved, saved.with_overrides(same), "c.yaml")) == 1
    for other in (tmp_path / "c", tmp_path / "missing", "byte"):
        with pytest.raises(ValueError, match=r"data\.tokenizer cannot change on --resume"):
            check_resumable(saved, saved.with_overrides([f"data.tokenizer={other}"]), "c.yaml")


def test_the_expert_bias_rate_may_change_but_not_to_or_from_zero():
    saved = tiny().with_overrides(["moe.bias_update_rate=0.01"])
    assert check_resumable(saved, saved.with_overrides(["moe.bias_update_rate=0.002"]), "c")
    for before, after in ((0.01, 0.0), (0.0, 0.01)):
        old = tiny().with_overrides([f"moe.bias_update_rate={before}"])
        new = old.with_overrides([f"moe.bias_update_rate={after}"])
        with pytest.raises(ValueError, match=r"bias_update_rate cannot change between 0 and > 0"):
            check_resumable(old, new, "c.yaml")


def test_resume_rebuilds_the_config_from_the_run(tmp_cache, tmp_path, capsys):
    run = tmp_path / "run"
    first = ["train", "--preset", "tiny", "--quiet", "--run-dir", str(run)]
    sets = ["--set", "train.lr=1e-3", "--set", "train.steps=2", "--set", "train.eval_every=0"]
    assert main([*first, *sets]) == 0
    capsys.readouterr()
    # no preset, no repeated flags: the run's config.yaml, with the longer horizon printed
    resume = ["train", "--resume", "--quiet", "--run-dir", str(run)]
    assert main([*resume, "--set", "train.steps=4"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 4
    assert "train.steps: 2 -> 4" in err
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["train"]["lr"] == 1e-3 and saved["model"]["d_model"] == 64
    # the preset again without the original --set would change train.lr: refused
    assert main([*resume, "--preset", "tiny", "--set", "train.steps=6"]) == 2
    assert "differs from it: train.lr (0.003 there, 0.001 in the run)" in capsys.readouterr().err
    other = tmp_path / "tokenizer.json"  # a tokenizer file, not the run's byte tokenizer
    other.write_text(json.dumps(byte_tokenizer_json()))
    for field, value in (("model.d_model", 96), ("train.seq_len", 32), ("data.tokenizer", other)):
        assert main([*resume, "--set", f"{field}={value}"]) == 2
        assert f"{field} cannot change on --resume" in capsys.readouterr().err
    assert yaml.safe_load((run / "config.yaml").read_text()) == saved


def test_a_resume_validates_its_changes_against_the_run_not_the_demo(tmp_cache, tmp_path, capsys):
    """--set on --resume without --preset: 1024 tokens a step is legal for the tiny run (a
    multiple of its micro-batch of 8 x 64) but not for the demo preset's (16 x 128); and
    --overwrite, which would delete the run --resume continues, is refused with both."""
    run = tmp_path / "run"
    first = ["train", "--preset", "tiny", "--quiet", "--run-dir", str(run)]
    assert main([*first, "--set", "train.steps=2", "--set", "train.eval_every=0"]) == 0
    capsys.readouterr()
    resume = ["train", "--resume", "--quiet", "--run-dir", str(run)]
    assert main([*resume, "--set", "train.global_batch_tokens=1024"]) == 0
    err = capsys.readouterr().err
    assert "must be a multiple" not in err and "already at train.steps (2)" in err, err
    assert main([*resume, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "--resume continues the run in its directory and --overwrite deletes it" in err, err
    assert (run / "checkpoints" / "step-2").is_dir()


def test_a_relative_eval_set_of_an_older_run_resumes_from_its_directory(
    tmp_path, monkeypatch, capsys
):
    """Runs from before eval-set and task paths were stored absolute recorded them as given: a
    resume from the directory they name (the Trainer's config has them absolute) changes
    nothing, and reports no change."""
    monkeypatch.chdir(tmp_path)
    older = tiny().with_overrides(
        ["data.eval_sets=[{name: wiki, path: data/wiki}]", "train.eval_tasks=[mine.jsonl]"]
    )
    checkpoint = tmp_path / "run" / "checkpoints" / "step-2"
    checkpoint.mkdir(parents=True)
    older.save_yaml(checkpoint / "config.yaml")
    (checkpoint / manager.TRAINER_STATE).write_text(json.dumps({"step": 2}))
    check_resume(checkpoint, resolve_data_paths(older), False, report=True)
    assert capsys.readouterr().err == ""
