"""Processes that die: `moetrain train --resume` SIGKILLed at random moments and inside a
checkpoint save, and a rank that exits under torchrun. Each restart must resume from the newest
complete checkpoint and the run must end with the fault-free run's losses and weights.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .harness import (
    CHECKPOINT_EVERY,
    Outcome,
    clean_env,
    last_logged,
    lost_steps,
    newest_step,
    run_python,
    torchrun,
    train_cli,
)


def _steps_since(run_dir: Path, started: float) -> list[int]:
    """The steps of the train records metrics.jsonl holds that were logged after `started` (a
    time.time()): those of a restart begun then (a restart first drops the records past its
    checkpoint's step, so byte offsets do not last)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_bytes().decode(errors="replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError, AttributeError):
            record = json.loads(line)
            if record["kind"] == "train" and record["time"] >= started:
                steps.append(int(record["step"]))
    return steps


# ---- kill anywhere -------------------------------------------------------------------------------
def kill_anywhere(work: Path, cache: Path, kills: int = 4, steps: int = 24, seed: int = 0):
    """SIGKILL the CLI at random moments, then once inside a save (after the DCP shards, before
    the manifest), restarting it with --resume after each kill; then let it finish. Each restart
    must resume from the newest complete checkpoint, so it redoes at most CHECKPOINT_EVERY steps,
    and the run must end with the fault-free run's losses and weights."""
    rng = random.Random(seed)
    reference, run = work / "kill_reference", work / "kill_run"
    run_python(train_cli(reference, steps), clean_env(cache))
    # every save takes 50 ms longer, so that random kills often land inside one
    env = clean_env(cache, MOETRAIN_FAULT_SAVE_DELAY="0.05")
    restarts: list[dict[str, Any]] = []

    def restart(**fault: str) -> subprocess.Popen:
        newest, started = newest_step(run), time.time()
        restarts.append({"newest": newest, "started": started, "redo": last_logged(run) - newest})
        return subprocess.Popen(
            [sys.executable, *train_cli(run, steps)],
            env={**env, **fault},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def logged(r: dict[str, Any]) -> None:
        """Once the restart `r` ended (the next one may drop its records): it logged first the
        step after the checkpoint it resumed from."""
        r["resumed_from_newest"] = _steps_since(run, r["started"])[:1] == [r["newest"] + 1]

    mid_save = 0
    for _ in range(kills):
        newest = newest_step(run)
        if newest + 1 > steps - 6:  # room for the kill and the kill inside a save to come
            break
        target = rng.randint(newest + 1, min(newest + 2 * CHECKPOINT_EVERY, steps - 6))
        started = time.time()
        proc = restart()
        while proc.poll() is None and time.time() < started + 120:
            if max(_steps_since(run, restarts[-1]["started"]), default=0) >= target:
                break
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.1))
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended before its kill: {proc.stderr.read()[-3000:]}")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        logged(restarts[-1])
        partial = (run / "checkpoints").glob("step-*.tmp")
        mid_save += any(p.stat().st_mtime >= started for p in partial)

    # one kill certainly inside a save: the next checkpoint after the newest complete one
    in_save_step = newest_step(run) + CHECKPOINT_EVERY
    marker = work / "kill_in_save.fired"
    proc = restart(MOETRAIN_FAULT=f"kill-in-save:{in_save_step}", MOETRAIN_FAULT_ONCE=str(marker))
    proc.wait(timeout=120)
    logged(restarts[-1])
    killed_in_save = proc.returncode == -signal.SIGKILL and marker.exists()
    partial_left = (run / "checkpoints" / f"step-{in_save_step}.tmp").is_dir()

    _, err = restart().communicate(timeout=300)
    logged(restarts[-1])
    if last_logged(run) != steps:
        raise RuntimeError(f"the final run did not finish: {err[-3000:]}")

    after_kill = restarts[1:]  # restarts[0] is the first start
    lost = lost_steps(run, reference)
    details = {
        "restarts": restarts,
        "mid_save_random_kills": mid_save,
        "killed_in_save": killed_in_save,
        "partial_left": partial_left,
    }
    random_ok = [r["resumed_from_newest"] and lost == 0 for r in after_kill[:-1]]
    last = after_kill[-1]
    in_save_ok = killed_in_save and partial_left and last["resumed_from_newest"] and lost == 0
    return [
        Outcome(
            "SIGKILL at a random moment",
            f"kill -9 of the CLI ({mid_save} inside a save)",
            len(random_ok),
            sum(random_ok),
            lost,
            sum(r["redo"] for r in after_kill[:-1]),
            details,
        ),
        Outcome(
            "SIGKILL inside a checkpoint save",
            "self-kill after the DCP shards, before the manifest",
            1,
            int(in_save_ok),
            lost,
            last["redo"],
            details,
        ),
    ]


# ---- a rank dies ---------------------------------------------------------------------------------
def rank_death(work: Path, cache: Path, steps: int = 8, die_after: int = 5) -> Outcome:
    """Under torchrun --max-restarts=1, rank 1 exits (os._exit(1)) after step `die_after`;
    torchrun restarts both ranks, which resume from the newest complete checkpoint."""
    reference, run = work / "ranks_reference", work / "ranks_run"
    run_python(torchrun(2, *train_cli(reference, steps)), clean_env(cache))
    marker = work / "rank_death.fired"
    # a torchrun restart with its shared TCPStore hands stale gloo addresses to the new
    # workers (pytorch/pytorch#135712); docs/reliability.md has the details
    fault = {"MOETRAIN_FAULT": f"exit:{die_after}:1", "MOETRAIN_FAULT_ONCE": str(marker)}
    env = clean_env(cache, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **fault)
    started = time.time()
    run_python(torchrun(2, "--max-restarts=1", *train_cli(run, steps)), env)
    lost = lost_steps(run, reference)
    resumed_at = die_after - die_after % CHECKPOINT_EVERY
    details = {"died": marker.exists(), "seconds": time.time() - started}
    return Outcome(
        "a rank dies (2 processes)",
        "os._exit(1) on rank 1; torchrun restarts",
        1,
        int(marker.exists() and lost == 0),
        lost,
        die_after - resumed_at,
        details,
    )
