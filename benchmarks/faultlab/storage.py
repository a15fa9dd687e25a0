"""Storage faults: a full disk during a save, a run directory that cannot be created, and bit
rot or truncation in the newest checkpoint. Each is a clear error or a resume from the newest
intact checkpoint, and the run ends where a fault-free run ends.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

from torch.distributed.checkpoint import filesystem as dcp_filesystem

from moetrain.checkpoint import manager
from moetrain.config.presets import tiny
from moetrain.train.trainer import Trainer

from .harness import BASE, Outcome, error_of, flip_a_byte, lost_steps, train_tiny


@contextlib.contextmanager
def disk_full_in(where: str) -> Iterator[None]:
    """Writes fail with ENOSPC: in the DCP shards (after 1 KiB of a shard is written), or in
    trainer.json (after the shards)."""
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if where == "shards":

        def write_item(transforms, stream, data, *args, **kwargs):
            stream.write(b"\0" * 1024)
            raise full

        with mock.patch.object(dcp_filesystem, "_write_item", write_item):
            yield
        return
    real_write_text = Path.write_text

    def write_text(self, *args, **kwargs):
        if self.name == manager.TRAINER_STATE:
            raise full
        return real_write_text(self, *args, **kwargs)

    with mock.patch.object(Path, "write_text", write_text):
        yield


def disk_full(work: Path) -> Outcome:
    """The disk fills during the save of step 4, in the shards or in trainer.json: a clear error,
    step-2 stays the newest complete checkpoint and loads, and --resume continues from it."""
    reference = work / "disk_reference"
    train_tiny(reference, 6)
    out = Outcome("disk full during a save", "ENOSPC from a shard write / trainer.json write")
    for where in ("shards", "trainer.json"):
        run = work / f"disk_full_{where}"
        train_tiny(run, 2)
        out.injected += 1
        with disk_full_in(where):
            message = error_of(manager.CheckpointError, train_tiny, run, 4) or ""
        names = sorted(p.name for p in (run / "checkpoints").iterdir())
        clear = "no space left on device" in message and "step-2" in message
        intact = names == ["step-2"] and manager.latest(run / "checkpoints").name == "step-2"
        train_tiny(run, 6)  # the disk has room again
        lost = lost_steps(run, reference)
        out.survived += int(clear and intact and lost == 0)
        out.lost += lost
        out.redone += 2
        out.details[where] = {"message": message, "left": names}
    return out


def unwritable_run_dir(work: Path) -> Outcome:
    """A run directory that cannot be created (its parent is a file): an error naming it, raised
    before the model is built."""
    blocker = work / "not_a_directory"
    blocker.write_text("")
    config, run = tiny().with_overrides(BASE), blocker / "run"
    message = error_of(manager.CheckpointError, Trainer, config, run, progress=False) or ""
    ok = "cannot write checkpoints to" in message and str(run) in message
    return Outcome(
        "unwritable run directory",
        "run dir below a regular file",
        1,
        int(ok),
        details={"message": message},
    )


def bit_rot(work: Path) -> Outcome:
    """One flipped byte or a truncated shard in the newest checkpoint: --resume skips it (hash
    mismatch), resumes from the one before, and ends where a fault-free run ends."""
    reference = work / "rot_reference"
    train_tiny(reference, 6)
    out = Outcome("bit rot / truncation in the newest checkpoint", "flip a byte / cut a shard")
    for damage in ("flip", "truncate"):
        run = work / f"rot_{damage}"
        train_tiny(run, 4)
        checkpoint = run / "checkpoints" / "step-4"
        if damage == "flip":
            flip_a_byte(checkpoint)
        else:
            shard = next(checkpoint.glob("*.distcp"))
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        out.injected += 1
        with contextlib.redirect_stdout(io.StringIO()):  # the "skipping checkpoint" warning
            resumed = train_tiny(run, 6)
        lost = lost_steps(run, reference)
        out.survived += int(resumed.resumed_from.name == "step-2" and lost == 0)
        out.lost += lost
        out.redone += 2
    return out
