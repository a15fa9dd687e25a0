"""A dispatcher that hands one device's experts exactly the rows one rank of an expert-parallel
run would receive under uniform routing, without any other rank: for measuring a rank's compute.

Letters: T tokens, K top-k, E experts, n ranks of the expert-parallel group, e = E / n.

Under uniform routing over n ranks, a rank's e experts receive e n T K / E = T K rows, T K / e
each. `BalancedDispatcher` reproduces that on one device: the router's choice among the E experts
is kept for the weights (and the router's gradient), and route r = t K + k goes to local expert
r mod e. The rows move as in `LocalDispatcher`; what expert parallelism adds (all-to-alls, index
work) is not run.
"""

from __future__ import annotations

import dataclasses

import torch

from moetrain.moe.dispatch import LocalDispatcher, LocalHandle
from moetrain.moe.router import RoutingResult


def balanced_expert_ids(num_tokens: int, top_k: int, num_local: int, device) -> torch.Tensor:
    """(T, K) local expert ids: route t K + k to expert (t K + k) mod e."""
    return (torch.arange(num_tokens * top_k, device=device) % num_local).view(num_tokens, top_k)


def balanced_counts(num_routes: int, num_local: int, device) -> torch.Tensor:
    """Rows per local expert when `num_routes` routes go round-robin over `num_local` experts."""
    base, extra = divmod(num_routes, num_local)
    return torch.full((num_local,), base, device=device) + (
        torch.arange(num_local, device=device) < extra
    )


class BalancedDispatcher:
    """The T K routes of this device's tokens, spread evenly over its `num_local` experts."""

    def __init__(self, num_local: int, payload: str = "bf16") -> None:
        if num_local < 1:
            raise ValueError(f"num_local ({num_local}) must be >= 1")
        self.num_local = num_local
        self.local = LocalDispatcher(payload)

    @property
    def fp8_rows(self) -> bool:
        """`LocalDispatcher.fp8_rows` of the wrapped dispatcher."""
        return self.local.fp8_rows

    @fp8_rows.setter
    def fp8_rows(self, value: bool) -> None:
        self.local.fp8_rows = value

    def dispatch(
        self, x_TD: torch.Tensor, routing: RoutingResult
    ) -> tuple[torch.Tensor, torch.Tensor, LocalHandle]:
        num_tokens, top_k = routing.expert_ids_TK.shape
        device = x_TD.device
        local = dataclasses.replace(
            routing,
            expert_ids_TK=balanced_expert_ids(num_tokens, top_k, self.num_local, device),
            tokens_per_expert_E=balanced_counts(num_tokens * top_k, self.num_local, device),
        )
        return self.local.dispatch(x_TD, local)

    def combine(self, y_ND: torch.Tensor, handle: LocalHandle) -> torch.Tensor:
        return self.local.combine(y_ND, handle)
