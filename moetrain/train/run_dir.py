"""A run's directory (docs/reliability.md "One run per run directory"): checked writable and
locked for the life of the run (train/run_lock.py, by the main rank), claimed by a fresh start
(an earlier run in it is an error, or deleted with --overwrite), and given the run's
config.yaml. Before each save the lock is checked to be still this run's: a run that lost it
stops without writing into a directory another run owns.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from moetrain.checkpoint import manager
from moetrain.config import RunConfig
from moetrain.train.metrics_jsonl import METRICS_FILE
from moetrain.train.run_lock import RunDirLocked, RunLock
from moetrain.train.stopping import TrainingStopped

CONFIG_FILE = "config.yaml"


class RunDir:
    def __init__(self, path: str | Path, *, is_main: bool) -> None:
        self.path = Path(path)
        self.checkpoint_root = self.path / "checkpoints"
        self.is_main = is_main
        self.lock = RunLock(self.path) if is_main else None

    def claim(self, *, resume: bool, overwrite: bool) -> None:
        """Check the directory is writable, lock it, and, unless resuming, make sure no earlier
        run is in it (`overwrite`: delete it). On every rank: they raise the same errors."""
        manager.check_writable(self.checkpoint_root)  # fail now, not at the first save
        self._hold()  # before --overwrite may delete anything
        if not resume:
            self._claim_fresh(overwrite)

    def _hold(self) -> None:
        error = None
        if self.lock is not None:
            try:
                self.lock.acquire()
            except RunDirLocked as exc:
                error = str(exc)
        error = manager.first_error(error)
        if error is not None:
            raise RunDirLocked(error)

    def _claim_fresh(self, overwrite: bool) -> None:
        """A fresh start must not mix with an earlier run in the same directory (its checkpoints
        would outrank the new ones, its metrics interleave): an error without `overwrite`; with
        it the main rank first deletes the earlier run's checkpoints, metrics and TensorBoard
        files."""
        earlier = manager.list_complete(self.checkpoint_root)
        metrics = self.path / METRICS_FILE
        if not earlier and not metrics.exists():
            return
        what = f"checkpoints up to {earlier[-1].name}" if earlier else METRICS_FILE
        if not overwrite:
            raise ValueError(
                f"{self.path} holds an earlier run ({what}): pass --resume to continue it, "
                "--overwrite to delete it and start over, or choose another --run-dir"
            )
        if self.is_main:
            print(f"--overwrite: deleting the earlier run in {self.path} ({what})")
            shutil.rmtree(self.checkpoint_root, ignore_errors=True)
            metrics.unlink(missing_ok=True)
            for events in self.path.glob("events.out.tfevents.*"):
                events.unlink()

    def save_config(self, config: RunConfig) -> None:
        if self.is_main:
            self.path.mkdir(parents=True, exist_ok=True)
            config.save_yaml(self.path / CONFIG_FILE)

    @property
    def lost(self) -> str | None:
        """Why the heartbeat found this run's lock lost (the main rank), or None."""
        return None if self.lock is None else self.lock.lost

    def check_owned(self, step: int) -> None:
        """Before a save: the lock is checked now (a collective); a lost one raises on every
        rank, so that nothing is written into a directory another run owns."""
        lost = self.lock.beat() if self.lock is not None else None
        if manager.first_error(lost) is not None:
            raise self.lost_error(step)

    def lost_error(self, step: int) -> TrainingStopped:
        why = f" ({self.lock.lost})" if self.lock is not None else ""
        return TrainingStopped(
            f"this run lost the lock on its run directory {self.path}{why}: another run took "
            f"the directory over. Stopped after step {step} without saving, so as not to "
            "write into a directory another run owns. Find which run should own it, stop the "
            "other, and restart that one with --resume"
        )

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
