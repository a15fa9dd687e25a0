"""The run directory and what happens around it: its data re-prepared under it, a second
`moetrain train` started in it while the first runs, and corrupt checkpoints at resume and
rotation. The run's checkpoints must stay intact and the run must end where a fault-free one
ends.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import time
from pathlib import Path

from moetrain.checkpoint import manager
from moetrain.data import prepare

from .harness import (
    Outcome,
    checkpoint_mtimes,
    clean_env,
    error_of,
    flip_a_byte,
    last_logged,
    lost_steps,
    newest_step,
    run_python,
    train_cli,
    train_tiny,
)


def _write_documents(path: Path, word: str, num_docs: int = 400) -> Path:
    lines = [json.dumps({"text": f"{word} " * 30 + str(i)}) for i in range(num_docs)]
    path.write_text("\n".join(lines) + "\n")
    return path


def data_replaced(work: Path) -> Outcome:
    """A run trains on a token directory; `prepare` of other documents into it is refused, and
    after `--overwrite` a resume of the run is an error naming the change (the content hash its
    checkpoints record), with the checkpoints untouched."""
    out = Outcome("data re-prepared under a run", "prepare into its token dir; then --overwrite")
    data, run = work / "replaced_data", work / "replaced_run"
    prepare([_write_documents(work / "a.jsonl", "alpha")], data, progress=False)
    train_tiny(run, 2, f"data.path={data}")
    before = checkpoint_mtimes(run)
    other = _write_documents(work / "b.jsonl", "beta gamma")

    def prepare_and_resume(overwrite: bool) -> None:
        prepare([other], data, progress=False, overwrite=overwrite)
        train_tiny(run, 4, f"data.path={data}")

    for overwrite in (False, True):
        out.injected += 1
        message = error_of(ValueError, prepare_and_resume, overwrite) or ""
        expected = "the data changed since checkpoint" if overwrite else "--overwrite"
        out.survived += int(expected in message and checkpoint_mtimes(run) == before)
        out.details[f"overwrite={overwrite}"] = message
    return out


def concurrent_runs(work: Path, cache: Path) -> Outcome:
    """While `moetrain train` runs, a second one with --resume and another with --overwrite start
    in its run directory: both are refused by its lock and change nothing. Then the first is
    SIGKILLed; its stale lock does not stop the restart, which ends where a fault-free run ends."""
    from moetrain import cli

    reference, run = work / "lock_reference", work / "lock_run"
    steps = 12
    run_python(train_cli(reference, steps), clean_env(cache))
    out = Outcome("a second run in a used run dir", "--resume / --overwrite beside a live run")
    env = clean_env(cache, MOETRAIN_FAULT_SAVE_DELAY="1")  # keeps the first run alive for a while
    child = subprocess.Popen(
        [sys.executable, *train_cli(run, steps)], env=env, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 120
        while not manager.list_complete(run / "checkpoints") and time.monotonic() < deadline:
            time.sleep(0.05)
        for flag in ("--resume", "--overwrite"):
            out.injected += 1
            args = [
                flag if a == "--resume" else a for a in train_cli(run, steps)[2:]
            ]  # same config
            with contextlib.redirect_stderr(io.StringIO()) as err:
                code = cli.main(args)
            refused = code == 2 and "is in use by another moetrain run" in err.getvalue()
            out.survived += int(refused and child.poll() is None)
            out.details[flag] = err.getvalue().strip()
    finally:
        child.kill()
        child.wait()
    logged, newest = last_logged(run), newest_step(run)
    run_python(train_cli(run, steps), clean_env(cache))  # the killed run's lock is stale: no error
    out.lost = lost_steps(run, reference)
    out.redone = max(logged - newest, 0)
    out.details["killed after step"] = logged
    return out


def corrupt_rotation(work: Path) -> Outcome:
    """A byte flipped in the newest checkpoint: the resume moves it aside as step-4.corrupt and
    the next rotation keeps step-2, the newest verified one. Every checkpoint corrupt: --resume
    is an error naming them, not a silent restart from step 0."""
    out = Outcome("corrupt checkpoint, then rotation", "flip a byte in the newest / in all")
    reference = work / "rotation_reference"
    train_tiny(reference, 6, "train.checkpoint_every=100")
    run = work / "rotation_run"
    train_tiny(run, 4)
    flip_a_byte(run / "checkpoints" / "step-4")
    out.injected += 1
    with contextlib.redirect_stdout(io.StringIO()):
        resumed = train_tiny(run, 6, "train.checkpoint_every=100")  # saves step-6 only
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    out.details["kept"] = kept
    lost = lost_steps(run, reference)
    ok = resumed.resumed_from.name == "step-2" and kept == ["step-2", "step-4.corrupt", "step-6"]
    out.survived += int(ok and lost == 0)
    out.lost += lost
    out.redone += 2
    run = work / "rotation_all"
    train_tiny(run, 4)
    for step in (2, 4):
        flip_a_byte(run / "checkpoints" / f"step-{step}")
    out.injected += 1
    logged = (run / "metrics.jsonl").stat().st_size
    with contextlib.redirect_stdout(io.StringIO()):
        message = error_of(manager.CheckpointError, train_tiny, run, 6) or ""
    out.details["all corrupt"] = message
    named = "no checkpoint" in message and "step-2.corrupt, step-4.corrupt" in message
    out.survived += int(named and (run / "metrics.jsonl").stat().st_size == logged)
    return out
