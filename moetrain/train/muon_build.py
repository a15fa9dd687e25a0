"""The Muon optimizers of `train.optimizer` built for a parallelized model: `muon` (Muon and the
replicated AdamW over a GradientSync, like `adamw`) and `muon_sharded` (whole-matrix Muon
shards and ZeRO-1 AdamW, like `sharded`). FSDP is refused by the config (RunConfig).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moetrain.config import RunConfig
from moetrain.optim.adamw import AdamW
from moetrain.optim.clip import global_grad_norm, params_with_kinds
from moetrain.optim.muon import Muon, MuonSettings
from moetrain.optim.muon_params import split_param_groups
from moetrain.optim.muon_sharded import MuonShards, ShardedMuon
from moetrain.optim.sharded import AdamWShards, expert_global_slices
from moetrain.parallel.data import GradientSync
from moetrain.parallel.mesh import ParallelDims

MUON_OPTIMIZERS = ("muon", "muon_sharded")


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
    `grad_dtype` and `adamw_kernel` as resolved for AdamW (train/build.py)."""
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

    adamw = AdamW(
        adamw_groups,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
        master_weights=config.precision.master_weights,
        fused=dims.device.type == "cuda",
        norm_fn=norm_fn,
        grad_sync=grad_sync,
        kernel=adamw_kernel,
    )
    adamw.init_state()
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
