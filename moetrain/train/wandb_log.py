"""Weights & Biases (`train.wandb_project`): an optional sink of the metrics hub
(train/metrics.py) that mirrors metrics.jsonl next to TensorBoard, logging the TensorBoard tags
(`scalar_tags`) at the training step. Without an API key the run logs offline into the run
directory (`wandb sync` uploads it). The run id is kept in RUN_DIR/wandb-run-id: a resume from a
checkpoint continues that run; every other start begins a new one (W&B would drop steps older
than the old run's).
"""

from __future__ import annotations

import netrc
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moetrain.train.tensorboard_log import scalar_tags

RUN_ID_FILE = "wandb-run-id"


def import_wandb(project: str) -> Any:
    """The `wandb` module; a ValueError naming the install command when it is missing."""
    try:
        import wandb
    except ImportError:
        raise ValueError(
            f"train.wandb_project ({project!r}) is set but the wandb package is not installed: "
            "pip install wandb (or set train.wandb_project to null to log to metrics.jsonl and "
            "TensorBoard only)"
        ) from None
    return wandb


def default_mode() -> str:
    """WANDB_MODE when set; else online with an API key, offline without one."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        logged_in = netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        logged_in = False
    return "online" if logged_in else "offline"


class WandbWriter:
    """Logs train/eval records to one W&B run, continued when `resumed` (from a checkpoint of
    the run dir), else a new one."""

    def __init__(
        self,
        run_dir: str | Path,
        project: str,
        name: str,
        config: dict[str, Any],
        *,
        resumed: bool,
    ):
        wandb = import_wandb(project)
        run_dir = Path(run_dir)
        id_file = run_dir / RUN_ID_FILE
        if resumed and id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:12]
            run_dir.mkdir(parents=True, exist_ok=True)
            id_file.write_text(run_id + "\n")
        self.mode = default_mode()
        self._run = wandb.init(
            project=project,
            name=name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=config,
            mode=self.mode,
        )

    def write(self, record: Mapping[str, Any]) -> None:
        if self._run is not None:
            self._run.log(scalar_tags(record), step=int(record["step"]))

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
