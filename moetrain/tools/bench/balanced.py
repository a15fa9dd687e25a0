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
from moetrain.moe.payload import Payload
from moetrain.moe.router import RoutingResult


class BalancedDispatcher:
    """The T K routes of this device's tokens, spread evenly over its `num_local` experts."""

    def __init__(self, num_local: int, local: LocalDispatcher | None = None) -> None:
        """`local`: the LocalDispatcher that moves the rows (with the precision plan's payload
        and quantized rows, as installed in the layer this one replaces); default a bf16 one."""
        if num_local < 1:
            raise ValueError(f"num_local ({num_local}) must be >= 1")
        self.num_local = num_local
        self.local = LocalDispatcher() if local is None else local

    @property
    def payload(self) -> Payload:
        """The wrapped dispatcher's."""
        return self.local.payload

    def dispatch(
        self, x_TD: torch.Tensor, routing: RoutingResult
    ) -> tuple[torch.Tensor, torch.Tensor, LocalHandle]:
        num_tokens, top_k = routing.expert_ids_TK.shape
        e, device = self.num_local, x_TD.device
        # route r = t K + k to local expert r mod e: the first `extra` experts get one row more
        base, extra = divmod(num_tokens * top_k, e)
        local = dataclasses.replace(
            routing,
            expert_ids_TK=(torch.arange(num_tokens * top_k, device=device) % e).view(
                num_tokens, top_k
            ),
            tokens_per_expert_E=torch.full((e,), base, device=device)
            + (torch.arange(e, device=device) < extra),
        )
        return self.local.dispatch(x_TD, local)

    def combine(self, y_ND: torch.Tensor, handle: LocalHandle) -> torch.Tensor:
        return self.local.combine(y_ND, handle)
