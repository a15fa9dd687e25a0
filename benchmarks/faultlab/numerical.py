"""Numerical faults: NaN/inf in the loss or the gradients and loss spikes, planted by patching
`forward_backward`. A bad step is skipped and counted; K in a row save and stop the run.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import torch

from moetrain.checkpoint import manager
from moetrain.train import step as train_step
from moetrain.train.metrics_jsonl import read_metrics
from moetrain.train.trainer import TrainingStopped

from .harness import Outcome, error_of, train_tiny


def poison(kind: str, at_calls: set[int], seen: list[dict[str, torch.Tensor]]):
    """A forward_backward that corrupts the loss or the gradients on the given calls (1-based)
    and snapshots the weights at every call, so a skipped update shows as two equal snapshots.
    Kinds: "inf loss", "nan loss", "nan grad", "spike" (the loss x 10, gradients untouched) and
    "none" (snapshots only)."""
    real = train_step.forward_backward
    calls = [0]

    def poisoned(model, *args, **kwargs):
        calls[0] += 1
        seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        loss = real(model, *args, **kwargs)
        if calls[0] not in at_calls or kind == "none":
            return loss
        if kind == "nan grad":
            for p in model.parameters():
                p.grad.fill_(float("nan"))
            return loss
        return {
            "inf loss": loss * float("inf"),
            "nan loss": loss * float("nan"),
            "spike": loss * 10,
        }[kind]

    return mock.patch.object(train_step, "forward_backward", poisoned)


SPIKE = ["train.spike_sigma=3", "train.spike_window=8"]


def numerical_faults(work: Path) -> list[Outcome]:
    """NaN/inf in the loss or the gradients, and a loss spike, at step 12: that step's update is
    skipped (the weights do not change), it is counted, and training goes on. Then K = 3 bad
    steps in a row: the run saves and stops with a message naming the cause."""
    rows = []
    for kind in ("inf loss", "nan loss", "nan grad", "spike"):
        seen: list[dict[str, torch.Tensor]] = []
        with poison(kind, {12}, seen):
            trainer = train_tiny(work / f"numeric_{kind.replace(' ', '_')}", 16, *SPIKE)
        records = {r["step"]: r for r in read_metrics(trainer.run_dir.path)[0]}
        skipped = all(torch.equal(seen[11][k], seen[12][k]) for k in seen[11])
        moved = any(not torch.equal(seen[12][k], seen[13][k]) for k in seen[12])
        counted = records[16]["skipped_steps"] == 1
        if kind == "spike":
            counted = counted and records[16]["spike_steps"] == 1
        ok = skipped and moved and counted and trainer.step == 16
        rows.append(Outcome(f"{kind} at one step", f"{kind} injected into step 12", 1, int(ok)))
    stop = Outcome("K bad steps in a row", "3 spikes / 3 inf losses, max_bad_steps=3")
    for kind in ("spike", "inf loss"):
        run = work / f"numeric_stop_{kind.replace(' ', '_')}"
        with poison(kind, {12, 13, 14}, []):
            args = (run, 20, *SPIKE, "train.max_bad_steps=3")
            message = error_of(TrainingStopped, train_tiny, *args) or ""
        stop.injected += 1
        saved = manager.latest(run / "checkpoints")
        expect = "loss spike" if kind == "spike" else "non-finite"
        ok = "3 consecutive steps were skipped" in message and expect in message
        stop.survived += int(ok and saved is not None and saved.name == "step-14")
        stop.details[kind] = message
    return [*rows, stop]
