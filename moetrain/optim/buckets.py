"""Flat buckets of the distributed optimizer (optim/sharded.py): parameters of one sync kind,
dtype and device, in the order backward produces their gradients, padded to
`shards x SHARD_ALIGN` elements; rank r of the bucket's group owns the r-th contiguous shard.
Each parameter's `.data` (and `.grad` in view mode) becomes a view into the flat buffers, so
collectives run on the buckets without copies.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from moetrain.dist_compat import group_size
from moetrain.optim.clip import EXPERT
from moetrain.optim.grad_buckets import GradBucket, split_into_buckets

SHARD_ALIGN = 64  # shard sizes are multiples of this many elements (aligned collective chunks)

GlobalSlices = Mapping[str, tuple[Sequence[int], slice]]


@dataclass
class Piece:
    """The part of one parameter inside the owned shard: shard[lo:hi] == param.flat[param_lo:]."""

    index: int  # position of the parameter in its bucket
    lo: int
    hi: int
    param_lo: int


@dataclass(eq=False, kw_only=True)
class Bucket(GradBucket):
    """A GradBucket (grads_flat, slots, launch state) plus the parameters' flat buffer and this
    rank's shard of both, with its master copy and moments."""

    names: list[str]
    divisor: float  # the reduced gradient is divided by this (averaging)
    params_flat: torch.Tensor  # every parameter of the bucket, training dtype
    shard_lo: int  # where the owned shard starts in the flat buffers
    grad_shard: torch.Tensor  # reduce-scatter output (a view of grads_flat when unsharded)
    staging: torch.Tensor  # all-gather input, training dtype
    master: torch.Tensor  # owned shard, master dtype
    exp_avg: torch.Tensor  # owned shard, fp32
    exp_avg_sq: torch.Tensor  # owned shard, fp32
    pieces: list[Piece]
    runs: list[tuple[int, int, int]]  # (lo, hi, param group index), merged adjacent pieces


Entry = tuple[str, nn.Parameter, int, str]  # name, parameter, param group index, sync kind


def param_entries(
    param_groups: list[dict[str, Any]], param_order: Sequence[str] | None
) -> list[Entry]:
    """Every parameter with its group and sync kind, in forward order (`build_param_groups`
    output: names, kinds and `param_order` are the model's own)."""
    entries = []
    for group_index, group in enumerate(param_groups):
        assert group["kind"] in ("dense", "router", EXPERT), group["kind"]
        sync = EXPERT if group["kind"] == EXPERT else "dense"
        pairs = zip(group["param_names"], group["params"], strict=True)
        entries += [(n, p, group_index, sync) for n, p in pairs]
    if param_order is not None:
        position = {name: i for i, name in enumerate(param_order)}
        entries.sort(key=lambda entry: position[entry[0]])
    return entries


def global_layouts(entries: list[Entry], global_slices: GlobalSlices) -> dict[str, tuple]:
    """name -> (global shape, first row of dim 0 held here)."""
    layouts = {}
    for name, param, _, _ in entries:
        if name not in global_slices:
            layouts[name] = (tuple(param.shape), 0)
            continue
        shape, rows = global_slices[name]
        shape, start = tuple(shape), rows.start or 0
        stop = shape[0] if rows.stop is None else rows.stop
        assert (stop - start, *shape[1:]) == tuple(param.shape), (name, shape, rows, param.shape)
        layouts[name] = (shape, start)
    return layouts


def make_buckets(
    entries: list[Entry],
    sync: dict[str, tuple[ProcessGroup | None, float]],
    bucket_bytes: float,
    master_dtype: torch.dtype,
    grad_dtype: torch.dtype | None,
) -> list[Bucket]:
    """Buckets of one (sync kind, dtype, device) each, filled in reverse forward order (the
    order backward produces gradients) up to bucket_bytes; their order is the launch order."""
    members_of = split_into_buckets(
        list(reversed(entries)),
        key=lambda entry: (entry[3], entry[1].dtype, entry[1].device),
        nbytes=lambda entry: entry[1].numel() * entry[1].element_size(),
        size=bucket_bytes,
    )
    return [
        make_bucket(members, *sync[members[0][3]], master_dtype, grad_dtype)
        for members in members_of
    ]


def make_bucket(
    members: list[Entry],
    group: ProcessGroup | None,
    divisor: float,
    master_dtype: torch.dtype,
    grad_dtype: torch.dtype | None,
) -> Bucket:
    params = [param for _, param, _, _ in members]
    dtype, device = params[0].dtype, params[0].device
    grad_dtype = grad_dtype or dtype
    size, rank = group_size(group), 0 if group is None else dist.get_rank(group)
    starts = list(itertools.accumulate((p.numel() for p in params), initial=0))
    numel = starts.pop()
    shard = numel if size == 1 else math.ceil(numel / (size * SHARD_ALIGN)) * SHARD_ALIGN
    params_flat = torch.zeros(shard * size, dtype=dtype, device=device)
    grads_flat = torch.zeros(shard * size, dtype=grad_dtype, device=device)
    for param, start in zip(params, starts, strict=True):
        view = params_flat[start : start + param.numel()]
        view.copy_(param.detach().reshape(-1))
        param.data = view.view_as(param)
        param.grad = (
            grads_flat[start : start + param.numel()].view_as(param)
            if grad_dtype == dtype
            else None
        )

    lo = rank * shard
    grad_shard = grads_flat[lo : lo + shard] if size == 1 else torch.zeros_like(grads_flat[:shard])
    staging = grad_shard if grad_dtype == dtype else torch.zeros_like(params_flat[:shard])
    pieces = []
    for index, (param, start) in enumerate(zip(params, starts, strict=True)):
        a, b = max(start, lo), min(start + param.numel(), lo + shard)
        if a < b:
            pieces.append(Piece(index, a - lo, b - lo, a - start))
    runs: list[tuple[int, int, int]] = []
    for piece in pieces:
        group_index = members[piece.index][2]
        if runs and runs[-1][1] == piece.lo and runs[-1][2] == group_index:
            runs[-1] = (runs[-1][0], piece.hi, group_index)
        else:
            runs.append((piece.lo, piece.hi, group_index))
    return Bucket(
        params=params,
        names=[name for name, _, _, _ in members],
        starts=starts,
        group=group,
        divisor=divisor,
        accumulate=grad_dtype != dtype,
        params_flat=params_flat,
        grads_flat=grads_flat,
        shard_lo=lo,
        grad_shard=grad_shard,
        staging=staging,
        master=params_flat[lo : lo + shard].to(master_dtype, copy=True),
        exp_avg=torch.zeros(shard, dtype=torch.float32, device=device),
        exp_avg_sq=torch.zeros(shard, dtype=torch.float32, device=device),
        pieces=pieces,
        runs=runs,
    )
