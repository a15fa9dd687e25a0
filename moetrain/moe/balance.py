"""Load balancing as pure functions: auxiliary losses, bias updates and load statistics.

Letters: T tokens, K top-k, E experts.
- load-balancing loss (Switch/OLMoE): E * sum_e f_e * P_e, with f_e the fraction of the T*K routes
  that chose expert e and P_e the mean router probability of e. Perfect balance gives exactly 1.
- router z-loss: mean over tokens of logsumexp(logits)^2, which keeps router logits small.
- auxiliary-loss-free balancing: a per-expert bias added to the scores only for selecting experts,
  nudged by a fixed step towards under-loaded experts after every optimizer step.
"""

from __future__ import annotations

import torch


def count_tokens_per_expert(expert_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routes per expert, int64 on the device. A scatter-add of ones into zeros: no host sync
    (unlike `torch.bincount`, whose output size depends on the data) and no sort (unlike
    `index_add_`, which compiled code lowers to a sort-based deterministic index_put). Integer
    atomics are exact in any order."""
    flat = expert_ids_TK.reshape(-1)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts_E.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


def load_balancing_loss(probs_TE: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """E * sum_e f_e * P_e. `probs_TE` are normalized router probabilities (each row sums to 1);
    f_e = routes to e / all routes, from `tokens_per_expert_E`, which may be this micro-batch's
    counts or counts summed over data-parallel ranks (moe.lb_scope micro_batch_dp). The
    fractions carry no gradient; the gradient reaches the router through P."""
    num_experts = probs_TE.shape[1]
    counts_E = tokens_per_expert_E.to(probs_TE.dtype)
    fraction_E = counts_E / counts_E.sum().clamp_min(1)
    return num_experts * (fraction_E * probs_TE.mean(dim=0)).sum()


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits_TE.float(), dim=-1).square().mean()


def update_expert_bias(
    bias_E: torch.Tensor, tokens_per_expert_E: torch.Tensor, rate: float
) -> None:
    """Aux-loss-free balancing step, in place: raise the bias of under-loaded experts by `rate`
    and lower it for over-loaded ones (sign of mean load minus load)."""
    load_E = tokens_per_expert_E.to(bias_E.dtype)
    bias_E.add_(rate * torch.sign(load_E.mean() - load_E))


def load_imbalance(tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """max / mean routes per expert (1.0 is perfect balance), as a device scalar."""
    load_E = tokens_per_expert_E.float()
    return load_E.max() / load_E.mean().clamp_min(1e-9)
