"""Group-limited routing (DeepSeek-V3): which experts a token may choose, as masked scores.

Letters: T tokens, E experts, G groups, e = E / G experts a group, K top-k.
The experts form G groups of e consecutive ids. A token's group score is the sum of its two
highest selection scores in the group; the token keeps the experts of its `topk_groups` best
groups and the others get -inf, so the router's top-k (`kernels/topk.py`, whose kernel and
reference both treat -inf as never chosen while K <= topk_groups x e finite scores remain)
picks among the kept experts only. The selection scores are what the router ranks by (its scores
plus the aux-loss-free bias, if any): the masking moves the choice, never the weights, which the
router gathers from its unbiased scores. No host sync, static shapes.
"""

from __future__ import annotations

import torch


def group_limited_scores(
    selection_TE: torch.Tensor, n_groups: int, topk_groups: int
) -> torch.Tensor:
    """`selection_TE` with -inf at every expert outside each token's `topk_groups` best groups
    (module docstring); E must divide into `n_groups` groups of at least two experts."""
    T, E = selection_TE.shape
    if E % n_groups or E // n_groups < 2 or not 1 <= topk_groups <= n_groups:
        raise ValueError(
            f"group_limited_scores: {E} experts in {n_groups} groups of >= 2, keeping "
            f"{topk_groups} of them, is not a grouping"
        )
    groups_TGe = selection_TE.view(T, n_groups, E // n_groups)
    group_score_TG = groups_TGe.topk(2, dim=-1).values.sum(dim=-1)
    kept_TG = torch.zeros_like(group_score_TG, dtype=torch.bool)
    kept_TG.scatter_(1, group_score_TG.topk(topk_groups, dim=-1).indices, True)
    masked_TGe = groups_TGe.masked_fill(~kept_TG[:, :, None], float("-inf"))
    return masked_TGe.view(T, E)
