"""The bench's GPU-state sampler: summaries of NVML samples, the background sampling thread with
a fake reader, and nothing at all without a GPU."""

import threading

import pytest
import torch

from moetrain.tools.bench.gpu_state import (
    GpuStateSampler,
    Sample,
    describe,
    nvml_reader,
    summarize_samples,
)


def test_summary_of_samples():
    samples = [
        Sample(1980.0, 300.0, 0x0),
        Sample(1700.0, 699.0, 0x4),  # software power cap
        Sample(1650.0, 701.0, 0x80 | 0x1),  # hardware power brake (and idle bit)
        Sample(1900.0, 500.0, 0x40),  # thermal, not power
    ]
    s = summarize_samples(samples)
    assert s["samples"] == 4
    assert s["sm_clock_mhz_median"] == pytest.approx(1800.0)
    assert s["sm_clock_mhz_min"] == 1650.0
    assert s["power_w_mean"] == pytest.approx(550.0)
    assert s["power_w_max"] == 701.0
    assert s["power_limited_fraction"] == pytest.approx(0.5)
    line = describe(s)
    assert "1800 MHz median (lowest 1650)" in line and "power-limited in 50% of 4" in line
    assert summarize_samples([]) is None and describe(None) == ""


def test_sampler_polls_in_the_background_until_exit():
    calls, first = [], threading.Event()

    def reader():
        calls.append(threading.get_ident())
        first.set()
        return Sample(1000.0 + len(calls), 100.0, 0)

    with GpuStateSampler(reader, interval_s=0.001) as sampler:
        assert first.wait(5)
        while len(calls) < 3:
            first.wait(0.001)
    n = len(sampler.samples)
    assert n >= 3 and set(calls) != {threading.get_ident()}  # read on another thread
    assert len(sampler.samples) == n  # the thread has stopped
    assert sampler.summary() == summarize_samples(sampler.samples)


def test_a_failing_reader_stops_sampling_and_keeps_what_it_read():
    reads = []

    def reader():
        reads.append(1)
        if len(reads) == 3:
            raise RuntimeError("NVML went away")
        return Sample(1500.0, 200.0, 0x4)

    with GpuStateSampler(reader, interval_s=0.001) as sampler:
        sampler._thread.join(5)  # the thread ends by itself once the reader fails
    assert len(sampler.samples) == 2 and sampler.summary()["power_limited_fraction"] == 1.0


def test_no_gpu_means_no_samples():
    assert nvml_reader(torch.device("cpu")) is None
    with GpuStateSampler(None) as sampler:
        pass
    assert sampler.samples == [] and sampler.summary() is None
