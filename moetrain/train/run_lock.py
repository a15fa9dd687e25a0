"""A lock on a run directory for the life of a run, so two trainings never share one
(docs/reliability.md "One run per run directory"). Only the main rank takes it.

`RUN_DIR/run.lock` is created with O_CREAT | O_EXCL (one creator wins, also on a shared
filesystem) and holds host, pid, start time and a random token; a daemon thread refreshes its
modification time every `heartbeat_s`. It is stale, and taken over, when its holder ran on this
host and its pid is gone, when the heartbeat is older than `stale_after_s`, or when this very
process holds it. A take-over removes exactly the stale lock it judged (`RunLock._break`). A
holder whose file no longer carries its token has lost the lock (`lost`), and the trainer stops
at its next step boundary without saving.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOCK_FILE = "run.lock"


class RunDirLocked(ValueError):
    """Another live run holds the run directory."""


@dataclass
class _Holding:
    """What the heartbeat thread and the finalizer share with a held lock (not the lock itself,
    which they must not keep alive)."""

    path: Path
    token: str
    stop: threading.Event = field(default_factory=threading.Event)
    lost: str | None = None

    def beat(self) -> str | None:
        """Refresh the heartbeat if the file still carries this token; else record and return
        why the lock is lost."""
        if self.lost is None:
            holder = read_holder(self.path)
            if holder is None:  # a contender may be putting it back (RunLock._break): look again
                time.sleep(0.1)
                holder = read_holder(self.path)
            if holder is not None and holder.get("token") == self.token:
                try:
                    os.utime(self.path)
                    return None
                except FileNotFoundError:  # taken away between the read and the touch
                    holder = None
            self.lost = (
                f"{self.path} was removed"
                if holder is None
                else f"{self.path} now belongs to pid {holder.get('pid')} on host "
                f"{holder.get('host')}"
            )
        return self.lost


class RunLock:
    def __init__(
        self, run_dir: str | Path, *, heartbeat_s: float = 15.0, stale_after_s: float = 90.0
    ) -> None:
        if stale_after_s <= heartbeat_s:
            raise ValueError(
                f"stale_after_s ({stale_after_s}) must be > heartbeat_s ({heartbeat_s})"
            )
        self.path = Path(run_dir) / LOCK_FILE
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.token = uuid.uuid4().hex
        self._holding: _Holding | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def lost(self) -> str | None:
        """Why this run no longer holds the lock it acquired (seen by the last heartbeat)."""
        return None if self._holding is None else self._holding.lost

    def beat(self) -> str | None:
        """Check now that the lock is still this run's, refreshing its heartbeat: None, or why
        it was lost (before a save: never write into a directory another run owns)."""
        return None if self._holding is None else self._holding.beat()

    def acquire(self) -> None:
        """Take the lock, or raise RunDirLocked describing the live holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "token": self.token,
        }
        for _ in range(10):  # each failed round means another contender just changed the file
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = read_holder(self.path)
                if holder is None:  # vanished or half-written: look again
                    time.sleep(0.05)
                    continue
                reason = self._stale_reason(holder)
                if reason is None:
                    raise RunDirLocked(self._describe(holder)) from None
                self._break(holder, reason)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            self._holding = holding = _Holding(self.path, self.token)
            self._finalizer = weakref.finalize(self, _release, holding)
            threading.Thread(
                target=_heartbeat,
                args=(holding, self.heartbeat_s),
                name="moetrain-run-lock",
                daemon=True,
            ).start()
            return
        raise RunDirLocked(f"could not take the lock {self.path}: it keeps changing hands")

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    def _stale_reason(self, holder: dict[str, Any]) -> str | None:
        """Why the lock `holder` describes is stale, or None when it is live."""
        if holder.get("host") == socket.gethostname():
            pid = holder.get("pid")
            if pid == os.getpid():
                return "held by this process"
            if isinstance(pid, int) and not _pid_alive(pid):
                return f"its process {pid} on this host is gone"
        age = time.time() - holder["mtime"]
        if age > self.stale_after_s:
            return f"its heartbeat is {age:.0f} s old (stale after {self.stale_after_s:.0f} s)"
        return None

    def _break(self, stale: dict[str, Any], reason: str) -> None:
        """Remove the lock file if it is still the `stale` one; put back any other."""
        aside = self.path.with_name(f"{LOCK_FILE}.stale-{uuid.uuid4().hex}")
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:  # another contender broke it first
            return
        taken = read_holder(aside)
        if taken is not None and taken.get("token") == stale.get("token"):
            aside.unlink(missing_ok=True)
            if reason != "held by this process":
                print(f"note: took over the stale lock {self.path}: {reason}")
            return
        try:  # another contender's fresh lock: back into place, unless a newer one is there
            os.link(aside, self.path)
        except FileExistsError:
            pass  # its owner's heartbeat finds the lock lost and that run stops
        except OSError:  # no hard links on this filesystem
            if not self.path.exists():
                os.replace(aside, self.path)
        aside.unlink(missing_ok=True)

    def _describe(self, holder: dict[str, Any]) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
        age = time.time() - holder["mtime"]
        return (
            f"run directory {self.path.parent} is in use by another moetrain run (pid "
            f"{holder.get('pid')} on host {holder.get('host')}, started {started}, heartbeat "
            f"{age:.0f} s ago); two runs in one directory would mix their checkpoints and "
            "metrics. Wait for it or stop it, or use another --run-dir. A lock left by a crash "
            f"is taken over by itself once its heartbeat is {self.stale_after_s:.0f} s old "
            f"(at once on the same host); to force it, delete {self.path}"
        )


def read_holder(path: Path) -> dict[str, Any] | None:
    """The lock file's record plus its modification time as "mtime"; None if it is absent or
    not (yet) complete JSON."""
    try:
        mtime = path.stat().st_mtime
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(holder, dict):
        return None
    return {**holder, "mtime": mtime}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _heartbeat(holding: _Holding, every: float) -> None:
    while not holding.stop.wait(every):
        if holding.beat() is not None:
            return


def _release(holding: _Holding) -> None:
    holding.stop.set()
    holder = read_holder(holding.path)
    if holder is not None and holder.get("token") == holding.token:
        holding.path.unlink(missing_ok=True)
