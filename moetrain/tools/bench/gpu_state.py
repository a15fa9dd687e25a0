"""The GPU's clock and power while a system's timed steps run, sampled through NVML.

A step that keeps the tensor cores busy reaches the power limit and the driver lowers the SM
clock, so two systems compared in one job can run at different clocks. `GpuStateSampler` polls
NVML on a background thread (host-only calls) and summarizes median and lowest SM clock, mean and
highest power, and the share of samples with a power-related clock reduction. NVML's power is
board-averaged (about a second), so over short runs it trails the real draw. Without `pynvml` or
off CUDA the summary is None.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moetrain.tools.plan.layout import GPUS

# nvmlClocksEventReasonSwPowerCap | nvmlClocksEventReasonHwPowerBrakeSlowdown
POWER_REASONS = 0x4 | 0x80


@dataclass(frozen=True)
class Sample:
    sm_clock_mhz: float
    power_w: float
    reasons: int  # NVML clock-event reason bits


def nvml_reader(device: torch.device) -> Callable[[], Sample] | None:
    """A function that reads the current Sample of `device`, or None where NVML is unavailable."""
    if device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = torch.cuda.get_device_properties(device).uuid
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        reasons_fn = getattr(
            pynvml,
            "nvmlDeviceGetCurrentClocksEventReasons",
            getattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None),
        )
    except Exception:  # no pynvml, no driver access, an unknown device: sample nothing
        return None

    def read() -> Sample:
        return Sample(
            sm_clock_mhz=float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
            power_w=pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            reasons=int(reasons_fn(handle)) if reasons_fn is not None else 0,
        )

    return read


def summarize_samples(samples: list[Sample]) -> dict[str, Any] | None:
    if not samples:
        return None
    clocks = [s.sm_clock_mhz for s in samples]
    powers = [s.power_w for s in samples]
    return {
        "samples": len(samples),
        "sm_clock_mhz_median": statistics.median(clocks),
        "sm_clock_mhz_min": min(clocks),
        "power_w_mean": statistics.fmean(powers),
        "power_w_max": max(powers),
        "power_limited_fraction": sum(bool(s.reasons & POWER_REASONS) for s in samples)
        / len(samples),
    }


class GpuStateSampler:
    """with GpuStateSampler(reader) as sampler: ...timed work...; then sampler.summary()."""

    def __init__(self, reader: Callable[[], Sample] | None, interval_s: float = 0.02):
        self.reader, self.interval_s = reader, interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while True:
            try:
                self.samples.append(self.reader())
            except Exception:  # the device went away or NVML failed: keep what was read
                return
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> GpuStateSampler:
        if self.reader is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict[str, Any] | None:
        return summarize_samples(self.samples)


def describe(state: dict[str, Any] | None) -> str:
    """One line for the bench report, or "" without samples."""
    if not state:
        return ""
    return (
        f"SM clock {state['sm_clock_mhz_median']:.0f} MHz median (lowest "
        f"{state['sm_clock_mhz_min']:.0f}), power {state['power_w_mean']:.0f} W mean (highest "
        f"{state['power_w_max']:.0f}), power-limited in {100 * state['power_limited_fraction']:.0f}%"
        f" of {state['samples']} samples"
    )


def gpu_key(device: torch.device) -> str:
    """The plan.layout.GPUS key of this GPU ("NVIDIA H200" -> h200), else a ValueError."""
    name = torch.cuda.get_device_name(device).lower()
    for key in GPUS:
        if key in name.split() or f" {key}" in name:
            return key
    raise ValueError(f"no datasheet for {name!r} in moetrain.tools.plan.layout.GPUS")
