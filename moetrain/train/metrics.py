"""Throughput, FLOP and memory accounting, and where metrics go: console, JSONL, TensorBoard and
Weights & Biases (train/wandb_log.py). MFU: model FLOPs (model/flops.py) against the GPU's
datasheet dense BF16 peak.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from moetrain.train.observe import TensorBoardWriter

# Datasheet dense BF16 TFLOP/s (no sparsity).
PEAK_TFLOPS = {
    "H100": 989.0,
    "H200": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "B200": 2250.0,
    "B300": 2250.0,
    "GH200": 989.0,
}


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_TFLOPS[key]
    return None


def peak_memory_gib(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    return torch.cuda.max_memory_allocated(device) / 2**30


class Throughput:
    """Tokens/s, TFLOP/s and MFU over the interval since the last `measure()`."""

    def __init__(self, flops_per_token: int, device: torch.device) -> None:
        self.flops_per_token = flops_per_token
        self.peak = peak_tflops(device)
        self.device = device
        self._t0 = time.perf_counter()
        self._tokens = 0

    def add_tokens(self, n: int) -> None:
        self._tokens += n

    def reset(self) -> None:
        self._t0, self._tokens = time.perf_counter(), 0

    def measure(self) -> dict[str, float | None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        tokens_per_s = self._tokens / elapsed
        tflops = tokens_per_s * self.flops_per_token / 1e12
        self.reset()
        return {
            "tokens_per_s": tokens_per_s,
            "tflops": tflops,
            "mfu": tflops / self.peak if self.peak else None,
        }


class MetricsSink:
    """Appends one JSON object per line to RUN_DIR/metrics.jsonl (flushed each line, so a crash
    loses at most the line being written) and mirrors records to TensorBoard when available and
    to `wandb` (a `WandbWriter`) when given."""

    def __init__(self, run_dir: Path, enabled: bool = True, wandb: Any = None) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self._file = None
        self._tb = None
        self._wandb = wandb if enabled else None
        if enabled:
            # A crash may have cut the last line short; start ours on a fresh line.
            if self.path.exists() and self.path.stat().st_size:
                with self.path.open("rb") as f:
                    f.seek(-1, 2)
                    needs_newline = f.read(1) != b"\n"
            else:
                needs_newline = False
            self._file = self.path.open("a")
            if needs_newline:
                self._file.write("\n")
            self._tb = TensorBoardWriter(run_dir)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._tb.write(record)
        if self._wandb is not None:
            self._wandb.write(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


class EpochLog:
    """The train records' "epoch" (completed passes over the data; a mix's "epoch_per_source"),
    and a console line when a new pass begins (the same sequences again)."""

    def __init__(self, passes: list[int], labels: list[str] | None) -> None:
        self.seen, self.labels = passes, labels

    def fields(self, passes: list[int], step: int, console: Console) -> dict[str, Any]:
        for i, (before, now) in enumerate(zip(self.seen, passes, strict=True)):
            if now > before:
                what = f"source {self.labels[i]}" if self.labels else "the training data"
                console.print(
                    f"note: {what} ran out by step {step}: epoch {now} began (the same "
                    "sequences again, reshuffled)"
                )
        self.seen = passes
        if not passes:  # random tokens
            return {}
        if self.labels:
            return {"epoch_per_source": dict(zip(self.labels, passes, strict=True))}
        return {"epoch": passes[0]}


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
        parts.append(f"load max/mean {worst:.2f}")
    if record.get("skipped_steps"):
        parts.append(f"skipped {record['skipped_steps']}")
    return "  ".join(parts)
