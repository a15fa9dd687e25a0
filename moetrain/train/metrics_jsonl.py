"""metrics.jsonl, the run's record of its metrics: one JSON object per line, appended by the
JSONL sink of the metrics hub (`JsonlWriter`; train/metrics.py) and read back by `read_metrics`
(`moetrain plot`, the tests). Torch-free.

    {"kind": "train", "step", "loss", "lb_loss", "z_loss", "lr", "grad_norm", "tokens_per_s",
     "tflops", "mfu", "peak_mem_gib", "skipped_steps", "spike_steps", "time",
     "moe": [{"layer": int, **routing_summary}] (train/routing_stats.py: the interval's load
             "max_mean", its worst step's "max_mean_peak", "cv", "zero_frac", ...),
     "epoch": completed passes over the training data (a mix: "epoch_per_source": {source: int}),
     "tokens_per_source": {source: int} (a mix of data.sources only)}
    {"kind": "eval", "step", "val_loss", "val_loss_per_source": {source: float} (a mix only),
     "eval_sets": {name: float}, "tasks": {name: {"acc", "acc_norm"}} (when configured)}
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


class JsonlWriter:
    """Appends one JSON object per line to RUN_DIR/metrics.jsonl, flushed each line, so a crash
    loses at most the line being written; a line a crash cut short is left alone and the next
    record starts on a fresh line. Given the step a run starts at (`start_step`; a resume: its
    checkpoint's step), it first drops the records past it, which the run redoes (a crash after
    the last checkpoint logged them once already), and the lines cut short: each step appears
    once. `dropped` counts the records it dropped."""

    def __init__(self, run_dir: str | Path, *, start_step: int | None = None) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.dropped = 0
        needs_newline = False
        if self.path.exists() and self.path.stat().st_size:
            with self.path.open("rb") as f:
                f.seek(-1, 2)
                needs_newline = f.read(1) != b"\n"
            if start_step is not None:
                self.dropped = _drop_records_after(self.path, start_step)
            if self.dropped:
                needs_newline = False  # rewritten whole lines
        self._file = self.path.open("a")
        if needs_newline:
            self._file.write("\n")

    def write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _drop_records_after(path: Path, step: int) -> int:
    """Rewrite `path` (atomically) without the records past `step` and the lines cut short;
    returns how many records it dropped (0: the file is left as it is)."""
    kept, dropped = [], 0
    with path.open() as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and int(record.get("step", step)) > step:
                dropped += 1
            else:
                kept.append(line.rstrip("\n") + "\n")
    if dropped:
        partial = path.with_name(path.name + ".partial")
        partial.write_text("".join(kept))
        os.replace(partial, path)
    return dropped


def read_metrics(path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train records, eval records), sorted by step, from a metrics.jsonl file or its run
    directory. A step logged twice (a file an older moetrain resumed into) keeps its latest record;
    invalid JSON lines (cut short by a crash) and other kinds are skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"no metrics file at {path}")
    by_kind: dict[str, dict[int, dict[str, Any]]] = {"train": {}, "eval": {}}
    with path.open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(record, dict) or "step" not in record:
                continue
            records = by_kind.get(record.get("kind", ""))
            if records is not None:
                records[int(record["step"])] = record
    train, evals = (
        [records[s] for s in sorted(records)] for records in (by_kind["train"], by_kind["eval"])
    )
    return train, evals
