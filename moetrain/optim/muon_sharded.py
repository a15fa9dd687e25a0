"""The sharded Muon (train.optimizer=muon_sharded): ZeRO-1 for both halves. Muon's state is
sharded by whole matrices (optim/muon_buckets.py: a rank owns some dense matrices and some
experts of every expert weight, balanced by Newton-Schulz FLOPs), AdamW's by flat ranges
(`AdamWShards`, optim/sharded.py).

Gradients are reduce-scattered, not all-reduced: a Muon bucket is laid out owner by owner, so a
reduce-scatter gives each rank the summed gradient of exactly the matrices it orthogonalizes,
and the all-gather of the updated weights returns the rest. Per element and step a rank sends
(n-1)/n of a gradient and (n-1)/n of a weight (n the group's size), as ShardedAdamW does; an
all-reduce would send twice the gradient bytes. The price is padding: each dense bucket region is
as long as the longest (the greedy assignment balances FLOPs, which for equal shapes balances
bytes too), and a Muon bucket launches only once all its matrices have their gradients (the
dense one at the end of backward).

`ShardedMuon` runs one bucket protocol (optim/grad_buckets.py) over both halves' buckets, in the
order backward fills them, so every rank issues the same reduce-scatters in the same order. A
step: (1) finish the reduce-scatters, (2) one global norm over both halves' owned gradients,
(3) AdamW's update and gathers, (4) per Muon bucket: Muon on its owned pieces, launch its
all-gather (under the next bucket's orthogonalization), (5) wait. Checkpoints hold each rank's
pieces as chunks of the global tensors (optim/sharded_state.py), loadable under any layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed import ProcessGroup

from moetrain.dist_compat import group_size
from moetrain.optim.buckets import GlobalSlices, global_layouts, param_entries
from moetrain.optim.clip import EXPERT, clip_coefficient
from moetrain.optim.grad_buckets import BucketedGrads
from moetrain.optim.muon import MuonSettings, MuonTensor, muon_update_
from moetrain.optim.muon_buckets import MuonBucket, MuonEntry, OwnedPiece, make_muon_buckets
from moetrain.optim.muon_params import matrix_layout
from moetrain.optim.sharded import (
    AdamWShards,
    finish_gathers,
    gather_params,
    reduce_scatter_bucket,
    zero_bucket_grads,
)
from moetrain.optim.sharded_state import ShardState, copy_chunks, shard_state

MUON_STATE_KEYS = ("master", "momentum")


class MuonShards:
    """Muon's half of the sharded Muon: whole-matrix buckets of the Muon parameter groups
    (`split_param_groups`), their update and checkpoint state. Groups and divisors as
    ShardedAdamW's; `global_slices` and `param_order` likewise."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        settings: MuonSettings,
        *,
        dense_group: ProcessGroup | None,
        expert_group: ProcessGroup | None,
        expert_grad_divisor: int,
        grad_dtype: torch.dtype | None,
        global_slices: GlobalSlices | None,
        param_order: Sequence[str] | None,
    ) -> None:
        self.settings = settings
        self.hyper = [(g["lr_mult"], g["weight_decay"]) for g in param_groups]
        # a group of one rank needs no communication: treat it as None (as ShardedAdamW)
        dense_group, expert_group = (
            g if group_size(g) > 1 else None for g in (dense_group, expert_group)
        )
        entries = param_entries(param_groups, param_order)
        self._layout = global_layouts(entries, global_slices or {})
        muon_entries: list[MuonEntry] = [
            (name, p, gi, kind, matrix_layout(name, p.ndim)) for name, p, gi, kind in entries
        ]
        sync = {
            "dense": (dense_group, float(group_size(dense_group))),
            EXPERT: (expert_group, float(expert_grad_divisor)),
        }
        self.buckets = make_muon_buckets(muon_entries, sync, grad_dtype)
        self._where = {n: (b, i) for b in self.buckets for i, n in enumerate(b.names)}
        self._device = entries[0][1].device if entries else torch.device("cpu")

    def owned_grad_square(self) -> torch.Tensor:
        """This rank's part of the squared global norm: its regions' reduced gradients (zero
        where padded), each divided by the bucket's divisor."""
        squares = [
            (torch.linalg.vector_norm(b.grad_shard, dtype=torch.float32) / b.divisor).square()
            for b in self.buckets
        ]
        return torch.stack(squares).sum() if squares else torch.zeros((), device=self._device)

    @torch.no_grad()
    def update(
        self,
        lr: float | torch.Tensor,
        total_norm: torch.Tensor,
        max_grad_norm: float | None,
        skip: torch.Tensor,
    ) -> None:
        """Muon on every owned piece of each bucket, then launch the bucket's all-gather (it runs
        under the next bucket's orthogonalization); wait for all."""
        clip = clip_coefficient(total_norm, max_grad_norm) if max_grad_norm else None
        gathers = []
        for bucket in self.buckets:
            scale = 1.0 / bucket.divisor if clip is None else clip / bucket.divisor
            tensors = [self._tensor(bucket, piece) for piece in bucket.owned]
            muon_update_(tensors, lr, self.settings, skip=skip, grad_scale=scale)
            gathers.append(gather_params(bucket, bucket.master))
        finish_gathers(gathers, [p for b in self.buckets for p in b.params])

    def _tensor(self, bucket: MuonBucket, piece: OwnedPiece) -> MuonTensor:
        lr_mult, weight_decay = self.hyper[bucket.group_indices[piece.slot]]

        def view(flat: torch.Tensor) -> torch.Tensor:
            return flat[piece.lo : piece.hi].view(piece.shape)

        return MuonTensor(
            weight=view(bucket.master),
            grad=view(bucket.grad_shard),
            momentum=view(bucket.momentum),
            layout=bucket.layouts[piece.slot],
            lr_mult=lr_mult,
            weight_decay=weight_decay,
        )

    def state_bytes_per_rank(self) -> int:
        return sum(4 * (b.master.numel() + b.momentum.numel()) for b in self.buckets)

    # ---- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """{global name: {"master", "momentum": ShardState of the global shape}}: views of the
        pieces this rank owns (none for a matrix another rank owns), no collective."""
        return {
            name: {key: self._shard_state(name, getattr(b, key)) for key in MUON_STATE_KEYS}
            for name, (b, _) in self._where.items()
        }

    @torch.no_grad()
    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Each tensor a ShardState of this layout (`state_dict()` filled by DCP) or a plain
        global tensor, of which this rank copies the pieces it owns; without a "master" the
        parameter's value is its master. Then the parameters are gathered from the masters."""
        for name, (bucket, slot) in self._where.items():
            if name not in saved:
                raise ValueError(f"Muon's state has no entry for parameter {name}")
            global_shape = self._layout[name][0]
            for key in MUON_STATE_KEYS:
                tensor = saved[name].get(key)
                if tensor is None and key == "master":
                    self._reset_master(bucket, slot)
                    continue
                if tensor is None:
                    raise ValueError(f"Muon's state of {name} has no {key!r}")
                if tuple(tensor.shape) != tuple(global_shape):
                    raise ValueError(
                        f"Muon's state {name}.{key} has shape {tuple(tensor.shape)}, expected "
                        f"the global shape {tuple(global_shape)}"
                    )
                if isinstance(tensor, ShardState):
                    copy_chunks(tensor, self._shard_state(name, getattr(bucket, key)))
                    continue
                flat, region = tensor.reshape(-1), getattr(bucket, key)
                for start, lo, hi in self._owned_ranges(name):
                    region[lo:hi] = flat[start : start + hi - lo]
        self.gather_all()

    def gather_all(self) -> None:
        """Every parameter from its owner's master (after loading)."""
        gathers = [gather_params(b, b.master) for b in self.buckets]
        finish_gathers(gathers, [p for b in self.buckets for p in b.params])

    @torch.no_grad()
    def reset_masters(self) -> None:
        """Copy the parameters into the masters (after loading weights from elsewhere)."""
        for bucket, slot in self._where.values():
            self._reset_master(bucket, slot)

    def _pieces(self, name: str) -> list[OwnedPiece]:
        bucket, slot = self._where[name]
        return [piece for piece in bucket.owned if piece.slot == slot]

    def _reset_master(self, bucket: MuonBucket, slot: int) -> None:
        for piece in (p for p in bucket.owned if p.slot == slot):
            start = bucket.shard_lo + piece.lo
            bucket.master[piece.lo : piece.hi] = bucket.params_flat[
                start : start + piece.hi - piece.lo
            ]

    def _owned_ranges(self, name: str) -> list[tuple[int, int, int]]:
        """(start in the flattened global tensor, lo, hi in the region) of each owned piece."""
        global_shape, first_row = self._layout[name]
        inner = math.prod(global_shape[1:])
        return [
            ((first_row + piece.first_row) * inner, piece.lo, piece.hi)
            for piece in self._pieces(name)
        ]

    def _shard_state(self, name: str, region: torch.Tensor) -> ShardState:
        return shard_state(self._layout[name][0], region, self._owned_ranges(name))


class ShardedMuon(BucketedGrads):
    """The optimizer of train.optimizer=muon_sharded (module docstring): `adamw` and `muon`
    share one bucket protocol, ordered by `param_order` (names in forward order)."""

    def __init__(
        self,
        adamw: AdamWShards,
        muon: MuonShards,
        param_order: Sequence[str],
    ) -> None:
        self.adamw, self.muon = adamw, muon
        position = {name: i for i, name in enumerate(param_order)}
        # a bucket is complete once backward reaches its earliest parameter in forward order
        buckets = sorted(
            [*adamw.buckets, *muon.buckets],
            key=lambda b: -min(position[name] for name in b.names),
        )
        self._init_buckets(buckets)

    def _launch(self, bucket: Any) -> Any:
        return reduce_scatter_bucket(bucket)

    @property
    def kernel(self) -> str:
        return "torch"  # AdamW's half: torch's fused AdamW on the flat shards

    def finish_grad_sync(self) -> None:
        """Launch the reduce-scatters backward has not, and wait for all. Idempotent."""
        self.launch_remaining()
        self.wait()

    @torch.no_grad()
    def step(
        self,
        lr: float | torch.Tensor,
        max_grad_norm: float | None = None,
        *,
        skip: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step of both halves at `lr`, clipping the global norm to `max_grad_norm`;
        returns the norm before clipping, on the device. A true `skip` (device bool) or a
        non-finite norm changes nothing."""
        self.finish_grad_sync()
        owned = self.adamw.owned_grad_square() + self.muon.owned_grad_square()
        total_norm = self.adamw.global_norm(owned)
        bad = ~torch.isfinite(total_norm)
        skip = bad if skip is None else skip | bad
        self.adamw.update(lr, total_norm, max_grad_norm, skip)
        self.muon.update(lr, total_norm, max_grad_norm, skip)
        self.end_step(unwritten=False)
        return total_norm

    @torch.no_grad()
    def zero_grad(self) -> None:
        self.wait()
        zero_bucket_grads(self.buckets)
        self.end_step()

    def state_bytes_per_rank(self) -> int:
        return self.adamw.state_bytes_per_rank() + self.muon.state_bytes_per_rank()

    def state_dict(self) -> dict[str, Any]:
        """{"adamw": ShardedAdamW's state dict, "muon": MuonShards'}."""
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.adamw.load_state_dict(state["adamw"])
        self.muon.load_state_dict(state["muon"])

    def reset_masters(self) -> None:
        self.adamw.reset_masters()
        self.muon.reset_masters()
