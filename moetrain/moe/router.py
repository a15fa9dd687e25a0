"""Top-k router: x_TD -> RoutingResult. No host syncs and no communication.

Letters: T tokens, D model dim, E experts, K top-k.
Scores are softmax (OLMoE) or sigmoid over all experts, in fp32. Experts are the top-k of the
scores plus an optional per-expert bias (aux-loss-free balancing: it moves the selection, never
the weights), among the experts of each token's best groups under group-limited routing
(moe/group_limit.py); weights are the selected scores, optionally renormalized. Random mode (benchmarks)
draws K distinct experts per token from a seeded device generator; its weights are still the
scores at the drawn experts, so compute and gradients keep their shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moetrain.kernels.topk import route_topk
from moetrain.moe import balance
from moetrain.moe.group_limit import group_limited_scores
from moetrain.moe.recompute import forward_value


@dataclass
class RoutingResult:
    expert_ids_TK: torch.Tensor  # int64
    weights_TK: torch.Tensor  # float32
    tokens_per_expert_E: torch.Tensor  # int64, on device
    probs_TE: torch.Tensor  # normalized scores, float32 (for the balance loss and statistics)
    lb_loss: torch.Tensor  # unweighted, scalar
    z_loss: torch.Tensor  # unweighted, scalar


class TopKRouter(nn.Module):
    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: str = "softmax",
        renormalize: bool = False,
        routing: str = "learned",
        use_bias: bool = False,
        seed: int = 0,
        n_groups: int = 1,
        topk_groups: int = 1,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.renormalize, self.routing = score_func, renormalize, routing
        self.seed = seed
        self.n_groups, self.topk_groups = n_groups, topk_groups
        self.gate = nn.Linear(d_model, num_experts, bias=False)
        # Aux-loss-free balancing bias: a buffer (not trained by the optimizer, but checkpointed).
        self.register_buffer(
            "expert_bias_E", torch.zeros(num_experts) if use_bias else None, persistent=use_bias
        )
        self._generator: torch.Generator | None = None
        # random-routing draws so far: a host int (seeding needs no device read), checkpointed by
        # the trainer so that a resumed random-routing run draws the same experts
        self.draws = 0

    def forward(self, x_TD: torch.Tensor) -> RoutingResult:
        # fp32 scores for bf16 models; float64 stays float64 (reference tests)
        logits_TE = self.gate(x_TD).to(torch.promote_types(x_TD.dtype, torch.float32))
        if self.score_func == "softmax":
            scores_TE = logits_TE.softmax(dim=-1)
            probs_TE = scores_TE
        else:
            scores_TE = logits_TE.sigmoid()
            probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)

        if self.routing == "random":
            noise_TE = torch.rand(
                logits_TE.shape, device=x_TD.device, generator=self._draw_rng(x_TD)
            )
            expert_ids_TK, tokens_per_expert_E = route_topk(noise_TE, self.top_k)
        else:
            selection_TE = scores_TE.detach()
            if self.expert_bias_E is not None:
                selection_TE = selection_TE + self.expert_bias_E
            if self.topk_groups < self.n_groups:  # group-limited routing
                selection_TE = group_limited_scores(selection_TE, self.n_groups, self.topk_groups)
            expert_ids_TK, tokens_per_expert_E = route_topk(selection_TE, self.top_k)
        weights_TK = scores_TE.gather(1, expert_ids_TK)
        if self.renormalize:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)

        return RoutingResult(
            expert_ids_TK=expert_ids_TK,
            weights_TK=weights_TK,
            tokens_per_expert_E=tokens_per_expert_E,
            probs_TE=probs_TE,
            lb_loss=balance.load_balancing_loss(probs_TE, tokens_per_expert_E),
            z_loss=balance.router_z_loss(logits_TE),
        )

    def _draw_rng(self, x: torch.Tensor) -> torch.Generator:
        """The generator for this forward's random experts, seeded by (seed, draw number); a
        recompute reuses its forward's draw number (moe/recompute.py)."""
        if self._generator is None or self._generator.device != x.device:
            self._generator = torch.Generator(device=x.device)
        draw = forward_value(self._next_draw)
        self._generator.manual_seed(self.seed * 1_000_003 + draw)
        return self._generator

    def _next_draw(self) -> int:
        self.draws += 1
        return self.draws - 1

    def reset_buffers(self) -> None:
        if self.expert_bias_E is not None:
            self.expert_bias_E.zero_()
        self._generator = None
        self.draws = 0
