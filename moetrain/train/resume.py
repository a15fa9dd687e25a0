"""What a resume checks before it loads a checkpoint, for the CLI and the Trainer alike: the
checkpoint's config against the run's, what the learning rate does next (a jump is an error unless
allowed), and the changes, printed once on the main rank's stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moetrain.checkpoint import manager
from moetrain.config import RunConfig
from moetrain.data import resolve_data_paths
from moetrain.optim.schedule import lr_change
from moetrain.train.resume_config import check_resumable


def check_resume(
    checkpoint: Path, config: RunConfig, allow_lr_increase: bool, report: bool
) -> None:
    saved = checkpoint / "config.yaml"
    old = resolve_data_paths(RunConfig.load_yaml(saved))  # a relative path of an older run
    changes = check_resumable(old, config, str(saved))
    step = json.loads((checkpoint / manager.TRAINER_STATE).read_text())["step"]
    lr_note = lr_change(old.train, config.train, step, allow_lr_increase)
    if changes and report:
        lines = [*changes, lr_note] if lr_note else changes
        print(f"--resume: changes to {saved}: " + "; ".join(lines), file=sys.stderr)
