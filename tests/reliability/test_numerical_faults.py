"""NaN/inf and loss spikes: the step is skipped on the device and counted; K in a row save and
stop; the spike detector matches a plain-Python reference, never syncs, and resumes exactly."""

import math
import statistics
from collections import deque

import numpy as np
import pytest
import torch
from _bench import harness, numerical
from conftest import run_distributed

from moetrain.config.presets import tiny
from moetrain.train.spike import LossSpikeDetector


def reference_spikes(losses: list[float], sigma: float, window: int) -> list[bool]:
    """The slow twin: a deque of the last `window` accepted losses, statistics from the stdlib."""
    recent: deque[float] = deque(maxlen=window)
    spikes = []
    for x in losses:
        spike = (
            len(recent) == window
            and math.isfinite(x)
            and x > statistics.fmean(recent) + sigma * statistics.pstdev(recent)
        )
        spikes.append(spike)
        if math.isfinite(x) and not spike:
            recent.append(x)
    return spikes


@pytest.mark.parametrize(("seed", "sigma", "window"), [(0, 3.0, 8), (1, 2.0, 5), (2, 4.0, 50)])
def test_detector_matches_the_reference(seed, sigma, window):
    rng = np.random.default_rng(seed)
    losses = 6.0 * np.exp(-np.arange(400) / 150) + rng.normal(0, 0.05, 400)  # a decaying curve
    factors = dict.fromkeys(rng.choice(400, 25, replace=False).tolist(), 1.0)
    for i in factors:
        factors[i] = rng.choice([1.5, 3.0, 10.0, float("nan"), float("inf")])
        losses[i] *= factors[i]
    losses = losses.astype(np.float32).tolist()
    detector = LossSpikeDetector(sigma, window, torch.device("cpu"))
    got = []
    for x in losses:
        loss = torch.tensor(x)
        spike = detector.is_spike(loss)
        detector.record(loss, ~spike & torch.isfinite(loss))
        got.append(bool(spike))
    expected = reference_spikes(losses, sigma, window)
    assert got == expected
    big = [i for i, f in factors.items() if f == 10.0 and i >= window + 5]
    assert big and all(got[i] for i in big)  # once the window is full, 10x spikes are caught


def test_detector_never_syncs_with_the_host(monkeypatch):
    """Reading a tensor's value on the host would stall a GPU pipeline: forbid every way to."""
    detector = LossSpikeDetector(3.0, 4, torch.device("cpu"))
    for name in ("item", "tolist", "numpy", "__bool__", "__float__", "__int__"):

        def forbidden(*args, _name=name, **kwargs):
            raise AssertionError(f"host sync: Tensor.{_name}")

        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for x in (5.0, 5.1, 4.9, 5.0, 5.05, 50.0, float("nan")):
        loss = torch.tensor(x)
        spike = detector.is_spike(loss)
        detector.record(loss, ~spike & torch.isfinite(loss))
    monkeypatch.undo()
    assert detector.count.item() == 5  # the spike (50) and the NaN were not recorded


def test_each_numerical_fault_is_skipped_counted_and_training_goes_on(tmp_path, module_cache):
    """An inf loss, a NaN loss, NaN gradients or a 10x loss spike at step 12: the weights do not
    change at that step, they change at the next, skipped_steps (and spike_steps) count it, and
    the run completes. Then 3 spikes or 3 inf losses in a row with max_bad_steps=3: step-14 is
    saved and TrainingStopped names the cause."""
    *single, stop = numerical.numerical_faults(tmp_path)
    assert [r.fault for r in single] == [
        "inf loss at one step",
        "nan loss at one step",
        "nan grad at one step",
        "spike at one step",
    ]
    assert all(r.survived == r.injected == 1 for r in single)
    assert (stop.injected, stop.survived) == (2, 2), stop.details
    assert "loss spike" in stop.details["spike"]
    assert "loss spike" not in stop.details["inf loss"]  # a non-finite loss is not a spike


def test_spike_detection_alone_changes_nothing(tmp_path, module_cache):
    """With no spike in the run, enabling detection leaves every loss bitwise the same."""
    harness.train_tiny(tmp_path / "off", 16)
    on = harness.train_tiny(tmp_path / "on", 16, *numerical.SPIKE)
    assert on.bad_steps.spike_total == 0 and int(on.bad_steps.spikes.count) == 16
    assert harness.losses(tmp_path / "on") == harness.losses(tmp_path / "off")


def test_the_loss_window_is_restored_on_resume(tmp_path, module_cache):
    """The window travels in trainer.json, so a resumed run judges later steps exactly as an
    uninterrupted one would: a 10x loss at step 10, two steps after the resume, is skipped by
    both (an empty window, filling again, would let it through)."""
    with numerical.poison("spike", {10}, []):
        full = harness.train_tiny(tmp_path / "full", 14, *numerical.SPIKE)
    harness.train_tiny(tmp_path / "part", 8, *numerical.SPIKE)
    with numerical.poison("spike", {2}, []):  # the resumed process's second step: step 10
        resumed = harness.train_tiny(tmp_path / "part", 14, *numerical.SPIKE)
    assert resumed.resumed_from.name == "step-8"
    assert full.bad_steps.spike_total == resumed.bad_steps.spike_total == 1
    assert harness.losses(tmp_path / "part") == harness.losses(tmp_path / "full")
    assert torch.equal(resumed.bad_steps.spikes.losses_W, full.bad_steps.spikes.losses_W)
    assert int(resumed.bad_steps.spikes.count) == int(full.bad_steps.spikes.count) == 13


def _spike_on_rank0(rank, world, run_dir, cache):
    import os

    os.environ["MOETRAIN_CACHE"] = cache
    from moetrain.train.trainer import Trainer

    config = tiny().with_overrides(
        [*harness.BASE, "train.steps=12", "train.micro_batch_size=4", *numerical.SPIKE]
    )
    trainer = Trainer(config, run_dir, progress=False)
    seen = []
    with numerical.poison("spike" if rank == 0 else "none", {11}, seen):
        trainer.train()
    unchanged = all(torch.equal(seen[10][k], seen[11][k]) for k in seen[10])
    return unchanged, trainer.bad_steps.spike_total, seen[-1]["embed.weight"]


@pytest.mark.distributed
def test_ranks_agree_on_a_spike_seen_by_one(tmp_path, module_cache):
    """Data parallelism over 2 processes, a spike in rank 0's micro-batch loss only: the global
    batch loss spikes, so both ranks skip the step and their replicas stay identical."""
    results = run_distributed(_spike_on_rank0, 2, str(tmp_path / "run"), str(module_cache))
    for unchanged, spikes, _ in results:
        assert unchanged and spikes == 1
    assert torch.equal(results[0][2], results[1][2])
