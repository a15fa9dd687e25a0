"""The optimizer of `train.optimizer` built for a parallelized model, with the dtype gradients
are reduced in and AdamW's update kernel: `adamw` (replicated over data parallelism; a
GradientSync all-reduces the gradients), `sharded` (ZeRO-1: it reduce-scatters them itself),
`muon` (Muon and the replicated AdamW over a GradientSync, like `adamw`) and `muon_sharded`
(whole-matrix Muon shards and ZeRO-1 AdamW, like `sharded`). A choice this machine cannot honour
fails at start-up, naming the field to change; FSDP with Muon is refused by the config.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moetrain.config import RunConfig
from moetrain.model.transformer import Transformer
from moetrain.optim.adamw import AdamW
from moetrain.optim.clip import global_grad_norm, params_with_kinds, sharded_grad_norm
from moetrain.optim.muon import Muon, MuonSettings
from moetrain.optim.muon_params import split_param_groups
from moetrain.optim.muon_sharded import MuonShards, ShardedMuon
from moetrain.optim.param_groups import build_param_groups
from moetrain.optim.sharded import AdamWShards, ShardedAdamW, expert_global_slices
from moetrain.parallel.data import FSDPAccumulation, GradientSync
from moetrain.parallel.mesh import ParallelDims
from moetrain.parallel.precision import resolve_grad_dtype

MUON_OPTIMIZERS = ("muon", "muon_sharded")


def build_optimizer(model: Transformer, config: RunConfig, dims: ParallelDims):
    """The optimizer of `train.optimizer` over `model`'s parameter groups (module docstring)."""
    t = config.train
    groups = build_param_groups(model, t)
    grad_dtype = resolve_grad_dtype(model, config, dims)
    if t.optimizer in MUON_OPTIMIZERS:
        kernel = resolve_adamw_kernel(t.adamw_kernel, dims.device)
        return build_muon(model, config, dims, groups, grad_dtype=grad_dtype, adamw_kernel=kernel)
    if t.optimizer == "sharded":
        if config.parallel.data_parallel == "fsdp":
            raise ValueError(
                "train.optimizer (sharded) cannot be combined with "
                "parallel.data_parallel (fsdp): FSDP shards the states itself"
            )
        return ShardedAdamW(
            groups,
            dense_group=dims.dp_group,
            expert_group=dims.edp_group,
            expert_grad_divisor=dims.dp,
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=t.eps,
            global_slices=expert_global_slices(model, config.moe.num_experts),
            pp_group=dims.pp_group,
            param_order=[n for n, _ in model.named_parameters()],
            grad_dtype=grad_dtype,
        )
    fsdp = config.parallel.data_parallel == "fsdp"
    needs_sync = (dims.world_size > 1 or grad_dtype is not None) and not fsdp
    grad_sync = GradientSync(model, dims, grad_dtype=grad_dtype) if needs_sync else None
    if fsdp and dims.dp > 1 and config.parallel.fsdp_reshard == "step":
        grad_sync = FSDPAccumulation(model)
    pairs = params_with_kinds(groups)

    def norm_fn() -> torch.Tensor:
        if fsdp:  # DTensor gradients on one mesh per kind (dense over dp, experts over edp)
            return sharded_grad_norm(pairs, ep_group=dims.ep_group)
        return global_grad_norm(pairs, ep_group=dims.ep_group, pp_group=dims.pp_group)

    kernel = resolve_adamw_kernel(t.adamw_kernel, dims.device)
    return _replicated_adamw(groups, config, dims, norm_fn, grad_sync, kernel)


def _replicated_adamw(groups, config: RunConfig, dims: ParallelDims, norm_fn, grad_sync, kernel):
    """AdamW over `groups` with the run's betas, eps and master weights, its state allocated."""
    t = config.train
    optimizer = AdamW(
        groups,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
        master_weights=config.precision.master_weights,
        fused=dims.device.type == "cuda",
        norm_fn=norm_fn,
        grad_sync=grad_sync,
        kernel=kernel,
    )
    optimizer.init_state()
    return optimizer


def resolve_adamw_kernel(choice: str, device: torch.device) -> str:
    """train.adamw_kernel: "auto" picks the Triton kernel on CUDA when Triton is installed."""
    from moetrain.kernels import adamw_triton

    usable = device.type == "cuda" and adamw_triton.triton_available()
    if choice == "triton" and not usable:
        raise ValueError(
            f"train.adamw_kernel (triton) needs a CUDA device and Triton; device is {device}, "
            f"Triton {'is' if adamw_triton.triton_available() else 'is not'} installed"
        )
    if choice == "auto":
        return "triton" if usable else "torch"
    return choice


def build_muon(
    model: nn.Module,
    config: RunConfig,
    dims: ParallelDims,
    param_groups: list[dict[str, Any]],
    *,
    grad_dtype: torch.dtype | None,
    adamw_kernel: str,
):
    """train.optimizer muon or muon_sharded over `param_groups` (`build_param_groups` output);
    `grad_dtype` and `adamw_kernel` as resolved for AdamW."""
    t = config.train
    settings = MuonSettings.from_config(t)
    muon_groups, adamw_groups = split_param_groups(param_groups)
    if t.optimizer == "muon_sharded":
        return build_sharded_muon(
            model, config, dims, muon_groups, adamw_groups, settings, grad_dtype=grad_dtype
        )
    needs_sync = dims.world_size > 1 or grad_dtype is not None
    grad_sync = GradientSync(model, dims, grad_dtype=grad_dtype) if needs_sync else None
    pairs = params_with_kinds(param_groups)  # the norm counts both halves

    def norm_fn() -> torch.Tensor:
        return global_grad_norm(pairs, ep_group=dims.ep_group, pp_group=dims.pp_group)

    adamw = _replicated_adamw(adamw_groups, config, dims, norm_fn, grad_sync, adamw_kernel)
    return Muon(muon_groups, adamw, settings, master_weights=config.precision.master_weights)


def build_sharded_muon(
    model: nn.Module,
    config: RunConfig,
    dims: ParallelDims,
    muon_groups: list[dict[str, Any]],
    adamw_groups: list[dict[str, Any]],
    settings: MuonSettings,
    *,
    grad_dtype: torch.dtype | None,
) -> ShardedMuon:
    """train.optimizer=muon_sharded over the two halves of `build_param_groups` output."""
    t = config.train
    order = [n for n, _ in model.named_parameters()]
    shared = dict(
        dense_group=dims.dp_group,
        expert_group=dims.edp_group,
        expert_grad_divisor=dims.dp,
        grad_dtype=grad_dtype,
        global_slices=expert_global_slices(model, config.moe.num_experts),
        param_order=order,
    )
    adamw = AdamWShards(
        adamw_groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, pp_group=dims.pp_group, **shared
    )
    return ShardedMuon(adamw, MuonShards(muon_groups, settings, **shared), order)
