"""The MoE feed-forward layer: router -> dispatcher -> grouped experts -> combine.

Letters: B batch, S sequence, T = B*S tokens, D model dim, E experts.
The weighted load-balancing and z-losses reach the router through `AddAuxLossGrad` on the layer
output, so `loss.backward()` on the language-model loss alone backpropagates them, in any
pipeline stage and under checkpointing. `aux_grad_scale` is the factor the trainer applies to
its own loss (1 / accumulation steps; 1 / pipeline micro-batches under pp). Routing statistics
accumulate in device buffers, read only when the trainer logs.

The forward is four parts a wrapper may also run on chunks of a micro-batch
(parallel/overlap.py): the router, `finish_routing` (statistics, auxiliary loss), the
dispatcher's dispatch and combine around `run_experts`, and the shared expert.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from moetrain.config import MoEConfig
from moetrain.moe.balance import load_balancing_loss, update_expert_bias
from moetrain.moe.dispatch import Dispatcher, DispatchHandle, LocalDispatcher
from moetrain.moe.experts import GroupedExperts
from moetrain.moe.random_router import RandomRouter
from moetrain.moe.recompute import is_recomputing
from moetrain.moe.router import RouterConfig, RoutingResult, TopKRouter
from moetrain.nn.mlp import SwiGLU


class AddAuxLossGrad(torch.autograd.Function):
    """A copy of `y`; in backward, gives `aux_loss` the gradient `scale`. Applied to the router
    weights (T x K: a cheap copy). A copy, not `y` itself: compiled, an identity on a graph input
    was folded away with its backward, silently dropping the auxiliary losses' gradient."""

    @staticmethod
    def forward(ctx, y, aux_loss, scale: float):  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_dtype = aux_loss.dtype
        return y.clone()

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        grad_aux = torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad_y.device)
        return grad_y, grad_aux, None


class MoELayer(nn.Module):
    def __init__(self, config: MoEConfig, d_model: int, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        # the router moe.routing names (a variant: moe/random_router.py); `seed` seeds its draws
        router = RouterConfig.of(config)
        self.router = (
            RandomRouter(d_model, router, seed=seed)
            if config.routing == "random"
            else TopKRouter(d_model, router)
        )
        self.experts = GroupedExperts(config.num_experts, d_model, config.expert_hidden)
        self.shared_expert = (
            SwiGLU(d_model, config.expert_hidden * config.num_shared_experts)
            if config.num_shared_experts
            else None
        )
        self.dispatcher: Dispatcher = LocalDispatcher()
        self.aux_grad_scale = 1.0
        # lb_scope "micro_batch_dp": sums route counts over the data-parallel ranks (installed by
        # moetrain.parallel; None in one process, where this rank's micro-batch is all of it)
        self.count_reducer: Callable[[torch.Tensor], torch.Tensor] | None = None
        # moe.record_routes: takes each training forward's expert ids (ids_TK), recomputes
        # excepted (installed by moetrain.train.routes; None: not recording)
        self.route_recorder: Callable[[torch.Tensor], None] | None = None
        # Statistics since the last read (log cadence; losses: lb, z, entropy, count) and since
        # the last optimizer step.
        counts_E = torch.zeros(config.num_experts, dtype=torch.int64)
        self.register_buffer("stat_tokens_per_expert_E", counts_E, persistent=False)
        self.register_buffer("stat_losses", torch.zeros(4), persistent=False)
        self.register_buffer("step_tokens_per_expert_E", counts_E.clone(), persistent=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        routing = self.finish_routing(self.router(x_TD))
        rows_ND, offsets_e, handle = self.dispatcher.dispatch(x_TD, routing)
        y_ND = self.run_experts(rows_ND, offsets_e, handle)
        y_TD = self.dispatcher.combine(y_ND, handle)
        if self.shared_expert is not None:
            y_TD = y_TD + self.shared_expert(x_TD)
        return y_TD.view(B, S, D)

    def run_experts(
        self, rows_ND: torch.Tensor, offsets_e: torch.Tensor, handle: DispatchHandle
    ) -> torch.Tensor:
        """The routed experts on a dispatch's rows (moe/dispatch.py)."""
        return self.experts(rows_ND, offsets_e, handle.row_weights_N, handle.rows_fp8)

    def finish_routing(
        self, routing: RoutingResult, whole: RoutingResult | None = None
    ) -> RoutingResult:
        """In training: records the statistics of the micro-batch's routing `whole` (default:
        `routing`; a wrapper that routes the micro-batch in chunks passes all of them merged)
        and hangs its weighted auxiliary loss on `routing`'s weights."""
        if not self.training:
            return routing
        whole = routing if whole is None else whole
        if not is_recomputing():
            self._record(whole)
            if self.route_recorder is not None:
                self.route_recorder(whole.expert_ids_TK)
        lb_loss = whole.lb_loss
        if self.config.lb_scope == "micro_batch_dp" and self.count_reducer is not None:
            dp_counts_E = self.count_reducer(whole.tokens_per_expert_E)
            lb_loss = load_balancing_loss(whole.probs_TE, dp_counts_E)
        aux_loss = self.config.lb_loss_weight * lb_loss + self.config.z_loss_weight * whole.z_loss
        if not aux_loss.requires_grad:
            return routing
        # the aux gradient rides on the router weights' backward
        weights_TK = AddAuxLossGrad.apply(routing.weights_TK, aux_loss, self.aux_grad_scale)
        return dataclasses.replace(routing, weights_TK=weights_TK)

    @torch.no_grad()
    def _record(self, routing: RoutingResult) -> None:
        self.stat_tokens_per_expert_E += routing.tokens_per_expert_E
        self.step_tokens_per_expert_E += routing.tokens_per_expert_E
        probs_TE = routing.probs_TE.detach()
        entropy = -(probs_TE * probs_TE.clamp_min(1e-20).log()).sum(-1).mean()
        one = torch.ones((), device=probs_TE.device)
        self.stat_losses += torch.stack(
            [routing.lb_loss.detach(), routing.z_loss.detach(), entropy, one]
        ).to(self.stat_losses.dtype)

    @torch.no_grad()
    def read_stats(self, reset: bool = True) -> dict[str, torch.Tensor]:
        """Device tensors since the last read: routes per expert, mean unweighted lb and z losses,
        mean per-token router entropy (nats)."""
        count = self.stat_losses[3].clamp_min(1)
        stats = {
            "tokens_per_expert": self.stat_tokens_per_expert_E.clone(),
            "lb_loss": self.stat_losses[0] / count,
            "z_loss": self.stat_losses[1] / count,
            "entropy": self.stat_losses[2] / count,
        }
        if reset:
            self.stat_tokens_per_expert_E.zero_()
            self.stat_losses.zero_()
        return stats

    @torch.no_grad()
    def end_of_step(self) -> None:
        """Called after each optimizer step: the aux-loss-free bias update, then reset counts."""
        if self.router.expert_bias_E is not None:
            update_expert_bias(
                self.router.expert_bias_E,
                self.step_tokens_per_expert_E,
                self.config.bias_update_rate,
            )
        self.step_tokens_per_expert_E.zero_()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        self.router.reset_buffers()
        for buf in (self.stat_tokens_per_expert_E, self.stat_losses, self.step_tokens_per_expert_E):
            buf.zero_()
