"""Hostile checkpoints: pickles that would run a command, planted in a checkpoint's DCP
`.metadata` or in a non-tensor value, with the manifest rewritten to match. Loading them
(--resume, --init-from, export) must refuse them without running the command.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moetrain.checkpoint import manager
from moetrain.config.presets import tiny
from moetrain.tools.convert.io import export_checkpoint
from moetrain.train.trainer import Trainer

from .harness import Outcome, error_of, train_tiny


class Payload:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


def rewrite_manifest(checkpoint: Path) -> None:
    """Make the manifest match the files again, as an attacker who controls the directory can."""
    manifest = json.loads((checkpoint / manager.MANIFEST).read_text())
    for name in manifest["files"]:
        data = (checkpoint / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / manager.MANIFEST).write_text(json.dumps(manifest))


def plant_metadata_payload(checkpoint: Path, marker: Path, nested: bool) -> None:
    """Replace `.metadata` by a pickle that runs `Payload`: bare, or hidden inside otherwise
    valid DCP metadata."""
    if nested:
        metadata = manager.read_metadata(checkpoint)
        metadata.storage_meta.modules = [Payload(marker)]
        data = pickle.dumps(metadata)
    else:
        data = pickle.dumps(Payload(marker))
    (checkpoint / ".metadata").write_bytes(data)
    rewrite_manifest(checkpoint)


def plant_value_payload(checkpoint: Path, fqn: str, marker: Path) -> None:
    """Point the non-tensor entry `fqn` at torch.save(Payload) bytes appended to its shard."""
    metadata = manager.read_metadata(checkpoint)
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    shard = checkpoint / info.relative_path
    offset = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(buffer.getvalue())
    metadata.storage_data[index] = dataclasses.replace(
        info, offset=offset, length=len(buffer.getvalue())
    )
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_manifest(checkpoint)


def hostile_checkpoints(work: Path) -> Outcome:
    """Checkpoints whose pickles would run a command: loading (resume, --init-from, export's
    reader) refuses them with a CheckpointError, and the command never runs."""
    out = Outcome("checkpoint with a code-running pickle", "os.system in .metadata / a value")
    source = work / "hostile_source"
    train_tiny(source, 2, "train.optimizer=sharded")  # the sharded optimizer saves an int "step"
    resume = lambda run: train_tiny(run, 4, "train.optimizer=sharded")  # noqa: E731
    cases: list[tuple[str, Callable[[Path, Path], None], Callable[[Path], Any]]] = [
        ("metadata, --resume", lambda c, m: plant_metadata_payload(c, m, nested=False), resume),
        (
            "metadata, --init-from",
            lambda c, m: plant_metadata_payload(c, m, nested=True),
            lambda run: Trainer(
                tiny(), run.with_name(run.name + "_new"), init_from=run, progress=False
            ),
        ),
        (
            "metadata, export",
            lambda c, m: plant_metadata_payload(c, m, nested=True),
            lambda run: export_checkpoint(run, run.with_name(run.name + "_hf")),
        ),
        ("optimizer value, --resume", lambda c, m: plant_value_payload(c, "optim.step", m), resume),
    ]
    for name, plant, load in cases:
        slug = re.sub(r"\W+", "_", name)
        run = work / f"hostile_{slug}"
        shutil.copytree(source, run)
        marker = work / f"{slug}.pwned"
        plant(run / "checkpoints" / "step-2", marker)
        out.injected += 1
        rejected = error_of(manager.CheckpointError, load, run) is not None
        out.survived += int(rejected and not marker.exists())
        out.details[name] = {"rejected": rejected, "payload_ran": marker.exists()}
    return out
