"""The console, the metrics hub's sink for people (train/metrics.py): a rich progress bar on a
terminal, plain log lines elsewhere; one line per record, and the run's notes and warnings.
"""

from __future__ import annotations

import sys
import time
from typing import Any


class Console:
    """A rich progress bar on a terminal; elsewhere (Slurm logs, files, CI) plain log lines with
    step/total, tokens/s and an ETA from the pace since this process started."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self.interactive = enabled and sys.stderr.isatty()
        self.total, self.start_step, self.start = total_steps, start_step, time.perf_counter()
        self._progress = None
        if self.interactive:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
            )
            self._task = self._progress.add_task(
                "train", total=total_steps, completed=start_step, info=""
            )
            self._progress.start()

    def write(self, record: dict[str, Any]) -> None:
        """The console's line for a record (a sink of train/metrics.py)."""
        self.update(record["step"], record)

    def update(self, step: int, record: dict[str, Any] | None = None) -> None:
        if not self.enabled:
            return
        if record is None:
            if self._progress is not None:
                self._progress.update(self._task, completed=step)
            return
        info = _format(record)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=info)
        else:
            done = f"{record['step']:>{len(str(self.total))}}/{self.total}"
            print(f"step {done}  {info}{self._eta(record['step'])}", flush=True)

    def _eta(self, step: int) -> str:
        if step <= self.start_step or step >= self.total:
            return ""
        left = (time.perf_counter() - self.start) / (step - self.start_step) * (self.total - step)
        minutes, seconds = divmod(round(left), 60)
        hours, minutes = divmod(minutes, 60)
        return (
            f"  eta {hours}:{minutes:02d}:{seconds:02d}"
            if hours
            else f"  eta {minutes}:{seconds:02d}"
        )

    def print(self, message: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def _format(record: dict[str, Any]) -> str:
    if record.get("kind") == "eval":
        parts = [f"val_loss {record['val_loss']:.4f}"]
        parts += [f"{name} {loss:.4f}" for name, loss in record.get("eval_sets", {}).items()]
        parts += [f"{name} acc {s['acc']:.3f}" for name, s in record.get("tasks", {}).items()]
        return "  ".join(parts)
    parts = [
        f"loss {record['loss']:.4f}",
        f"lr {record['lr']:.2e}",
        f"gnorm {record['grad_norm']:.2f}",
        f"{record['tokens_per_s']:,.0f} tok/s",
    ]
    if record.get("mfu") is not None:
        parts.append(f"mfu {100 * record['mfu']:.1f}%")
    if record.get("moe"):
        worst = max(layer["max_mean"] for layer in record["moe"])
        load = f"load max/mean {worst:.2f}"
        peaks = [layer["max_mean_peak"] for layer in record["moe"] if layer.get("max_mean_peak")]
        if peaks:  # the worst single step: the interval's summed load averages it away
            load += f" (step peak {max(peaks):.2f})"
        parts.append(load)
    if record.get("skipped_steps"):
        parts.append(f"skipped {record['skipped_steps']}")
    return "  ".join(parts)
