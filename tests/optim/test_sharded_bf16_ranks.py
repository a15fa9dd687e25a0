"""ZeRO-1 as the GPU runs it, on CPU ranks: bf16 parameters, fp32 gradient buckets, dp = 2.

Each rank accumulates two micro-batches per step into fp32 buckets, the buckets are
reduce-scattered, and the update must equal fp32 AdamW on the fp32 masters fed the mean over the
ranks of the fp32 sums of every micro-batch's bf16 gradient. A branch of the model goes unused on
one rank, or on both, in some steps: its slots are never written that step and must reach the
reduction as zeros, not as the previous step's gradient."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed
from torch import nn

from moetrain.optim.sharded import ShardedAdamW

pytestmark = pytest.mark.distributed

LR = 1e-2
# per step, the branches each rank uses: b unused on both ranks at step 1, on rank 1 at step 2
BRANCHES = [(("a", "b"), ("a", "b")), (("a",), ("a",)), (("a", "b"), ("a",)), (("a", "b"),) * 2]


def _loss(model: nn.ModuleDict, branches, x: torch.Tensor) -> torch.Tensor:
    return sum(model[name](x).float().square().sum() for name in branches)


def _train(rank: int, world_size: int) -> list[tuple[str, float]]:
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(8, 4), "b": nn.Linear(8, 6)}).to(torch.bfloat16)
    named = list(model.named_parameters())
    groups = [
        {
            "params": [p for _, p in named],
            "param_names": [n for n, _ in named],
            "kind": "dense",
            "weight_decay": 0.1,
            "lr_mult": 1.0,
        }
    ]
    optimizer = ShardedAdamW(
        groups,
        dense_group=dist.group.WORLD,
        expert_group=None,
        lr=LR,
        bucket_mb=1e-4,  # one bucket per parameter or so: several reduce-scatters
        grad_dtype=torch.float32,
    )
    masters = [p.detach().float().clone().requires_grad_() for _, p in named]
    reference = torch.optim.AdamW(masters, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(100 + rank)
    for branches in BRANCHES:
        mine = branches[rank]
        expected = [torch.zeros_like(m) for m in masters]
        for micro in range(2):
            x = torch.randn(6, 8, generator=generator).to(torch.bfloat16)
            with optimizer.no_sync() if micro == 0 else contextlib.nullcontext():
                _loss(model, mine, x).backward()
            grads = torch.autograd.grad(_loss(model, mine, x), [p for _, p in named], allow_unused=True)  # fmt: skip
            for e, g in zip(expected, grads, strict=True):
                if g is not None:
                    e += g.float()
        optimizer.step(LR)  # first: its reduce-scatters may be in flight on the same group
        optimizer.zero_grad()
        for e in expected:  # the mean over ranks, as the reduce-scatter and its divisor give
            dist.all_reduce(e)
            e /= world_size
        for m, e in zip(masters, expected, strict=True):
            m.grad = e
        reference.step()
        reference.zero_grad()
    state = optimizer.state_dict()["state"]
    errors = []
    for (name, p), m in zip(named, masters, strict=True):
        held = state[name]["master"]  # this rank's chunks of the global fp32 master
        master = torch.zeros(held.shape)
        for offsets, data in held.chunks():
            master[tuple(slice(o, o + n) for o, n in zip(offsets, data.shape, strict=True))] = data
        dist.all_reduce(master)
        assert torch.equal(p, master.to(torch.bfloat16)), name
        errors.append((name, ((master.double() - m.double()).norm() / m.double().norm()).item()))
    return errors


def test_bf16_params_fp32_buckets_over_two_ranks_match_fp32_adamw():
    for rank, errors in enumerate(run_distributed(_train, 2)):
        for name, error in errors:
            assert error < 1e-6, (rank, name, error)
