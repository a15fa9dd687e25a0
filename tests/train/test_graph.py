"""Which runs the whole-step CUDA graph takes (the capture itself is tested on the H200:
tests/gpu/test_gpu_core.py)."""

from types import SimpleNamespace

import pytest
import torch

from moetrain.config.presets import tiny
from moetrain.train.graph import StepGraph

CUDA = torch.device("cuda")


@pytest.mark.parametrize(
    ("overrides", "world_size", "device", "kernel", "reason"),
    [
        ([], 1, CUDA, "triton", None),
        ([], 1, torch.device("cpu"), "triton", "CUDA device"),
        (["moe.routing=random"], 1, CUDA, "triton", "random routing"),
        (
            ["precision.experts=fp8_rowwise", "precision.linear=fp8_rowwise"],
            1,
            CUDA,
            "triton",
            None,
        ),
        (["train.optimizer=sharded"], 1, CUDA, "torch", "Triton kernel"),
        (["train.optimizer=muon"], 1, CUDA, "triton", None),
        (["train.optimizer=muon_sharded"], 1, CUDA, "torch", "Triton kernel"),
        (["precision.param_dtype=fp32", "parallel.compile=false"], 1, CUDA, "triton", "fp32"),
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


NO_SYNC = ["parallel.ep=2", "moe.capacity_factor=2"]  # auto: no_sync on CUDA


@pytest.mark.parametrize(
    ("overrides", "backend", "nccl", "env", "reason"),
    [
        (NO_SYNC, "nccl", (2, 21, 5), {}, None),
        ([], "nccl", (2, 21, 5), {}, None),  # data parallel only: the local dispatcher
        (NO_SYNC, "gloo", (2, 21, 5), {}, "gloo"),
        (["parallel.ep=2"], "nccl", (2, 21, 5), {}, "all_to_all"),  # auto without a capacity
        ([*NO_SYNC, "moe.dispatcher=all_to_all"], "nccl", (2, 21, 5), {}, "all_to_all"),
        ([*NO_SYNC, "parallel.data_parallel=fsdp"], "nccl", (2, 21, 5), {}, "FSDP"),
        ([*NO_SYNC, "train.optimizer=sharded"], "nccl", (2, 21, 5), {}, "Triton kernel"),
        (NO_SYNC, "nccl", (2, 21, 5), {"TORCH_NCCL_BLOCKING_WAIT": "1"}, "BLOCKING_WAIT"),
        (NO_SYNC, "nccl", (2, 9, 5), {}, "NCCL 2.9.5"),
    ],
)
def test_multi_process_graphs_need_nccl_and_static_shapes(
    overrides, backend, nccl, env, reason, monkeypatch
):
    """World size 2 on CUDA (which this machine need not have: the NCCL version is stubbed)."""
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: nccl)
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = tiny().with_overrides(overrides)
    dims = SimpleNamespace(world_size=2, ep=config.parallel.ep, device=CUDA)
    got = StepGraph.unsupported_reason(config, dims, CUDA, "triton", backend)
    assert got is None if reason is None else reason in got, got
