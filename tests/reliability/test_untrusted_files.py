"""Loading a checkpoint executes nothing it contains: DCP's `.metadata` pickle goes through a
restricted unpickler, and non-tensor values through torch.load(weights_only=True)."""

import dataclasses
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _bench import harness, untrusted
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from moetrain.checkpoint import manager


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(8, 8, generator=g), "h": torch.randn(3, generator=g).half()},
        "optim": {"step": step, "lr": 0.5, "name": "adamw"},  # non-tensor values
    }


def _empty() -> dict:
    return {
        "model": {"w": torch.zeros(8, 8), "h": torch.zeros(3, dtype=torch.half)},
        "optim": {"step": 0, "lr": 0.0, "name": ""},
    }


def test_plain_values_round_trip_through_the_safe_planner(tmp_path):
    manager.save(tmp_path, 7, _state(7), {"step": 7}, "")
    target = _empty()
    manager.load(tmp_path / "step-7", target)
    assert target["optim"] == {"step": 7, "lr": 0.5, "name": "adamw"}
    assert torch.equal(target["model"]["h"], _state(7)["model"]["h"])


class _Recorder(pickle.Unpickler):
    def __init__(self, file):
        super().__init__(file)
        self.globals = set()

    def find_class(self, module, name):
        self.globals.add((module, name))
        return super().find_class(module, name)


def test_the_allowlist_covers_what_real_checkpoints_reference(tmp_path, module_cache):
    """The globals that the .metadata pickles of real trainer checkpoints (model + AdamW, and the
    sharded optimizer with its int step count) reference are all on the allowlist, and those
    checkpoints resume through the restricted reader."""
    for optimizer in ("adamw", "sharded"):
        run = tmp_path / optimizer
        harness.train_tiny(run, 2, f"train.optimizer={optimizer}")
        with open(run / "checkpoints" / "step-2" / ".metadata", "rb") as f:
            recorder = _Recorder(f)
            recorder.load()
        for module, name in recorder.globals:
            is_dtype = module == "torch" and isinstance(getattr(torch, name), torch.dtype)
            assert is_dtype or name in manager._METADATA_GLOBALS[module], (module, name)
        resumed = harness.train_tiny(run, 4, f"train.optimizer={optimizer}")
        assert resumed.resumed_from.name == "step-2" and resumed.step == 4


@pytest.mark.parametrize("nested", [False, True])
def test_a_code_running_metadata_pickle_is_refused(tmp_path, nested):
    """A .metadata whose pickle calls os.system (bare, or hidden inside real DCP metadata), with
    the manifest rewritten so the hash check passes: plain pickle would run it (the control);
    manager.load and read_metadata refuse it with a CheckpointError and it never runs."""
    manager.save(tmp_path, 1, _state(1), {"step": 1}, "")
    path = tmp_path / "step-1"
    marker = tmp_path / "pwned"
    untrusted.plant_metadata_payload(path, marker, nested=nested)
    manager.verify(path)  # the attacker made the hashes match
    with pytest.raises(manager.CheckpointError, match=r"\.metadata is not a checkpoint metadata"):
        manager.load(path, _empty())
    with pytest.raises(manager.CheckpointError, match=r"posix\.system is not allowed"):
        manager.read_metadata(path)
    assert not marker.exists()
    pickle.loads((path / ".metadata").read_bytes())  # the control: the payload is live
    assert marker.exists()


def test_a_code_running_value_in_a_shard_is_refused(tmp_path):
    """A non-tensor entry whose torch.save bytes call os.system: DCP's default planner would run
    it (the control); the safe planner refuses it with a CheckpointError."""
    manager.save(tmp_path, 1, _state(1), {"step": 1}, "")
    path = tmp_path / "step-1"
    marker = tmp_path / "pwned"
    untrusted.plant_value_payload(path, "optim.step", marker)
    with pytest.raises(manager.CheckpointError, match=r"optim\.step is not a plain value"):
        manager.load(path, _empty())
    assert not marker.exists()
    reader = manager.SafeFileSystemReader(str(path))
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(_empty(), storage_reader=reader, planner=DefaultLoadPlanner())
    assert marker.exists()


def test_resume_init_from_and_export_refuse_hostile_checkpoints(tmp_path, module_cache):
    """The trainer's --resume and --init-from and the Hugging Face export all read checkpoints
    through the safe paths: each refuses a planted payload, which never runs."""
    outcome = untrusted.hostile_checkpoints(tmp_path)
    assert outcome.injected == outcome.survived == 4, outcome.details


def test_metadata_that_is_not_metadata_is_refused(tmp_path):
    manager.save(tmp_path, 1, _state(1), {"step": 1}, "")
    path = tmp_path / "step-1"
    (path / ".metadata").write_bytes(pickle.dumps({"just": "a dict"}))
    with pytest.raises(manager.CheckpointError, match="it holds a dict"):
        manager.read_metadata(path)
    (path / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(manager.CheckpointError, match="not a checkpoint metadata file"):
        manager.read_metadata(path)


def test_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path):
    """A shard path like ../x.distcp would make DCP read any file the process can read."""
    manager.save(tmp_path / "ckpt", 1, _state(1), {"step": 1}, "")
    path = tmp_path / "ckpt" / "step-1"
    metadata = manager.read_metadata(path)
    index = next(iter(metadata.storage_data))
    info = metadata.storage_data[index]
    metadata.storage_data[index] = dataclasses.replace(info, relative_path="../../secret.distcp")
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    untrusted.rewrite_manifest(path)
    with pytest.raises(manager.CheckpointError, match=r"outside its directory: '\.\./\.\./secret"):
        manager.load(path, _empty())
