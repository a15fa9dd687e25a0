"""Expert parallelism as a model transform: keep this rank's slice of experts, swap the dispatcher.

`apply_ep` keeps experts [ep_rank * e, (ep_rank + 1) * e) of each MoE layer (e = num_experts /
ep); `experts.expert_offset` names them globally for `init_weights` and checkpoints. Names,
non-expert tensors and the router stay as they were. Build optimizers after parallelizing: the
expert parameters are new objects. For checkpoints, `globalize_experts` views each rank's experts,
resident or sharded again by FSDP2, as its part of the global tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from moetrain.config import RunConfig
from moetrain.moe.capacity import auto_dispatcher
from moetrain.moe.dispatch import Dispatcher, LocalDispatcher
from moetrain.moe.layer import MoELayer
from moetrain.optim.param_groups import param_kind
from moetrain.parallel.ep_dispatch import AllToAllDispatcher, NoSyncDispatcher
from moetrain.parallel.mesh import ParallelDims


def is_expert_param(name: str) -> bool:
    """Routed-expert weights: sharded over ep, replicated (and gradient-reduced) over edp."""
    return param_kind(name) == "expert"


def resolve_dispatcher(config: RunConfig, dims: ParallelDims) -> str:
    """moe.dispatcher "auto" resolved for this layout (`moe.capacity.auto_dispatcher`)."""
    choice = config.moe.dispatcher
    if choice == "auto":
        return auto_dispatcher(dims.ep, dims.device.type == "cuda", config.moe.capacity_factor)
    if choice == "local" and dims.ep > 1:
        raise ValueError(
            f"moe.dispatcher ('local') cannot move tokens between ranks; parallel.ep is {dims.ep}:"
            " use auto, all_to_all or no_sync"
        )
    return choice


def make_dispatcher(config: RunConfig, dims: ParallelDims) -> Dispatcher:
    """The dispatcher `moe.dispatcher` names for this layout, its rows in the activations' dtype
    (the precision plan installs `precision.dispatch`'s payload: parallel/precision.py)."""
    kind = resolve_dispatcher(config, dims)
    num_experts = config.moe.num_experts
    if kind == "local":
        return LocalDispatcher()
    if kind == "all_to_all":
        return AllToAllDispatcher(num_experts, dims.ep_group)
    return NoSyncDispatcher(
        num_experts, dims.ep_group, dims.ep_rank, config.moe.capacity_factor, device=dims.device
    )


def apply_ep(model: nn.Module, dims: ParallelDims, config: RunConfig) -> None:
    """Shard every MoE layer's experts over the ep axis and install the configured dispatcher
    (one instance per layer: dispatchers keep per-layer statistics)."""
    num_experts = config.moe.num_experts
    if num_experts % dims.ep:
        raise ValueError(f"parallel.ep ({dims.ep}) must divide moe.num_experts ({num_experts})")
    num_local = num_experts // dims.ep
    offset = dims.ep_rank * num_local
    for layer in model.modules():
        if not isinstance(layer, MoELayer):
            continue
        experts = layer.experts
        if experts.num_experts != num_local:
            assert experts.num_experts == num_experts, "apply_ep runs once, on a global model"
            for name in ("w_up_eD2F", "w_down_eFD"):
                full = getattr(experts, name)
                local = full.detach()[offset : offset + num_local].clone()
                setattr(experts, name, nn.Parameter(local, requires_grad=full.requires_grad))
            experts.num_experts = num_local
        experts.expert_offset = offset
        layer.dispatcher = make_dispatcher(config, dims)


def read_dispatch_stats(model: nn.Module, reset: bool = True) -> dict[str, torch.Tensor]:
    """Per-layer dispatcher statistics as device tensors, keyed "<module name>.<stat>"
    (e.g. "blocks.3.ffn.dropped_routes"). Layers whose dispatcher keeps none are skipped."""
    stats: dict[str, torch.Tensor] = {}
    for name, layer in model.named_modules():
        read = getattr(getattr(layer, "dispatcher", None), "read_stats", None)
        if isinstance(layer, MoELayer) and read is not None:
            for key, value in read(reset=reset).items():
                stats[f"{name}.{key}"] = value
    return stats


def globalize_experts(state: dict[str, Any], dims: ParallelDims) -> dict[str, Any]:
    """For checkpoints: this rank's expert slices as DTensors of the global experts on the
    (edp, ep) mesh, so DCP records global names and shapes and loads into any layout (see
    `global_expert_view`). Nested dicts (optimizer state by parameter name) are walked; every other
    value is the object it was. Identity when ep == 1."""
    if dims.ep == 1:
        return state
    mesh = dims.mesh["edp", "ep"]

    def wrap(name: str, value: Any, under_expert: bool) -> Any:
        expert = under_expert or is_expert_param(name)
        if isinstance(value, dict):
            return {k: wrap(k, v, expert) for k, v in value.items()}
        if expert and isinstance(value, torch.Tensor) and value.dim() == 3:
            return global_expert_view(value, mesh, dims.ep)
        return value

    return {k: wrap(k, v, False) for k, v in state.items()}


def global_expert_view(value: torch.Tensor, mesh: DeviceMesh, ep: int) -> DTensor:
    """This rank's experts `value` (apply_ep's slice, one tensor of experts x ...) as the global
    tensor they belong to, on the (edp, ep) mesh: Shard(0) over ep; over edp, Replicate for
    resident experts, or FSDP2's Shard(0) of the slice (`value` a DTensor on the edp mesh), taken
    after the ep split, which DTensor writes `_StridedShard(0, split_factor=ep)` (its placement
    for FSDP2 over tensor parallelism). The result views `value`'s memory: DCP loads in place."""
    if isinstance(value, DTensor):
        assert value.placements == (Shard(0),), f"FSDP2 experts placed {value.placements}"
        over_edp, local = _StridedShard(0, split_factor=ep), value.to_local()
    else:
        over_edp, local = Replicate(), value
    shape = torch.Size((value.shape[0] * ep, *value.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, mesh, [over_edp, Shard(0)], run_check=False, shape=shape, stride=stride
    )
