"""Bad-step accounting as the trainer's step drives it (judge -> settle -> count, then a log
step's tally and check): which steps are applied, what a log step reads, and the stop after
`train.max_bad_steps` consecutive skips, also when they span a log step."""

from pathlib import Path

import pytest
import torch

from moetrain.config.presets import tiny
from moetrain.parallel.mesh import ParallelDims
from moetrain.train.bad_steps import BadSteps
from moetrain.train.stopping import TrainingStopped

NAN, INF = float("nan"), float("inf")


def _bad_steps(*overrides: str) -> BadSteps:
    one_process = ParallelDims(device=torch.device("cpu"))
    return BadSteps(tiny().with_overrides(list(overrides)).train, one_process)


def _steps(bad: BadSteps, losses_and_norms) -> list[bool]:
    """Which steps were applied, each (loss, gradient norm) through the step's calls."""
    applied = []
    for loss, grad_norm in losses_and_norms:
        verdict = bad.judge(torch.tensor(loss))
        ok = bad.settle(verdict, torch.tensor(grad_norm))
        bad.count(ok)
        applied.append(bool(ok))
    return applied


def _log(bad: BadSteps) -> dict[str, float]:
    """What a log step reads; it zeroes the sums (train/train_record.py)."""
    host = {k: v.item() for k, v in bad.sums.items()}
    for v in bad.sums.values():
        v.zero_()
    return host


def _no_save() -> Path:
    pytest.fail("saved below train.max_bad_steps")


def test_non_finite_steps_are_skipped_and_a_run_of_them_stops_after_a_save():
    bad = _bad_steps("train.max_bad_steps=3")
    assert _steps(bad, [(2.0, 1.0), (NAN, 1.0), (2.0, INF)]) == [True, False, False]
    host = _log(bad)
    assert host == {"bad": 2.0, "spikes": 0.0, "max_bad_run": 2.0}
    assert bad.tally(host) == {"skipped_steps": 2, "spike_steps": 0}
    bad.check(host, _no_save)  # two in a row: the run goes on
    assert _steps(bad, [(INF, 1.0)]) == [False]  # the third in a row, after the log step
    host = _log(bad)
    assert host["max_bad_run"] == 3.0 and bad.tally(host)["skipped_steps"] == 3
    with pytest.raises(TrainingStopped, match=r"^3 consecutive .* non-finite loss or gradient "
                       r"\(train.max_bad_steps = 3\); saved step-4 and stopped"):  # fmt: skip
        bad.check(host, lambda: Path("step-4"))


def test_a_loss_spike_is_skipped_and_kept_out_of_the_window():
    bad = _bad_steps("train.spike_sigma=3", "train.spike_window=4", "train.max_bad_steps=2")
    window = [2.0, 2.1, 1.9, 2.0]
    assert _steps(bad, [(loss, 1.0) for loss in window]) == [True] * 4  # the window is full
    assert _steps(bad, [(20.0, 1.0), (2.05, 1.0)]) == [False, True]
    assert bad.spikes.losses_W.tolist() == pytest.approx([2.05, *window[1:]])  # no 20.0
    host = _log(bad)
    assert (host["bad"], host["spikes"]) == (1.0, 1.0)
    assert bad.tally(host) == {"skipped_steps": 1, "spike_steps": 1}
    bad.check(host, _no_save)
    assert _steps(bad, [(20.0, 1.0), (25.0, 1.0)]) == [False, False]
    with pytest.raises(TrainingStopped, match=r"or a loss spike \(2 since the last log\)"):
        bad.check(_log(bad), lambda: Path("step-8"))
