"""TensorBoard: a sink of the metrics hub (train/metrics.py) that mirrors the scalars of each
record to event files in the run directory, when the `tensorboard` package is installed.
`scalar_tags` names those scalars; the W&B sink logs the same tags (train/wandb_log.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# Record key -> TensorBoard tag. Grouped by prefix, so train and val loss share one section.
_TB_TAGS = {
    "loss": "loss/train",
    "val_loss": "loss/val",
    "lb_loss": "aux/lb_loss",
    "z_loss": "aux/z_loss",
    "lr": "optim/lr",
    "grad_norm": "optim/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "tflops": "perf/tflops",
    "mfu": "perf/mfu",
    "peak_mem_gib": "perf/peak_mem_gib",
    "epoch": "data/epoch",
}
_TB_MOE_KEYS = ("max_mean", "max_mean_peak", "cv", "zero_frac", "entropy", "lb_loss", "drop_frac")


class TensorBoardWriter:
    """Mirrors train/eval records to TensorBoard event files in `run_dir`, under `scalar_tags`.
    Without the `tensorboard` package it logs one message and `write` is a no-op (`enabled` is
    False)."""

    def __init__(self, run_dir: str | Path, *, log: Callable[[str], None] = print) -> None:
        self._writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log("info: TensorBoard logging is off (pip install tensorboard to turn it on)")
            return
        self._writer = SummaryWriter(log_dir=str(run_dir))

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def write(self, record: Mapping[str, Any]) -> None:
        if self._writer is None:
            return
        step = int(record["step"])
        for tag, value in scalar_tags(record).items():
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()  # once per log line: TensorBoard shows the run as it goes

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def scalar_tags(record: Mapping[str, Any]) -> dict[str, float]:
    """The scalars of a train/eval record under their TensorBoard (and W&B) tags; missing and
    None values are left out. A mix adds data/tokens/{source}, data/epoch/{source} and
    loss/val/{source}, evaluation sets loss/eval/{name}, tasks tasks/{name}/acc and
    tasks/{name}/acc_norm."""
    tags: dict[str, Any] = {tag: record.get(key) for key, tag in _TB_TAGS.items()}
    for layer in record.get("moe") or ():
        for key in _TB_MOE_KEYS:
            tags[f"moe/{layer['layer']}/{key}"] = layer.get(key)
    for source, tokens in (record.get("tokens_per_source") or {}).items():
        tags[f"data/tokens/{source}"] = tokens
    for source, epoch in (record.get("epoch_per_source") or {}).items():
        tags[f"data/epoch/{source}"] = epoch
    for source, loss in (record.get("val_loss_per_source") or {}).items():
        tags[f"loss/val/{source}"] = loss
    for name, loss in (record.get("eval_sets") or {}).items():
        tags[f"loss/eval/{name}"] = loss
    for name, scores in (record.get("tasks") or {}).items():
        for key, value in scores.items():
            tags[f"tasks/{name}/{key}"] = value
    return {
        tag: value
        for tag, value in tags.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }
