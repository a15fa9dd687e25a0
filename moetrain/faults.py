"""Fault injection for the reliability tests and benchmarks/reliability.py; inert unless set.

Two hook points read environment variables, so a fault can be planted in a process that a test
launches (the CLI, torchrun workers) without changing how it is started:

- ``MOETRAIN_FAULT=exit:STEP[:RANK]``: right after optimizer step STEP, the process (of rank RANK,
  else every rank) calls ``os._exit(1)``, like a node that crashed: no cleanup, no save.
- ``MOETRAIN_FAULT=kill-in-save:STEP[:RANK]``: while the checkpoint of step STEP is being saved,
  after its DCP shards and before its manifest, the process SIGKILLs itself.
- ``MOETRAIN_FAULT_ONCE=PATH``: a fault fires only while PATH does not exist, and creates PATH
  first, so a restarted run (torchrun, a requeued job) does not die again at the same step.
- ``MOETRAIN_FAULT_SAVE_DELAY=SECONDS``: sleep between the shards and the manifest of every save,
  widening the window in which a kill from outside lands in the middle of a checkpoint.

Reading the environment at a hook costs a dictionary lookup and no device work. Torch-free.
"""

from __future__ import annotations

import os
import signal
import time

FAULT = "MOETRAIN_FAULT"
FAULT_ONCE = "MOETRAIN_FAULT_ONCE"
SAVE_DELAY = "MOETRAIN_FAULT_SAVE_DELAY"


def _armed(kind: str, step: int, rank: int) -> bool:
    spec = os.environ.get(FAULT)
    if not spec:
        return False
    parts = spec.split(":")
    if len(parts) not in (2, 3) or parts[0] not in ("exit", "kill-in-save"):
        raise ValueError(f"{FAULT}={spec!r} must be exit:STEP[:RANK] or kill-in-save:STEP[:RANK]")
    if parts[0] != kind or int(parts[1]) != step or (len(parts) == 3 and int(parts[2]) != rank):
        return False
    once = os.environ.get(FAULT_ONCE)
    if once:
        try:  # O_EXCL: of two processes racing here, only one fires
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
    return True


def after_step(step: int, rank: int) -> None:
    """Called by the trainer after each optimizer step."""
    if _armed("exit", step, rank):
        os._exit(1)


def in_save(step: int, rank: int) -> None:
    """Called by `checkpoint.manager.save` between the DCP shards and the manifest."""
    delay = os.environ.get(SAVE_DELAY)
    if delay:
        time.sleep(float(delay))
    if _armed("kill-in-save", step, rank):
        os.kill(os.getpid(), signal.SIGKILL)
