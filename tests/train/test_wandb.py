"""The optional Weights & Biases logger: the scalars of metrics.jsonl, offline without an API key,
one W&B run across --resume, and a clear error when the package is missing. A fake `wandb`
module records the calls (the real package is not a test dependency)."""

import json
import sys
import types

import pytest

from moetrain.config.presets import tiny
from moetrain.train.tensorboard_log import scalar_tags
from moetrain.train.trainer import Trainer
from moetrain.train.wandb_log import default_mode


class FakeRun:
    def __init__(self, calls, kwargs):
        self.calls, self.kwargs = calls, kwargs
        self.logged: list[tuple[int, dict]] = []
        self.finished = False

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch, tmp_path):
    runs: list[FakeRun] = []
    module = types.ModuleType("wandb")
    module.init = lambda **kwargs: runs.append(FakeRun(runs, kwargs)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", module)
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc login
    return runs


def _cfg(*overrides):
    return tiny().with_overrides(
        ["train.log_every=2", "train.eval_every=4", "train.eval_sequences=8", *overrides]
    )


def test_logs_the_scalars_of_metrics_jsonl_offline(tmp_cache, tmp_path, fake_wandb):
    run_dir = tmp_path / "run"
    cfg = _cfg("train.steps=4", "train.wandb_project=moe-tests", "name=mix")
    Trainer(cfg, run_dir, progress=False).train()
    (run,) = fake_wandb
    assert run.kwargs["project"] == "moe-tests" and run.kwargs["name"] == "mix"
    assert run.kwargs["mode"] == "offline" and run.kwargs["dir"] == str(run_dir)
    assert run.kwargs["config"]["train"]["wandb_project"] == "moe-tests"
    assert run.finished
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert run.logged == [(r["step"], scalar_tags(r)) for r in records]
    assert {"loss/train", "loss/val", "optim/lr", "moe/0/max_mean"} <= {
        tag for _, data in run.logged for tag in data
    }


def test_resume_continues_the_same_wandb_run(tmp_cache, tmp_path, fake_wandb):
    common = ("train.wandb_project=p", "train.checkpoint_every=2", "train.eval_every=0")
    Trainer(_cfg("train.steps=2", *common), tmp_path / "run", progress=False).train()
    Trainer(_cfg("train.steps=4", *common), tmp_path / "run", resume=True, progress=False).train()
    first, second = fake_wandb
    assert first.kwargs["id"] == second.kwargs["id"] and second.kwargs["resume"] == "allow"
    assert [s for s, _ in first.logged + second.logged] == [2, 4]


def test_mode_follows_the_environment(fake_wandb, monkeypatch, tmp_path):
    assert default_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert default_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert default_mode() == "disabled"
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.delenv("WANDB_MODE")
    netrc = tmp_path / "home" / ".netrc"
    netrc.parent.mkdir()
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    assert default_mode() == "online"


def test_missing_package_is_a_start_up_error(tmp_cache, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ValueError, match="pip install wandb"):
        Trainer(_cfg("train.steps=2", "train.wandb_project=p"), tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_off_by_default_never_imports_wandb(tmp_cache, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    Trainer(_cfg("train.steps=2", "train.eval_every=0"), tmp_path / "run", progress=False).train()


def test_overwrite_starts_a_new_wandb_run(tmp_cache, tmp_path, fake_wandb):
    """--overwrite deletes the earlier run and starts at step 1: a W&B run of its own (resuming
    the old one, W&B would drop steps 1, 2, ... as older than its last step)."""
    common = ("train.wandb_project=p", "train.checkpoint_every=2", "train.eval_every=0")
    Trainer(_cfg("train.steps=2", *common), tmp_path / "run", progress=False).train()
    Trainer(
        _cfg("train.steps=2", *common), tmp_path / "run", overwrite=True, progress=False
    ).train()
    first, second = fake_wandb
    assert first.kwargs["id"] != second.kwargs["id"]
    assert [s for s, _ in second.logged] == [2]
    assert (tmp_path / "run" / "wandb-run-id").read_text().strip() == second.kwargs["id"]
