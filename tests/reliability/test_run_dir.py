"""A run directory is not damaged by what happens around it: data re-prepared under a run,
corrupt checkpoints at rotation and resume, a second process starting in it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _bench import bench

from moetrain import cli
from moetrain.checkpoint import manager
from moetrain.train.run_lock import LOCK_FILE, RunDirLocked, RunLock

REPO = Path(__file__).resolve().parents[2]


def _flip_a_byte(checkpoint):
    shard = next(checkpoint.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _write_docs(path, word, n=400):
    lines = [f'{{"text": "{(word + " ") * 30}{i}"}}' for i in range(n)]
    path.write_text("\n".join(lines) + "\n")


def test_resume_on_re_prepared_data_is_an_error(tmp_path, module_cache, capsys):
    """`prepare` into a used token directory needs --overwrite; after it, --resume of the run
    trained on the old tokens stops with an error naming the change (not a loader-state error
    or, worse, a silent run on other data)."""
    _write_docs(tmp_path / "a.jsonl", "alpha")
    _write_docs(tmp_path / "b.jsonl", "beta gamma")
    data, run = tmp_path / "data", tmp_path / "run"
    prep = ["prepare", "--out", str(data), "--quiet"]
    assert cli.main([*prep[:1], str(tmp_path / "a.jsonl"), *prep[1:]]) == 0
    bench.train_tiny(run, 2, f"data.path={data}")
    capsys.readouterr()
    assert cli.main([*prep[:1], str(tmp_path / "b.jsonl"), *prep[1:]]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert bench.train_tiny(run, 4, f"data.path={data}").step == 4  # unchanged data resumes
    assert cli.main([*prep[:1], str(tmp_path / "b.jsonl"), *prep[1:], "--overwrite"]) == 0
    with pytest.raises(ValueError, match="the data changed since checkpoint .*step-4"):
        bench.train_tiny(run, 6, f"data.path={data}")


def test_rotation_moves_a_corrupt_checkpoint_aside_and_keeps_the_good_one(tmp_path, module_cache):
    """step-4 corrupt: resume falls back to step-2, moves step-4 aside, and the rotation after
    the next save keeps step-2 (the newest verified before it) instead of the corrupt one."""
    run = tmp_path / "run"
    bench.train_tiny(run, 4)
    _flip_a_byte(run / "checkpoints" / "step-4")
    resumed = bench.train_tiny(run, 6, "train.checkpoint_every=100")  # saves step-6 only
    assert resumed.resumed_from.name == "step-2"
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step-2", "step-4.corrupt", "step-6"]


def test_resume_with_no_verifiable_checkpoint_is_an_error(tmp_path, module_cache, capsys):
    run = tmp_path / "run"
    bench.train_tiny(run, 4)
    for step in (2, 4):
        _flip_a_byte(run / "checkpoints" / f"step-{step}")
    for _ in range(2):  # and again, once they have been moved aside
        with pytest.raises(manager.CheckpointError, match="no checkpoint .* verifies") as error:
            bench.train_tiny(run, 6)
        assert "step-2.corrupt, step-4.corrupt" in str(error.value)
    code = cli.main(["train", "--preset", "tiny", "--quiet", "--resume", "--run-dir", str(run)])
    assert code == 2 and "refusing to start over at step 0" in capsys.readouterr().err


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


def test_a_live_run_holds_its_directory_against_resume_and_overwrite(
    tmp_path, module_cache, capsys
):
    """A real training process holds the lock: a concurrent --resume and a concurrent
    --overwrite are refused and change nothing; after it stops, the lock is gone."""
    run = tmp_path / "run"
    sets = ["train.steps=100000", "train.checkpoint_every=2", "train.eval_every=0"]
    flags = ["--preset", "tiny", "--quiet", "--run-dir", str(run)]
    args = ["-m", "moetrain", "train", *flags, *[x for s in sets for x in ("--set", s)]]
    child = _python(args, module_cache, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for(lambda: (run / "checkpoints" / "step-2").is_dir(), "the first checkpoint")
        before = (run / "metrics.jsonl").stat().st_size
        for extra in (["--resume"], ["--overwrite"]):
            assert cli.main(["train", *flags, *extra]) == 2
            assert "is in use by another moetrain run" in capsys.readouterr().err
        assert (run / "checkpoints" / "step-2").is_dir()
        assert (run / "metrics.jsonl").stat().st_size >= before
    finally:
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err.decode()[-3000:]
    assert not (run / LOCK_FILE).exists()


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
