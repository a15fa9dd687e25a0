"""Which runs the whole-step CUDA graph takes (the capture itself is tested on the H200:
tests/gpu/test_gpu_core.py)."""

from types import SimpleNamespace

import pytest
import torch

from moetrain.presets import tiny
from moetrain.train.graph import StepGraph

CUDA = torch.device("cuda")


@pytest.mark.parametrize(
    ("overrides", "world_size", "device", "kernel", "reason"),
    [
        ([], 1, CUDA, "triton", None),
        ([], 1, torch.device("cpu"), "triton", "CUDA device"),
        ([], 2, CUDA, "triton", "multi-process"),
        (["moe.routing=random"], 1, CUDA, "triton", "random routing"),
        (["precision.experts=fp8_rowwise"], 1, CUDA, "triton", "FP8"),
        (["train.optimizer=sharded"], 1, CUDA, "torch", "Triton kernel"),
        ([], 1, CUDA, "torch", "Triton kernel"),
    ],
)
def test_unsupported_reason_names_what_blocks_the_graph(
    overrides, world_size, device, kernel, reason
):
    config = tiny().with_overrides(overrides)
    dims = SimpleNamespace(world_size=world_size)
    got = StepGraph.unsupported_reason(config, dims, device, kernel)
    assert got is None if reason is None else reason in got
