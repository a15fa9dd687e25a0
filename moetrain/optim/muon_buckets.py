"""Whole-matrix buckets of the sharded Muon (optim/muon_sharded.py): each rank of a bucket's
group owns whole matrices, and the bucket's flat buffers are laid out owner by owner, so that one
reduce-scatter hands every rank the summed gradients of exactly its matrices and one all-gather
returns every rank's updated weights.

A bucket's flat buffer is `size` regions of `region` elements; rank r owns region r. Two kinds:
- dense matrices (attention, dense and shared MLPs; synced over dp): one bucket of all of them,
  each parameter whole in one region, assigned by greedy longest-processing-time over their
  Newton-Schulz FLOPs (largest first, each to the least loaded rank), regions padded to the
  largest;
- an expert weight (synced over the expert-data-parallel group): a bucket of its own, split by
  experts, ceil(experts / size) whole experts a region (equal shapes, so equal FLOPs).
Every parameter is contiguous in its bucket, so its `.data` (and `.grad` in view mode) is a view
of the flat buffers, as in optim/buckets.py, and the GradBucket protocol applies unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from moetrain.dist_compat import group_size
from moetrain.model.flops import newton_schulz_flops
from moetrain.optim.buckets import SHARD_ALIGN
from moetrain.optim.grad_buckets import GradBucket
from moetrain.optim.muon_params import MatrixLayout

MuonEntry = tuple[str, nn.Parameter, int, str, MatrixLayout]  # name, param, group, sync, layout


@dataclass
class OwnedPiece:
    """A part of one parameter this rank updates: `region[lo:hi]` viewed as `shape` is rows
    `first_row:` of dim 0 of parameter `slot` (the whole parameter, or some of its experts)."""

    slot: int
    lo: int
    hi: int
    shape: tuple[int, ...]
    first_row: int


@dataclass(eq=False, kw_only=True)
class MuonBucket(GradBucket):
    """A GradBucket plus the parameters' flat buffer, this rank's region of both, and the
    region's fp32 master and momentum."""

    names: list[str]
    layouts: list[MatrixLayout]
    group_indices: list[int]  # each parameter's param group
    divisor: float  # the reduced gradient is divided by this (averaging)
    params_flat: torch.Tensor
    shard_lo: int  # where this rank's region starts in the flat buffers
    grad_shard: torch.Tensor  # reduce-scatter output (a view of grads_flat without a group)
    staging: torch.Tensor  # all-gather input, training dtype
    master: torch.Tensor
    momentum: torch.Tensor
    owned: list[OwnedPiece]


def assign_by_flops(costs: Sequence[int], size: int) -> list[int]:
    """Greedy longest-processing-time: the owner rank of each item, the costliest first, each to
    the rank with the least cost so far (the lowest rank among equals)."""
    loads, owners = [0] * size, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        rank = min(range(size), key=lambda r: (loads[r], r))
        owners[i], loads[rank] = rank, loads[rank] + costs[i]
    return owners


def ns_cost(param: torch.Tensor, layout: MatrixLayout) -> int:
    rows, cols = layout.matrix_shape(param.shape)
    return layout.num_matrices(param.shape) * newton_schulz_flops(rows, cols, 1)


def dense_layout(members: Sequence[MuonEntry], size: int, rank: int) -> tuple[list, int, list]:
    """(start of each member in the flat buffer, region length, this rank's pieces): every
    member whole in its owner's region."""
    owners = assign_by_flops([ns_cost(m[1], m[4]) for m in members], size)
    fill = [0] * size
    offsets = []
    for member, owner in zip(members, owners, strict=True):
        offsets.append(fill[owner])
        fill[owner] += member[1].numel()
    region = max(fill) if size == 1 else math.ceil(max(fill) / SHARD_ALIGN) * SHARD_ALIGN
    starts = [owner * region + offset for owner, offset in zip(owners, offsets, strict=True)]
    pieces = [
        OwnedPiece(i, offset, offset + m[1].numel(), tuple(m[1].shape), 0)
        for i, (m, owner, offset) in enumerate(zip(members, owners, offsets, strict=True))
        if owner == rank
    ]
    return starts, region, pieces


def expert_layout(member: MuonEntry, size: int, rank: int) -> tuple[list, int, list]:
    """The same for one expert weight alone in its bucket: ceil(experts / size) whole experts
    a region, the last regions shorter or empty."""
    param = member[1]
    experts, inner = param.shape[0], math.prod(param.shape[1:])
    per_rank = math.ceil(experts / size)
    first, last = min(rank * per_rank, experts), min((rank + 1) * per_rank, experts)
    pieces = []
    if last > first:
        pieces.append(OwnedPiece(0, 0, (last - first) * inner, (last - first, *param.shape[1:]), first))  # fmt: skip
    return [0], per_rank * inner, pieces


def make_muon_bucket(
    members: Sequence[MuonEntry],
    group: ProcessGroup | None,
    divisor: float,
    grad_dtype: torch.dtype | None,
    experts: bool,
) -> MuonBucket:
    """A bucket of `members` (one expert weight if `experts`), its buffers allocated and the
    parameters' `.data` (and `.grad` in view mode) made views of them."""
    params = [m[1] for m in members]
    dtype, device = params[0].dtype, params[0].device
    grad_dtype = grad_dtype or dtype
    size, rank = group_size(group), 0 if group is None else dist.get_rank(group)
    layout = expert_layout if experts else dense_layout
    starts, region, owned = layout(members if not experts else members[0], size, rank)
    params_flat = torch.zeros(region * size, dtype=dtype, device=device)
    grads_flat = torch.zeros(region * size, dtype=grad_dtype, device=device)
    for param, start in zip(params, starts, strict=True):
        view = params_flat[start : start + param.numel()]
        view.copy_(param.detach().reshape(-1))
        param.data = view.view_as(param)
        param.grad = (
            grads_flat[start : start + param.numel()].view_as(param)
            if grad_dtype == dtype
            else None
        )
    lo = rank * region
    grad_shard = (
        grads_flat[lo : lo + region] if size == 1 else torch.zeros_like(grads_flat[:region])
    )
    return MuonBucket(
        params=params,
        starts=starts,
        group=group,
        accumulate=grad_dtype != dtype,
        grads_flat=grads_flat,
        names=[m[0] for m in members],
        layouts=[m[4] for m in members],
        group_indices=[m[2] for m in members],
        divisor=divisor,
        params_flat=params_flat,
        shard_lo=lo,
        grad_shard=grad_shard,
        staging=grad_shard if grad_dtype == dtype else torch.zeros_like(params_flat[:region]),
        master=params_flat[lo : lo + region].to(torch.float32, copy=True),
        momentum=torch.zeros(region, dtype=torch.float32, device=device),
        owned=owned,
    )


def make_muon_buckets(
    entries: Sequence[MuonEntry],
    sync: dict[str, tuple[ProcessGroup | None, float]],
    grad_dtype: torch.dtype | None,
) -> list[MuonBucket]:
    """The expert weights' buckets in the order backward fills them (`entries` in forward
    order), then one bucket of the dense matrices, which backward finishes last (the first
    layer's attention). `sync`: kind -> (group, divisor), as ShardedAdamW's."""
    dense = [e for e in entries if e[3] != "expert"]
    buckets = [
        make_muon_bucket([e], *sync["expert"], grad_dtype, experts=True)
        for e in reversed(entries)
        if e[3] == "expert"
    ]
    if dense:
        buckets.append(make_muon_bucket(dense[::-1], *sync["dense"], grad_dtype, experts=False))
    return buckets
