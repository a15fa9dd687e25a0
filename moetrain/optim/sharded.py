"""ShardedAdamW: a ZeRO-1 distributed AdamW with fp32 master weights and global-norm clipping.

Parameters live in flat buckets of one sync kind (optim/buckets.py): dense and router parameters
sync over `dense_group` (all data-parallel ranks), experts over `expert_group` (the replicas of
the same experts). Rank r of a group owns the r-th shard of each bucket and keeps only that
shard's master and moments, so every element is owned by exactly one rank of the data-parallel
world. Every collective is launched in bucket order on every rank. At world size 1 a step is
`torch.optim.AdamW` after `torch.nn.utils.clip_grad_norm_` (only the norm's summation order
differs). Checkpoints hold each rank's shards as chunks of the global tensors
(optim/sharded_state.py) and load under any layout. `AdamWShards` is the state and update
without the gradient protocol, for an owner that runs one protocol over other buckets too (the
sharded Muon, optim/muon_sharded.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from moetrain.dist_compat import all_gather_flat, group_size, reduce_scatter_flat
from moetrain.moe.experts import GroupedExperts
from moetrain.optim.buckets import (
    Bucket,
    GlobalSlices,
    Piece,
    global_layouts,
    make_buckets,
    param_entries,
)
from moetrain.optim.clip import EXPERT, clip_coefficient
from moetrain.optim.grad_buckets import BucketedGrads
from moetrain.optim.sharded_state import ShardState, copy_chunks, shard_state

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


def expert_global_slices(model: nn.Module, num_experts: int) -> dict[str, tuple[tuple, slice]]:
    """`global_slices` for ShardedAdamW: each GroupedExperts weight holds rows
    `expert_offset : expert_offset + local experts` of a (num_experts, ...) global tensor."""
    slices = {}
    for module_name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            for param_name, param in module.named_parameters(recurse=False):
                offset = module.expert_offset
                name = f"{module_name}.{param_name}" if module_name else param_name
                rows = slice(offset, offset + param.shape[0])
                slices[name] = ((num_experts, *param.shape[1:]), rows)
    return slices


class AdamWShards:
    """The ZeRO-1 AdamW state and update of ShardedAdamW (module docstring), without the
    gradient protocol: its buckets are reduce-scattered by an owner (`reduce_scatter_bucket`).

    `param_groups`: `build_param_groups` output. `expert_grad_divisor`: expert gradients are
    summed over `expert_group` and divided by this (the trainer passes dp: a local expert gradient
    already sums its ep group). `grad_dtype`: the dtype gradients accumulate and are reduced in
    (None: the parameter's, view mode; wider: accumulate mode; optim/grad_buckets.py).
    `global_slices`: name -> (global shape, rows of dim 0 held here) of the parameters expert
    parallelism slices. `pp_group`: sums the norm over pipeline stages. `param_order`: names in
    forward order (default: their order in the groups).
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        *,
        dense_group: ProcessGroup | None,
        expert_group: ProcessGroup | None,
        expert_grad_divisor: int = 1,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        bucket_mb: float = 25.0,
        master_dtype: torch.dtype = torch.float32,
        grad_dtype: torch.dtype | None = None,
        global_slices: GlobalSlices | None = None,
        pp_group: ProcessGroup | None = None,
        param_order: Sequence[str] | None = None,
    ) -> None:
        assert expert_grad_divisor >= 1 and (dense_group is not None or expert_group is None)
        # A group of one rank needs no communication: treat it as None.
        dense_group, expert_group, pp_group = (
            g if group_size(g) > 1 else None for g in (dense_group, expert_group, pp_group)
        )
        self.lr, self.betas, self.eps = lr, betas, eps
        self.dense_group, self.expert_group, self.pp_group = dense_group, expert_group, pp_group
        self.groups = [
            {"weight_decay": g["weight_decay"], "lr_mult": g.get("lr_mult", 1.0)}
            for g in param_groups
        ]

        entries = param_entries(param_groups, param_order)
        slices = global_slices or {}
        self._layout = global_layouts(entries, slices)
        ep = group_size(dense_group) // group_size(expert_group)
        for name, _, _, kind in entries:
            assert kind != EXPERT or ep == 1 or name in slices, f"{name}: no global slice"
        sync = {
            "dense": (dense_group, float(group_size(dense_group))),
            EXPERT: (expert_group, float(expert_grad_divisor)),
        }
        self.buckets = make_buckets(entries, sync, bucket_mb * 2**20, master_dtype, grad_dtype)
        device = self.buckets[0].master.device if self.buckets else torch.device("cpu")
        # Steps applied, on the device (skips are decided there). float32 as torch's fused AdamW
        # keeps it: its CUDA kernel reads a float64 step as garbage (NaN); counts < 2**24 are exact.
        self.step_count = torch.zeros((), dtype=torch.float32, device=device)
        self._where = {name: (b, i) for b in self.buckets for i, name in enumerate(b.names)}

    # ---- the step, in phases ------------------------------------------------------------------
    def owned_grad_square(self) -> torch.Tensor:
        """This rank's part of the squared global gradient norm (after the reduce-scatters): its
        owned shards, each divided by its averaging divisor. Owned shards partition every sync
        group and every ep rank holds different experts, so one sum over the data-parallel world
        counts each element once."""
        squares = [
            (torch.linalg.vector_norm(b.grad_shard, dtype=torch.float32) / b.divisor).square()
            for b in self.buckets
        ]
        return torch.stack(squares).sum() if squares else self.step_count.new_zeros(())

    def global_norm(self, owned_square: torch.Tensor) -> torch.Tensor:
        """The global norm from every rank's `owned_square` (summed over dp and pp)."""
        for group in (self.dense_group, self.pp_group):
            if group is not None:
                dist.all_reduce(owned_square, group=group)
        return owned_square.sqrt()

    @torch.no_grad()
    def update(
        self,
        lr: float | torch.Tensor,
        total_norm: torch.Tensor,
        max_grad_norm: float | None,
        skip: torch.Tensor | None,
    ) -> None:
        """Clip to `max_grad_norm` by `total_norm` (None or 0: no clipping), update the owned
        shards unless `skip` (a device bool) or a non-finite norm, and all-gather the
        parameters."""
        clip = clip_coefficient(total_norm, max_grad_norm) if max_grad_norm else None
        if skip is not None:
            skip = skip | ~torch.isfinite(total_norm)
            self.step_count += (~skip).float()
        else:
            self.step_count += 1

        # (3) torch's fused AdamW on each owned fp32 shard (it divides by grad_scale as it reads
        #     and skips all when found_inf is nonzero), then (4) launch the shard's all-gather in
        #     the training dtype, so bucket i's gather overlaps bucket i+1's update.
        beta1, beta2 = self.betas
        found_inf = None if skip is None else skip.float()
        gathers = []
        for bucket in self.buckets:
            grad = bucket.grad_shard.to(torch.float32)
            grad_scale = None
            if bucket.divisor != 1 or clip is not None:  # grad / divisor * clip
                grad_scale = torch.full((), float(bucket.divisor), device=grad.device)
                if clip is not None:
                    grad_scale = grad_scale / clip
            runs_by_group: dict[int, list[slice]] = {}
            for lo, hi, group_index in bucket.runs:
                runs_by_group.setdefault(group_index, []).append(slice(lo, hi))
            for group_index, runs in runs_by_group.items():  # one multi-tensor launch per group
                torch._fused_adamw_(
                    [bucket.master[r] for r in runs],
                    [grad[r] for r in runs],
                    [bucket.exp_avg[r] for r in runs],
                    [bucket.exp_avg_sq[r] for r in runs],
                    [],
                    [self.step_count] * len(runs),
                    lr=lr * self.groups[group_index]["lr_mult"],
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=self.groups[group_index]["weight_decay"],
                    eps=self.eps,
                    amsgrad=False,
                    maximize=False,
                    grad_scale=grad_scale,
                    found_inf=found_inf,
                )
            gathers.append(self._launch_gather(bucket))

        # (5) Wait for the gathers: every parameter holds its new value on every rank.
        finish_gathers(gathers, [p for b in self.buckets for p in b.params])

    @staticmethod
    def _launch_gather(bucket: Bucket):
        return gather_params(bucket, bucket.master)

    def state_bytes_per_rank(self) -> int:
        """Bytes of optimizer state this rank holds: master copy and both moments of its shards."""
        return sum(
            t.numel() * t.element_size()
            for b in self.buckets
            for t in (b.master, b.exp_avg, b.exp_avg_sq)
        )

    # ---- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """{"step": int, "state": {global name: {"master", "exp_avg", "exp_avg_sq": ShardState of
        the global shape}}}: views of this rank's owned shards, nothing copied and no collective
        (optim/sharded_state.py). DCP loads into the same structure in place under any layout;
        then call `load_state_dict`."""
        state = {
            name: {key: self._shard_state(name, getattr(bucket, key)) for key in STATE_KEYS}
            for name, (bucket, _) in self._where.items()
        }
        return {"step": int(self.step_count.item()), "state": state}

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the state, then set the parameters from the masters (an all-gather, the only
        collective). Each tensor is a ShardState of this layout (`state_dict()` filled by DCP:
        nothing left to copy) or a plain global tensor, of which each rank copies the pieces it
        owns. Without a "master" entry a parameter's current value becomes its master."""
        self.step_count.fill_(int(state_dict["step"]))
        saved = state_dict["state"]
        for name, (bucket, index) in self._where.items():
            if name not in saved:
                raise ValueError(f"optimizer state has no entry for parameter {name}")
            global_shape, _ = self._layout[name]
            for key in STATE_KEYS:
                if key not in saved[name] and key == "master":
                    self._reset_master(bucket, index)
                    continue
                if key not in saved[name]:
                    raise ValueError(f"optimizer state of {name} has no {key!r}")
                tensor = saved[name][key]
                if tuple(tensor.shape) != tuple(global_shape):
                    raise ValueError(
                        f"optimizer state {name}.{key} has shape {tuple(tensor.shape)}, "
                        f"expected the global shape {tuple(global_shape)}"
                    )
                if isinstance(tensor, ShardState):
                    copy_chunks(tensor, self._shard_state(name, getattr(bucket, key)))
                    continue
                flat, shard = tensor.reshape(-1), getattr(bucket, key)
                for start, lo, hi in self._owned_ranges(name):
                    shard[lo:hi] = flat[start : start + hi - lo]
        finish_gathers(
            [self._launch_gather(bucket) for bucket in self.buckets],
            [p for b in self.buckets for p in b.params],
        )

    def _owned_ranges(self, name: str) -> list[tuple[int, int, int]]:
        """(start in the flattened global tensor, lo, hi in the bucket's shard) of each piece of
        parameter `name` that this rank owns (at most one: a parameter and a shard are both
        contiguous in the bucket)."""
        bucket, index = self._where[name]
        global_shape, first_row = self._layout[name]
        base = first_row * math.prod(global_shape[1:])
        return [(base + p.param_lo, p.lo, p.hi) for p in self._pieces_of(bucket, index)]

    def _shard_state(self, name: str, shard: torch.Tensor) -> ShardState:
        return shard_state(self._layout[name][0], shard, self._owned_ranges(name))

    @torch.no_grad()
    def reset_masters(self) -> None:
        """Copy the parameters into the master weights (after loading weights from elsewhere)."""
        for bucket in self.buckets:
            for index in range(len(bucket.params)):
                self._reset_master(bucket, index)

    @staticmethod
    def _reset_master(bucket: Bucket, index: int) -> None:
        for piece in AdamWShards._pieces_of(bucket, index):
            start = bucket.shard_lo + piece.lo
            bucket.master[piece.lo : piece.hi] = bucket.params_flat[
                start : start + piece.hi - piece.lo
            ]

    @staticmethod
    def _pieces_of(bucket: Bucket, index: int) -> list[Piece]:
        return [piece for piece in bucket.pieces if piece.index == index]


class ShardedAdamW(AdamWShards, BucketedGrads):
    """ZeRO-1 AdamW (module docstring). Per step: every backward but the last under
    `no_sync()` (the last one's hooks launch the reduce-scatters), then `step()` (waits, clips,
    updates, all-gathers), then `zero_grad()`. Arguments: `AdamWShards`'s."""

    def __init__(self, param_groups: list[dict[str, Any]], **kwargs: Any) -> None:
        AdamWShards.__init__(self, param_groups, **kwargs)
        self._init_buckets(self.buckets)

    def _launch(self, bucket: Bucket):
        return reduce_scatter_bucket(bucket)

    def finish_grad_sync(self) -> None:
        """Launch the reduce-scatters the backward hooks have not launched (unused parameters,
        gradients assigned by hand) and wait for all of them. Idempotent within a step."""
        self.launch_remaining()
        self.wait()

    @torch.no_grad()
    def step(
        self,
        lr: float | None = None,
        max_grad_norm: float | None = None,
        *,
        skip: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One AdamW step at `lr` (x each group's lr_mult; None: the constructor's), clipping the
        global norm to `max_grad_norm` (None or 0: no clipping); returns the norm before clipping,
        on the device. Where `skip` (a device bool) is true or the norm is not finite, the step
        changes nothing (parameters, moments, step count), without a host sync."""
        # (1) Reduce-scatter: launch what backward has not launched, wait for everything. Each
        #     rank now holds the summed gradient of its shard of every bucket.
        self.finish_grad_sync()
        # (2) Global grad norm, then (3)-(5) in `update`.
        total_norm = self.global_norm(self.owned_grad_square())
        self.update(self.lr if lr is None else lr, total_norm, max_grad_norm, skip)
        self.end_step(unwritten=False)  # accumulate mode: zero_grad marks them
        return total_norm

    @torch.no_grad()
    def zero_grad(self) -> None:
        self.wait()  # nothing may still be reading the buffers
        zero_bucket_grads(self.buckets)
        self.end_step()


def reduce_scatter_bucket(bucket: Any):
    """Launch the reduce-scatter of a sharded bucket's gradients into its `grad_shard` (None
    for a bucket without a group: its shard is a view of the gradients)."""
    if bucket.group is None:
        return None
    return reduce_scatter_flat(
        bucket.grad_shard, bucket.grads_flat, group=bucket.group, async_op=True
    )


def gather_params(bucket: Any, owned: torch.Tensor):
    """Launch the all-gather of every rank's `owned` values (its master shard) into the
    bucket's parameters, in the training dtype (a copy without a group)."""
    if bucket.group is None:
        bucket.params_flat[bucket.shard_lo : bucket.shard_lo + owned.numel()].copy_(owned)
        return None
    bucket.staging.copy_(owned)
    return all_gather_flat(bucket.params_flat, bucket.staging, group=bucket.group, async_op=True)


def finish_gathers(gathers: Sequence[Any], params: Sequence[torch.Tensor]) -> None:
    """Wait for the parameter all-gathers, then bump every parameter's version counter: they
    wrote through bucket views whose counters the parameters do not share, and autograd's
    check of tensors saved for backward must see the change."""
    for work in gathers:
        if work is not None:
            work.wait()
    torch.autograd.graph.increment_version(list(params))


def zero_bucket_grads(buckets: Sequence[Any]) -> None:
    """Zero every gradient of sharded buckets: view-mode buckets are zeroed; accumulate-mode
    slots are marked unwritten by the owner's `end_step` (the next backward copies instead of
    adding)."""
    for bucket in buckets:
        if not bucket.accumulate:
            bucket.grads_flat.zero_()
        for index, param in enumerate(bucket.params):
            param.grad = None if bucket.accumulate else bucket.grad_view(index)
