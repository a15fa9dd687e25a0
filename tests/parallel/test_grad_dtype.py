"""Gradients of bf16 parameters accumulate over micro-batches and are reduced over ranks in fp32
(precision.grad_dtype, the default): each micro-batch's bf16 gradient is added into an fp32
buffer, exactly as an fp32 sum of the bf16 gradients would be, and the all-reduce runs in fp32.
Accumulating in bf16 rounds every partial sum, and the tests check that it is measurably worse."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed
from torch import nn

from moetrain.config import ParallelConfig
from moetrain.config.presets import tiny
from moetrain.parallel import GradientSync, init_distributed
from moetrain.train.optimizer_build import resolve_grad_dtype

MICRO = 8


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)).to(torch.bfloat16)


def _micro_batches(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 64, generator=generator).to(torch.bfloat16) for _ in range(MICRO)]


def _bf16_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (model(x).float().square().mean() / MICRO).backward()
    return [p.grad.clone() for p in model.parameters()]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _accumulate(rank: int, world_size: int) -> list[list[torch.Tensor]]:
    """Run MICRO micro-batches through GradientSync(grad_dtype) and through a twin; return the
    synced gradients, the exact fp32 sum, the fp64 sum and the bf16 running sum of the twin."""
    config = tiny().with_overrides([f"parallel.dp={world_size}"]) if world_size > 1 else tiny()
    dims = init_distributed(config, "cpu")
    model = _model(0)
    twin = copy.deepcopy(model)
    sync = GradientSync(model, dims, grad_dtype=torch.float32)
    batches = _micro_batches(100 + rank)
    fp32_sum = fp64_sum = bf16_sum = None
    for i, x in enumerate(batches):
        if i < MICRO - 1:
            with sync.no_sync():
                (model(x).float().square().mean() / MICRO).backward()
        else:
            (model(x).float().square().mean() / MICRO).backward()
        grads = _bf16_grads(twin, x)
        fp32_sum = [g.float() for g in grads] if fp32_sum is None else [s + g.float() for s, g in zip(fp32_sum, grads, strict=True)]  # fmt: skip
        fp64_sum = [g.double() for g in grads] if fp64_sum is None else [s + g.double() for s, g in zip(fp64_sum, grads, strict=True)]  # fmt: skip
        bf16_sum = grads if bf16_sum is None else [s + g for s, g in zip(bf16_sum, grads, strict=True)]  # fmt: skip
    assert all(p.grad is None for p in model.parameters()), "bf16 .grad not moved into fp32"
    sync.finish()
    synced = [p.main_grad.clone() for p in model.parameters()]
    assert all(g.dtype == torch.float32 for g in synced)
    if world_size > 1:  # the mean over ranks, reduced in fp32 / fp64 / bf16
        for sums in (fp32_sum, fp64_sum, bf16_sum):
            for s in sums:
                dist.all_reduce(s)
                s.div_(world_size)
    return [synced, fp32_sum, fp64_sum, bf16_sum]


def _world2(rank: int, world_size: int) -> tuple[float, float]:
    synced, fp32_sum, fp64_sum, bf16_sum = _accumulate(rank, world_size)
    for got, want in zip(synced, fp32_sum, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)  # gloo's summation order
    fp32_err = max(_rel(g, r) for g, r in zip(synced, fp64_sum, strict=True))
    bf16_err = max(_rel(g, r) for g, r in zip(bf16_sum, fp64_sum, strict=True))
    return fp32_err, bf16_err


@pytest.mark.distributed
def test_fp32_accumulation_and_all_reduce_over_two_ranks():
    for fp32_err, bf16_err in run_distributed(_world2, 2):
        assert fp32_err < 1e-6 and bf16_err > 100 * fp32_err, (fp32_err, bf16_err)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], None),  # one micro-batch, one rank: nothing to accumulate
        (["train.global_batch_tokens=2048"], torch.float32),  # 4 micro-batches of 8 x 64
        (["train.global_batch_tokens=2048", "precision.grad_dtype=bf16"], None),
        (["train.optimizer=sharded"], torch.float32),
    ],
)
def test_resolve_grad_dtype(overrides, expected):
    config = tiny().with_overrides(["train.seq_len=64", *overrides])
    dims = init_distributed(config, "cpu")
    model = nn.Linear(8, 8).to(torch.bfloat16)
    assert resolve_grad_dtype(model, config, dims) == expected
    assert resolve_grad_dtype(model.float(), config, dims) is None  # fp32 parameters
    assert ParallelConfig().data_parallel == "ddp"
