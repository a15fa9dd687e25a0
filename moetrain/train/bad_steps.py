"""Bad steps: a step whose loss or gradient norm is not finite, or whose loss is a spike
(train/spike.py, `train.spike_sigma` > 0), is not applied: the optimizer step is masked by a
device bool, with no host sync. The skips are counted on the device and read at the log cadence;
`train.max_bad_steps` skipped steps in a row save a checkpoint and stop the run with an error
naming the cause (docs/reliability.md "Numerical faults").

In the step: `judge` the loss (before the optimizer step), `settle` with the gradient norm the
optimizer returns (which steps were applied), `count` them; at a log step `tally` what the
device counted and `check` the consecutive skips.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from moetrain.config import TrainConfig
from moetrain.parallel.data import all_reduce_stats
from moetrain.parallel.mesh import ParallelDims
from moetrain.train.spike import LossSpikeDetector
from moetrain.train.stopping import TrainingStopped


class Verdict(NamedTuple):
    """`judge`'s device tensors: skip the step? (spike and batch_loss: None without spikes)"""

    skip: torch.Tensor
    spike: torch.Tensor | None
    batch_loss: torch.Tensor | None


class BadSteps:
    def __init__(self, train: TrainConfig, dims: ParallelDims) -> None:
        self.max_bad_steps, self.dims = train.max_bad_steps, dims
        device = dims.device
        self.spikes = (
            LossSpikeDetector(train.spike_sigma, train.spike_window, device)
            if train.spike_sigma > 0
            else None
        )
        self.skipped_total = 0  # steps skipped over the run (checkpointed)
        self.spike_total = 0  # of which for a loss spike
        # since the last log: skipped steps, spikes, the longest run of consecutive skips
        self.sums = {k: torch.zeros((), device=device) for k in ("bad", "spikes", "max_bad_run")}
        self._bad_run = torch.zeros((), device=device)  # consecutive skipped steps until now

    def judge(self, loss: torch.Tensor) -> Verdict:
        """Skip a non-finite loss, and a spike, judged on the global batch's loss so that all
        ranks agree."""
        skip = ~torch.isfinite(loss)
        if self.spikes is None:
            return Verdict(skip, None, None)
        batch_loss = all_reduce_stats([loss.clone()], self.dims)[0] / self.dims.dp
        spike = self.spikes.is_spike(batch_loss)
        return Verdict(skip | spike, spike, batch_loss)

    def settle(self, verdict: Verdict, grad_norm: torch.Tensor) -> torch.Tensor:
        """Whether the step was applied (device bool): not skipped, and a finite gradient norm
        (the optimizer skipped it otherwise). Only applied steps enter the spike window."""
        applied = ~verdict.skip & torch.isfinite(grad_norm)
        if self.spikes is not None:
            self.spikes.record(verdict.batch_loss, applied)
            self.sums["spikes"] += verdict.spike.float()
        return applied

    def count(self, applied: torch.Tensor) -> None:
        sums = self.sums
        sums["bad"] += (~applied).float()
        self._bad_run.copy_((self._bad_run + 1) * (~applied).float())
        sums["max_bad_run"].copy_(torch.maximum(sums["max_bad_run"], self._bad_run))

    def tally(self, host: dict[str, float]) -> dict[str, int]:
        """Add a log interval's counts (`sums` read on the host) to the run's totals; returns
        the train record's fields."""
        self.skipped_total += int(round(host["bad"]))
        self.spike_total += int(round(host["spikes"]))
        return {"skipped_steps": self.skipped_total, "spike_steps": self.spike_total}

    def check(self, host: dict[str, float], save: Callable[[], Path]) -> None:
        """`train.max_bad_steps` consecutive skips in the interval: `save`, then raise
        TrainingStopped (on every rank: `host` is the same on all)."""
        if host["max_bad_run"] < self.max_bad_steps:
            return
        path = save()
        why = "a non-finite loss or gradient"
        if host["spikes"]:
            why += f" or a loss spike ({int(host['spikes'])} since the last log)"
        raise TrainingStopped(
            f"{int(host['max_bad_run'])} consecutive steps were skipped for {why} "
            f"(train.max_bad_steps = {self.max_bad_steps}); saved {path} and stopped. Lower "
            f"train.lr or check the data."
        )
