"""Running `tiny` and comparing the result with a fault-free run: the Outcome row every
scenario returns, the `moetrain train --resume` / torchrun command lines and the environment
their subprocesses get, an in-process run (`train_tiny`), and the accounting of a run against its
reference: the loss of each step, the final tensors, the steps lost, the newest checkpoint and
the last logged step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moetrain.checkpoint import manager
from moetrain.config.presets import tiny
from moetrain.train.metrics_jsonl import read_metrics
from moetrain.train.trainer import Trainer

# Every run logs each step (the loss of each step is compared) and checkpoints every 2 steps.
CHECKPOINT_EVERY = 2
BASE = ["train.log_every=1", "train.eval_every=0", f"train.checkpoint_every={CHECKPOINT_EVERY}"]


@dataclass
class Outcome:
    """One row of the table, plus what the tests look at."""

    fault: str
    injection: str
    injected: int = 0
    survived: int = 0
    lost: int = 0  # steps whose result is gone or differs from the fault-free run
    redone: int = 0  # steps recomputed after a resume
    details: dict[str, Any] = field(default_factory=dict)


def clean_env(cache: Path, **extra: str) -> dict[str, str]:
    """This process's environment without fault variables, one thread, the given cache, `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOETRAIN_FAULT")}
    return {**env, "MOETRAIN_CACHE": str(cache), "OMP_NUM_THREADS": "1", **extra}


def train_cli(run_dir: Path, steps: int, *overrides: str) -> list[str]:
    """`moetrain train --resume`: the command a requeued job repeats, also on its first start."""
    sets = [x for o in [*BASE, f"train.steps={steps}", *overrides] for x in ("--set", o)]
    flags = ["--preset", "tiny", "--quiet", "--resume", "--run-dir", str(run_dir)]
    return ["-m", "moetrain", "train", *flags, *sets]


def torchrun(nproc: int, *args: str) -> list[str]:
    """`torchrun --standalone` with `nproc` processes, as `python` arguments."""
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def run_python(args: list[str], env: dict[str, str], timeout: float = 300) -> None:
    """Run `python ARGS`; a RuntimeError with the end of its stderr if it fails."""
    proc = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def losses(run_dir: Path) -> dict[int, float]:
    """The last-written loss of each step in RUN_DIR/metrics.jsonl."""
    train, _ = read_metrics(run_dir)
    return {r["step"]: r["loss"] for r in train}


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (model, optimizer, RNG), by its DCP name."""
    stored = manager.read_metadata(path).state_dict_metadata
    state = {
        name: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for name, meta in stored.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    manager.load(path, state)
    return state


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model and optimizer tensors of the newest checkpoint. (Its "rng" entry is the
    process's global torch generator, which training never draws from and which every new
    process seeds at random: it is carried across a resume but is not compared.)"""
    tensors = checkpoint_tensors(manager.latest(run_dir / "checkpoints"))
    return {k: v for k, v in tensors.items() if k.startswith(("model.", "optim."))}


def lost_steps(run_dir: Path, reference: Path) -> int:
    """Steps of `reference` whose loss `run_dir` lacks or differs in (bitwise); all of them when
    the final weights differ (bitwise)."""
    ours, theirs = losses(run_dir), losses(reference)
    lost = sum(1 for step, loss in theirs.items() if ours.get(step) != loss)
    a, b = final_weights(run_dir), final_weights(reference)
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return lost if same else len(theirs)


def newest_step(run_dir: Path) -> int:
    path = manager.latest(run_dir / "checkpoints")
    return int(path.name.removeprefix("step-")) if path else 0


def last_logged(run_dir: Path) -> int:
    try:
        train, _ = read_metrics(run_dir)
    except ValueError:  # no metrics file yet
        return 0
    return train[-1]["step"] if train else 0


def train_tiny(run_dir: Path, steps: int, *overrides: str, resume: bool = True) -> Trainer:
    """An in-process run (world size 1) of `tiny` with the BASE cadence and a constant LR after
    warmup, so that a run stopped early by a smaller `steps` follows the same trajectory."""
    config = tiny().with_overrides(
        [*BASE, "train.schedule=constant", f"train.steps={steps}", *overrides]
    )
    trainer = Trainer(config, run_dir, resume=resume, progress=False)
    trainer.train()
    return trainer


def error_of(errors: type[Exception], fn: Callable[..., object], *args, **kwargs) -> str | None:
    """The message of the `errors` exception that fn(*args, **kwargs) raises, or None when it
    returns."""
    try:
        fn(*args, **kwargs)
    except errors as exc:
        return str(exc)
    return None


def checkpoint_mtimes(run_dir: Path) -> dict[str, int]:
    """Each entry of RUN_DIR/checkpoints and its modification time: unchanged means untouched."""
    return {p.name: p.stat().st_mtime_ns for p in (run_dir / "checkpoints").iterdir()}


def flip_a_byte(checkpoint: Path) -> None:
    """Bit rot: invert the middle byte of the checkpoint's first shard."""
    shard = next(checkpoint.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
