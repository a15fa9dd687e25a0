"""Where a run's records go: one hub (`Metrics`) the trainer writes each train or eval record to,
which hands it to every sink registered at the start (`open_metrics`): metrics.jsonl (always;
train/metrics_jsonl.py), TensorBoard (when installed; train/tensorboard_log.py), Weights &
Biases (when `train.wandb_project` is set; train/wandb_log.py), and the console last (its line
after the files hold the record; train/console.py). Only the main rank has sinks: every rank
builds the same records, one writes them. Records are produced elsewhere (train/train_record.py,
train/evaluate.py); a sink only writes them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from moetrain.config import RunConfig
from moetrain.train.console import Console
from moetrain.train.metrics_jsonl import METRICS_FILE, JsonlWriter
from moetrain.train.tensorboard_log import TensorBoardWriter
from moetrain.train.wandb_log import WandbWriter


class Sink(Protocol):
    def write(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class Metrics:
    """`write` hands a record to every sink in the order given; `note` and `progress` reach the
    console alone (a message for people; the step, for the progress bar). `close` closes the
    sinks in reverse order, the console first."""

    def __init__(self, console: Console, sinks: Sequence[Sink] = ()) -> None:
        self.console = console
        self.sinks: list[Sink] = [*sinks, console]

    def write(self, record: Mapping[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)

    def note(self, message: str) -> None:
        self.console.print(message)

    def progress(self, step: int) -> None:
        self.console.update(step)

    def close(self) -> None:
        for sink in reversed(self.sinks):
            sink.close()
        self.sinks = []


def open_metrics(
    run_dir: Path,
    config: RunConfig,
    *,
    is_main: bool,
    console: bool,
    start_step: int,
    resumed: bool,
) -> Metrics:
    """The run's hub. `console`: show progress and lines (the main rank only); `start_step`:
    the step the run starts at (metrics.jsonl drops its records past it); `resumed`: from a
    checkpoint of this run directory (W&B continues its run)."""
    t = config.train
    shown = Console(t.steps, start_step, enabled=console and is_main)
    if not is_main:
        return Metrics(shown)
    # W&B first: a start that fails there leaves no metrics.jsonl to refuse the next start
    wandb = None
    if t.wandb_project is not None:
        wandb = WandbWriter(
            run_dir, t.wandb_project, config.name, config.to_dict(), resumed=resumed
        )
    jsonl = JsonlWriter(run_dir, start_step=start_step)
    if jsonl.dropped:
        shown.print(
            f"{METRICS_FILE}: dropped {jsonl.dropped} records past step {start_step}, "
            "which this run redoes"
        )
    sinks: list[Sink] = [jsonl]
    tensorboard = TensorBoardWriter(run_dir)  # without the package: says so, and is left out
    if tensorboard.enabled:
        sinks.append(tensorboard)
    if wandb is not None:
        sinks.append(wandb)
    return Metrics(shown, sinks)
