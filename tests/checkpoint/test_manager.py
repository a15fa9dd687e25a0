"""Checkpoints are atomic, verified and rotated."""

import subprocess
import sys
import textwrap

import pytest
import torch

from moetrain.checkpoint import manager


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(7, generator=g)}}


def _empty() -> dict:
    return {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(7)}}


def test_save_load_roundtrip_and_keep_last(tmp_path):
    for step in (1, 2, 3):
        manager.save(tmp_path, step, _state(step), {"step": step}, "name: x\n", keep=2)
    assert [p.name for p in manager.list_complete(tmp_path)] == ["step-2", "step-3"]
    target = _empty()
    assert manager.load(manager.latest(tmp_path), target) == {"step": 3}
    assert torch.equal(target["model"]["w"], _state(3)["model"]["w"])


def test_truncated_or_corrupted_checkpoint_is_detected_and_previous_is_used(tmp_path, capsys):
    manager.save(tmp_path, 1, _state(1), {"step": 1}, "", keep=3)
    manager.save(tmp_path, 2, _state(2), {"step": 2}, "", keep=3)
    shard = next((tmp_path / "step-2").glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(manager.CheckpointError, match="truncated"):
        manager.load(tmp_path / "step-2", _empty())
    assert manager.latest(tmp_path).name == "step-1"
    assert "skipping checkpoint" in capsys.readouterr().out
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # same size, one bit pattern changed
    with pytest.raises(manager.CheckpointError, match="SHA-256"):
        manager.load(tmp_path / "step-2", _empty())
    target = _empty()
    manager.load(manager.latest(tmp_path), target)
    assert torch.equal(target["model"]["w"], _state(1)["model"]["w"])


def test_wrong_model_shape_is_a_clear_error(tmp_path):
    manager.save(tmp_path, 1, _state(1), {"step": 1}, "")
    with pytest.raises(
        manager.CheckpointError, match=r"model\.w: checkpoint \(64, 64\), this model \(32, 64\)"
    ):
        manager.load(
            tmp_path / "step-1", {"model": {"w": torch.zeros(32, 64), "b": torch.zeros(7)}}
        )


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    """A process killed in the middle of writing step-2 leaves step-1 as the newest complete."""
    manager.save(tmp_path, 1, _state(1), {"step": 1}, "")
    script = textwrap.dedent(f"""
        import os, signal, torch
        import torch.distributed.checkpoint as dcp
        from moetrain.checkpoint import manager
        real_save = dcp.save
        def dying_save(state, checkpoint_id):
            real_save(state, checkpoint_id=checkpoint_id)
            os.kill(os.getpid(), signal.SIGKILL)  # die after the shards, before the manifest
        dcp.save = dying_save
        state = {{"model": {{"w": torch.randn(64, 64), "b": torch.randn(7)}}}}
        manager.save({str(tmp_path)!r}, 2, state, {{"step": 2}}, "")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert (tmp_path / "step-2.tmp").is_dir()
    assert manager.latest(tmp_path).name == "step-1"
    target = _empty()
    assert manager.load(manager.latest(tmp_path), target)["step"] == 1
    manager.save(tmp_path, 3, _state(3), {"step": 3}, "")  # a later save cleans the leftover
    assert not (tmp_path / "step-2.tmp").exists()


def _save_fails_on_one_rank(rank, world_size, root, phase, failing_rank):
    """One rank's save fails in `phase`; every rank must raise (none may wait forever)."""
    import errno
    from pathlib import Path

    root = Path(root)
    state = {"model": {"w": torch.full((4,), float(rank))}}
    manager.save(root, 1, state, {"step": 1}, "")  # a good checkpoint first

    def refuse(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(root / "x"))

    if rank == failing_rank:
        if phase == "prepare":  # rank 0 cannot create step-2.tmp
            Path.mkdir = refuse
        elif phase == "shards":  # inside DCP's collective save (replicated tensors: rank 0 writes)
            from torch.distributed.checkpoint import filesystem

            filesystem._write_item = refuse
        else:  # rank 0's manifest and rename
            manager._fsync_dir = refuse
    try:
        manager.save(root, 2, state, {"step": 2}, "")
    except manager.CheckpointError as exc:
        message = str(exc)
    else:
        message = None
    return message, sorted(p.name for p in root.iterdir())


@pytest.mark.distributed
@pytest.mark.parametrize("phase", ["prepare", "shards", "finalize"])
def test_a_save_failing_on_one_rank_fails_on_every_rank(tmp_path, phase):
    """Rank 0 fails in each phase of a save; rank 1 must raise the same error, not wait for it."""
    from conftest import run_distributed

    results = run_distributed(_save_fails_on_one_rank, 2, str(tmp_path), phase, 0, timeout=120)
    for message, entries in results:
        assert message is not None and "rank 0: saving checkpoint step-2" in message
        assert "no space left on device" in message and "step-1" in message
        assert entries == ["step-1"]  # no step-2, no step-2.tmp


def test_rotation_never_keeps_a_corrupt_checkpoint_nor_deletes_the_newest_good_one(
    tmp_path, capsys
):
    for step in (1, 2, 3):
        manager.save(tmp_path, step, _state(step), {"step": step}, "", keep=2)
    shard = next((tmp_path / "step-3").glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # caught by the hash at resume
    assert manager.latest(tmp_path, move_corrupt=True).name == "step-2"
    assert "moved aside to step-3.corrupt" in capsys.readouterr().out
    manager.save(tmp_path, 4, _state(4), {"step": 4}, "", keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-2", "step-3.corrupt", "step-4"]
    # A kept checkpoint truncated meanwhile is caught by its sizes at the next rotation.
    shard = next((tmp_path / "step-4").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    manager.save(tmp_path, 5, _state(5), {"step": 5}, "", keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-2", "step-3.corrupt", "step-4.corrupt", "step-5"]
    assert [p.name for p in manager.unusable(tmp_path)] == [
        "step-2",
        "step-3.corrupt",
        "step-4.corrupt",
        "step-5",
    ]


def _agree_on_latest(rank, world_size, root):
    """Every rank resumes as the trainer does, twice: agree on the checkpoint, then load it
    without hashing again; then with every file unreadable. Returns (the path's name, the files
    this rank hashed, the error of the second)."""
    return (*_resume(root, False), _resume(root, True)[0])


def _resume(root, fail_read):
    import errno

    import torch.distributed as dist

    hashed = []
    sha256 = manager._sha256

    def counted(path):
        if fail_read:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        hashed.append(f"{path.parent.name}/{path.name}")
        return sha256(path)

    manager._sha256 = counted
    try:
        path = manager.agree_on_latest(root)
        target = _empty()
        manager.load(path, target, check_hashes=False)
        assert torch.equal(target["model"]["w"], _state(2)["model"]["w"])
        return path.name, hashed
    except manager.CheckpointError as exc:
        return str(exc), hashed
    finally:
        manager._sha256 = sha256
        dist.barrier()


@pytest.mark.distributed
def test_ranks_resume_from_the_checkpoint_rank_0_picked_and_hash_it_once(tmp_path):
    """step-3 (the newest) is corrupt: rank 0 hashes, moves it aside and picks step-2, each file
    once; rank 1 loads what rank 0 picked and hashes nothing. A file rank 0 cannot read is the
    same clear error on both ranks (not a PermissionError on one while the other waits)."""
    from conftest import run_distributed

    for step in (1, 2, 3):
        manager.save(tmp_path, step, _state(step), {"step": step}, "", keep=3)
    shard = next((tmp_path / "step-3").glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    files = sorted(f"step-2/{p.name}" for p in (tmp_path / "step-2").iterdir())
    (rank0, hashed0, error0), (rank1, hashed1, error1) = run_distributed(
        _agree_on_latest, 2, str(tmp_path), timeout=120
    )
    assert rank0 == rank1 == "step-2" and (tmp_path / "step-3.corrupt").is_dir()
    files.remove(f"step-2/{manager.MANIFEST}")
    assert sorted(h for h in hashed0 if h.startswith("step-2/")) == files
    assert len(hashed0) == len(set(hashed0)) and hashed1 == []
    assert error0 == error1 and "cannot read the checkpoints" in error0
    assert "Permission denied" in error0
