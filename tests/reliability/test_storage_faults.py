"""A full disk, an unwritable run directory and bit rot: clear errors, and the newest complete
checkpoint stays the one --resume uses."""

import errno

import pytest
import torch
from _bench import harness, storage

from moetrain import cli
from moetrain.checkpoint import manager


@pytest.mark.parametrize("where", ["shards", "trainer.json"])
def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path, module_cache, where):
    """ENOSPC while writing a DCP shard or trainer.json of step-4: a CheckpointError that says
    so and names the checkpoint kept; no step-4 or step-4.tmp is left; step-2 loads; after the
    disk has room again, --resume from step-2 ends exactly where a run without the fault ends."""
    harness.train_tiny(tmp_path / "reference", 6)
    run = tmp_path / "run"
    harness.train_tiny(run, 2)
    with storage.disk_full_in(where), pytest.raises(manager.CheckpointError) as error:
        harness.train_tiny(run, 4)
    assert "saving checkpoint step-4" in str(error.value)
    assert "no space left on device" in str(error.value)
    assert f"still {run / 'checkpoints' / 'step-2'}" in str(error.value)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]
    assert manager.latest(run / "checkpoints").name == "step-2"
    assert harness.checkpoint_tensors(run / "checkpoints" / "step-2")  # complete and loadable
    harness.train_tiny(run, 6)
    assert harness.lost_steps(run, tmp_path / "reference") == 0


def test_save_error_names_a_non_disk_cause(tmp_path, monkeypatch):
    """Any OSError in a save is reported with its cause, and the partial directory removed."""

    def refuse(*args, **kwargs):
        raise OSError(errno.EACCES, "Permission denied", str(tmp_path / "x"))

    monkeypatch.setattr(manager, "_fsync_dir", refuse)
    state = {"model": {"w": torch.randn(4, 4)}}
    with pytest.raises(manager.CheckpointError, match=r"step-1 .*failed: .*Permission denied"):
        manager.save(tmp_path, 1, state, {"step": 1}, "")
    assert list(tmp_path.iterdir()) == []


def test_unwritable_run_dir_is_an_error_before_training(tmp_path, module_cache, capsys):
    """A run directory that cannot be created: the Trainer raises a CheckpointError naming it
    before building anything, and the CLI turns it into exit code 2 with that message."""
    outcome = storage.unwritable_run_dir(tmp_path)
    assert outcome.survived == 1, outcome.details
    run_dir = tmp_path / "not_a_directory" / "cli_run"
    code = cli.main(["train", "--preset", "tiny", "--quiet", "--run-dir", str(run_dir)])
    assert code == 2
    assert f"cannot write checkpoints to {run_dir / 'checkpoints'}" in capsys.readouterr().err


def test_bit_rot_in_the_newest_checkpoint_falls_back_to_the_previous(tmp_path, module_cache):
    """A flipped byte or a truncated shard in step-4: --resume skips it (hash or size mismatch)
    and resumes from step-2, ending where a fault-free run ends."""
    outcome = storage.bit_rot(tmp_path)
    assert (outcome.injected, outcome.survived, outcome.lost) == (2, 2, 0)
