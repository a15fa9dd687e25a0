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
from moetrain.train.run_lock import LOCK_FILE, RunDirLocked, RunLock

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
