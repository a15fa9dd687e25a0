"""Top-k router: x_TD -> RoutingResult. No host syncs and no communication.

Letters: T tokens, D model dim, E experts, K top-k.
Built from one `RouterConfig`: the router's own settings, resolved once from `moe.*`
(`RouterConfig.of`; a new router setting is one field there, named as in MoEConfig). Scores are
softmax (OLMoE) or sigmoid over all experts, in fp32. `select` picks each token's experts: the
top-k of the scores plus an optional per-expert bias (aux-loss-free balancing: it moves the
selection, never the weights), among the experts of each token's best groups under group-limited
routing (moe/group_limit.py); weights are the scores at the selected experts, optionally
renormalized. A variant replaces `select` only (moe/random_router.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from moetrain.config import MoEConfig
from moetrain.kernels.topk import route_topk
from moetrain.moe import balance
from moetrain.moe.group_limit import group_limited_scores


@dataclass
class RoutingResult:
    expert_ids_TK: torch.Tensor  # int64
    weights_TK: torch.Tensor  # float32
    tokens_per_expert_E: torch.Tensor  # int64, on device
    probs_TE: torch.Tensor  # normalized scores, float32 (for the balance loss and statistics)
    lb_loss: torch.Tensor  # unweighted, scalar
    z_loss: torch.Tensor  # unweighted, scalar


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """What a router runs. Each field but `balancing_bias` is the MoEConfig field of its name
    (validated there); `of` copies them by name."""

    num_experts: int
    top_k: int
    score_func: str = "softmax"  # softmax or sigmoid
    renormalize: bool = False  # the top-k weights renormalized to sum to one
    n_groups: int = 1  # group-limited routing: experts in n_groups groups (1: off)
    topk_groups: int = 1  # ... each token's experts from its topk_groups best groups
    balancing_bias: bool = False  # aux-loss-free balancing: moe.bias_update_rate > 0

    @classmethod
    def of(cls, moe: MoEConfig) -> RouterConfig:
        same = {f.name: getattr(moe, f.name) for f in fields(cls) if f.name != "balancing_bias"}
        return cls(**same, balancing_bias=moe.bias_update_rate > 0)


class TopKRouter(nn.Module):
    def __init__(self, d_model: int, config: RouterConfig) -> None:
        super().__init__()
        self.config = config
        self.num_experts, self.top_k = config.num_experts, config.top_k
        self.score_func, self.renormalize = config.score_func, config.renormalize
        self.gate = nn.Linear(d_model, self.num_experts, bias=False)
        # Aux-loss-free balancing bias: a buffer (not trained by the optimizer, but checkpointed).
        bias_E = torch.zeros(self.num_experts) if config.balancing_bias else None
        self.register_buffer("expert_bias_E", bias_E, persistent=bias_E is not None)

    def forward(self, x_TD: torch.Tensor) -> RoutingResult:
        # fp32 scores for bf16 models; float64 stays float64 (reference tests)
        logits_TE = self.gate(x_TD).to(torch.promote_types(x_TD.dtype, torch.float32))
        if self.score_func == "softmax":
            scores_TE = logits_TE.softmax(dim=-1)
            probs_TE = scores_TE
        else:
            scores_TE = logits_TE.sigmoid()
            probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)

        expert_ids_TK, tokens_per_expert_E = self.select(scores_TE.detach())
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

    def select(self, scores_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's K experts (int64 ids_TK) and the routes per expert (int64 counts_E) from
        the detached scores."""
        if self.expert_bias_E is not None:
            scores_TE = scores_TE + self.expert_bias_E
        c = self.config
        if c.topk_groups < c.n_groups:  # group-limited routing, after the bias (selection only)
            scores_TE = group_limited_scores(scores_TE, c.n_groups, c.topk_groups)
        return route_topk(scores_TE, self.top_k)

    def reset_buffers(self) -> None:
        if self.expert_bias_E is not None:
            self.expert_bias_E.zero_()
