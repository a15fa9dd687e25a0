"""Typed parameter groups: which parameters decay, and which learning-rate multiplier they take.

Kinds: `expert` (routed expert weights, the 3-D tensors of GroupedExperts), `router` (router gates),
`dense` (everything else). Norm weights and embeddings never decay; neither do 1-D parameters.
Each group is a dict that torch optimizers accept, plus `name`, `kind` and `lr_mult` (the schedule
multiplies the scheduled LR by `lr_mult`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moetrain.config import TrainConfig


def param_kind(name: str) -> str:
    if name.endswith(("w_up_eD2F", "w_down_eFD")):
        return "expert"
    if name.endswith("router.gate.weight"):
        return "router"
    return "dense"


def decays(name: str, ndim: int) -> bool:
    return ndim >= 2 and not name.endswith("norm.weight") and name != "embed.weight"


def build_param_groups(model: nn.Module, train: TrainConfig) -> list[dict[str, Any]]:
    lr_mult = {"dense": 1.0, "expert": train.expert_lr_mult, "router": train.router_lr_mult}
    groups: dict[tuple[str, bool], dict[str, Any]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        kind, decay = param_kind(name), decays(name, param.ndim)
        group = groups.setdefault(
            (kind, decay),
            {
                "name": f"{kind}{'' if decay else '_no_decay'}",
                "kind": kind,
                "params": [],
                "param_names": [],
                "weight_decay": train.weight_decay if decay else 0.0,
                "lr_mult": lr_mult[kind],
            },
        )
        group["params"].append(param)
        group["param_names"].append(name)
    return list(groups.values())
