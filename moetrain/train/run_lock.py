"""A lock on a run directory for the life of a run, so two trainings never share one.

The lock is the file `RUN_DIR/run.lock`, created with O_CREAT | O_EXCL (one creator wins, also
on a filesystem shared by several nodes), holding JSON with the holder's host, pid, start time
and a random token. While it is held, a daemon thread refreshes the file's modification time
every `heartbeat_s` seconds. Another run treats the lock as stale, and takes it over, when the
holder ran on this host and its pid no longer exists (a crash, a kill -9), or when the heartbeat
is older than `stale_after_s` (a holder on another node that died, or a pid reused after a
reboot). A takeover first renames the stale file to a unique name, which only one contender can
do, and then creates its own; a contender that loses the race sees the winner's fresh lock.
A lock this very process holds is taken over too (a library user building a second Trainer on
the same directory after the first one). `release` removes the file only while it still holds
this lock's token. Only the main rank takes the lock; the trainer tells the others the outcome.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

LOCK_FILE = "run.lock"


class RunDirLocked(ValueError):
    """Another live run holds the run directory."""


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
        self._stop = threading.Event()
        self._finalizer: weakref.finalize | None = None

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
                self._break(reason)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            self._finalizer = weakref.finalize(self, _release, self.path, self.token, self._stop)
            threading.Thread(
                target=_heartbeat,
                args=(self.path, self.token, self._stop, self.heartbeat_s),
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

    def _break(self, reason: str) -> None:
        aside = self.path.with_name(f"{LOCK_FILE}.stale-{uuid.uuid4().hex}")
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:  # another contender broke it first
            return
        aside.unlink(missing_ok=True)
        if reason != "held by this process":
            print(f"note: took over the stale lock {self.path}: {reason}")

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


def _holds(path: Path, token: str) -> bool:
    holder = read_holder(path)
    return holder is not None and holder.get("token") == token


def _heartbeat(path: Path, token: str, stop: threading.Event, every: float) -> None:
    while not stop.wait(every):
        if not _holds(path, token):
            return
        try:
            os.utime(path)
        except OSError:
            return


def _release(path: Path, token: str, stop: threading.Event) -> None:
    stop.set()
    if _holds(path, token):
        path.unlink(missing_ok=True)
