"""Typed parameter groups for torch optimizers, plus `name`, `kind` and `lr_mult`: kinds `expert`
(GroupedExperts weights), `router` (gates) and `dense`; norm weights, embeddings and 1-D
parameters never decay.
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


def lr_mults(train: TrainConfig) -> dict[str, float]:
    """Each kind's multiple of the scheduled LR: its groups train at lr_at(step) x this."""
    return {"dense": 1.0, "expert": train.expert_lr_mult, "router": train.router_lr_mult}


def build_param_groups(model: nn.Module, train: TrainConfig) -> list[dict[str, Any]]:
    lr_mult = lr_mults(train)
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
