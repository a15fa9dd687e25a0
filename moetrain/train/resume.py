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
    checkpoint: Path,
    config: RunConfig,
    allow_lr_increase: bool,
    report: bool,
    tokens_per_step: int | None = None,
) -> None:
    """Raise a ValueError for a resume of `checkpoint` under `config` that changes what it may
    not (`check_resumable`), jumps its LR (`lr_change`), or trains another number of tokens a
    step (`tokens_per_step`, this run's) than the checkpoint recorded while
    train.global_batch_tokens is unset (the global batch followed the world size); print the
    changes when `report`."""
    saved = checkpoint / "config.yaml"
    old = resolve_data_paths(RunConfig.load_yaml(saved))  # a relative path of an older run
    changes = check_resumable(old, config, str(saved))
    state = json.loads((checkpoint / manager.TRAINER_STATE).read_text())
    step, recorded = state["step"], state.get("tokens_per_step")
    if config.train.global_batch_tokens is None and recorded not in (None, tokens_per_step):
        raise ValueError(
            f"--resume: the run trained {recorded} tokens a step ({checkpoint}, at world size "
            f"{state.get('world_size')}), this start would train {tokens_per_step}: with "
            "train.global_batch_tokens unset the global batch follows the number of ranks. "
            f"--set train.global_batch_tokens={recorded} keeps it (a multiple of "
            "micro_batch_size * seq_len * dp), or set it to the new size to change it"
        )
    lr_note = lr_change(old.train, config.train, step, allow_lr_increase)
    if changes and report:
        lines = [*changes, lr_note] if lr_note else changes
        print(f"--resume: changes to {saved}: " + "; ".join(lines), file=sys.stderr)
