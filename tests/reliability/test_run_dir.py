"""A run directory is not damaged by what happens around it: data re-prepared under a run,
corrupt checkpoints at rotation and resume, a second process starting in it."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _bench import harness, run_dirs

from moetrain import cli
from moetrain.checkpoint import manager
from moetrain.config.presets import tiny
from moetrain.train.run_lock import LOCK_FILE, RunDirLocked, RunLock
from moetrain.train.trainer import Trainer, TrainingStopped

REPO = Path(__file__).resolve().parents[2]


def test_resume_on_re_prepared_data_is_an_error(tmp_path, module_cache, capsys):
    """`prepare` into a used token directory needs --overwrite; after it, --resume of the run
    trained on the old tokens stops with an error naming the change (not a loader-state error
    or, worse, a silent run on other data), and so does `eval` of its checkpoint."""
    outcome = run_dirs.data_replaced(tmp_path)
    assert outcome.injected == outcome.survived == 2, outcome.details
    capsys.readouterr()
    assert cli.main(["eval", "--checkpoint", str(tmp_path / "replaced_run")]) == 2
    assert "the data changed since checkpoint" in capsys.readouterr().err


def test_rotation_keeps_the_newest_verified_and_resume_names_unverifiable(tmp_path, module_cache):
    """step-4 corrupt: resume falls back to step-2, moves step-4 aside, and the rotation after
    the next save keeps step-2 instead of the corrupt one. All corrupt: an error naming them."""
    outcome = run_dirs.corrupt_rotation(tmp_path)
    assert (outcome.injected, outcome.survived, outcome.lost) == (2, 2, 0), outcome.details


def test_resume_with_no_verifiable_checkpoint_is_an_error_at_the_cli(
    tmp_path, module_cache, capsys
):
    run = tmp_path / "run"
    harness.train_tiny(run, 2)
    harness.flip_a_byte(run / "checkpoints" / "step-2")
    code = cli.main(["train", "--quiet", "--resume", "--run-dir", str(run)])
    assert code == 2 and "refusing to start over at step 0" in capsys.readouterr().err


def test_a_second_run_in_a_used_run_dir_is_refused(tmp_path, module_cache):
    """A real training process holds the lock: a concurrent --resume and --overwrite are
    refused while it runs; after a SIGKILL its stale lock does not stop the restart, which
    loses nothing."""
    outcome = run_dirs.concurrent_runs(tmp_path, module_cache)
    assert (outcome.injected, outcome.survived, outcome.lost) == (2, 2, 0), outcome.details


def _python(code_or_args, cache, **popen):
    env = {**os.environ, "MOETRAIN_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args
    return subprocess.Popen([sys.executable, *args], env=env, **popen)


def _wait_for(predicate, what, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_lock_left_by_a_crash_is_taken_over(tmp_path, module_cache):
    """A holder killed with SIGKILL leaves its lock file; on the same host the dead pid makes it
    stale at once. A lock of another host is stale once its heartbeat is older than the limit."""
    holder = _python(
        f"from moetrain.train.run_lock import RunLock; import time; "
        f"lock = RunLock({str(tmp_path)!r}, heartbeat_s=0.1, stale_after_s=5); lock.acquire(); "
        f"print('held', flush=True); time.sleep(120)",
        module_cache,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout.readline().strip() == b"held"
        first = (tmp_path / LOCK_FILE).stat().st_mtime
        _wait_for(lambda: (tmp_path / LOCK_FILE).stat().st_mtime > first, "a heartbeat", 10)
        with pytest.raises(RunDirLocked, match=f"pid {holder.pid} on host"):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / LOCK_FILE).exists()  # nobody cleaned up after the crash
    lock = RunLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()

    other = {"host": "another-node", "pid": 1, "started": 0, "token": "x"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(other))
    with pytest.raises(RunDirLocked, match="host another-node"):
        RunLock(tmp_path, heartbeat_s=1, stale_after_s=60).acquire()
    old = time.time() - 61
    os.utime(tmp_path / LOCK_FILE, (old, old))
    RunLock(tmp_path, heartbeat_s=1, stale_after_s=60).acquire()


def _stale_lock(run_dir: Path) -> dict:
    """A lock of a node that died: another host, a heartbeat far older than the limit."""
    record = {"host": "dead-node", "pid": 1, "started": 0, "token": "stale"}
    (run_dir / LOCK_FILE).write_text(json.dumps(record))
    os.utime(run_dir / LOCK_FILE, (0, 0))
    return record


def test_two_contenders_for_one_stale_lock_leave_one_holder(tmp_path, monkeypatch):
    """Two runs (a job requeued twice) judge the same stale lock; between the second's verdict
    and its take-over, the first takes the lock over. The second must put the first's fresh
    lock back and be refused, not rename it away (both would then train in one directory)."""
    _stale_lock(tmp_path)
    first, second = RunLock(tmp_path), RunLock(tmp_path)
    judge = RunLock._stale_reason

    def first_takes_over_after_the_verdict(self, holder):
        reason = judge(self, holder)
        if self is second and holder["token"] == "stale":
            with monkeypatch.context() as other_node:  # the first runs on another node
                other_node.setattr("socket.gethostname", lambda: "node-of-the-first")
                first.acquire()
        return reason

    monkeypatch.setattr(RunLock, "_stale_reason", first_takes_over_after_the_verdict)
    with pytest.raises(RunDirLocked, match="host node-of-the-first"):
        second.acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == first.token
    assert first.beat() is None and first.lost is None
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_FILE]  # nothing left aside
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()


@pytest.mark.parametrize("seen_by", ["heartbeat", "save"])
def test_a_run_that_loses_its_lock_stops_without_saving(tmp_path, module_cache, seen_by):
    """Another run takes the directory over after step 1 (its lock replaces this run's): the
    run stops at that step's boundary (the heartbeat saw it) or at the save that follows (it
    did not yet), with an error saying so, and writes no checkpoint into the directory."""
    config = tiny().with_overrides([*harness.BASE, "train.steps=3", "train.checkpoint_every=1"])
    trainer = Trainer(config, tmp_path, progress=False)
    train_step = trainer.train_step

    def taken_over_after_step_1(batches):
        loss = train_step(batches)
        (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "h", "pid": 2, "token": "t"}))
        if seen_by == "heartbeat":
            trainer.run_dir.lock.beat()  # what the heartbeat thread does every 15 s
        return loss

    trainer.train_step = taken_over_after_step_1
    with pytest.raises(TrainingStopped, match="lost the lock .* pid 2 on host h.* without saving"):
        trainer.train()
    assert trainer.step == 1 and not manager.list_complete(tmp_path / "checkpoints")
    trainer.shutdown()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == "t"  # not released
