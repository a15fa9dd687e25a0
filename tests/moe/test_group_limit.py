"""Group-limited routing (DeepSeek-V3) against a plain loop over tokens and groups: the masked
selection scores, the router's choice with softmax and with sigmoid scores and the aux-loss-free
bias (selection only), and the MoE layer built from the config."""

from __future__ import annotations

import pytest
import torch

from moetrain.config import MoEConfig
from moetrain.moe.group_limit import group_limited_scores
from moetrain.moe.layer import MoELayer
from moetrain.moe.router import RouterConfig, TopKRouter


def loop_choice(selection_TE, n_groups, topk_groups, k):
    """Each token's k experts, by hand: group score = the sum of the group's two best scores;
    the topk_groups best groups; the k best experts among theirs."""
    T, E = selection_TE.shape
    size = E // n_groups
    choices = []
    for row in selection_TE.tolist():
        group_scores = [
            sum(sorted(row[g * size : (g + 1) * size], reverse=True)[:2]) for g in range(n_groups)
        ]
        groups = sorted(range(n_groups), key=lambda g: -group_scores[g])[:topk_groups]
        allowed = [e for g in groups for e in range(g * size, (g + 1) * size)]
        choices.append(sorted(allowed, key=lambda e: -row[e])[:k])
    return choices


@pytest.mark.parametrize(("E", "n_groups", "topk_groups"), [(16, 4, 2), (12, 3, 1), (64, 8, 3)])
def test_masked_scores_keep_the_best_groups_exactly(E, n_groups, topk_groups):
    gen = torch.Generator().manual_seed(E)
    selection = (
        torch.randn(40, E, generator=gen) - 0.5
    )  # negative scores too (a bias can give them)
    masked = group_limited_scores(selection, n_groups, topk_groups)
    size = E // n_groups
    for t, allowed in enumerate(loop_choice(selection, n_groups, topk_groups, topk_groups * size)):
        kept = masked[t].isfinite()
        assert sorted(kept.nonzero().flatten().tolist()) == sorted(allowed)
        assert torch.equal(masked[t][kept], selection[t][kept])  # untouched where kept
        assert (masked[t][~kept] == float("-inf")).all()


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_chooses_within_the_best_groups_and_bias_moves_only_the_choice(score_func):
    D, E, K, n_groups, topk_groups = 16, 16, 4, 4, 2
    torch.manual_seed(0)
    common = dict(num_experts=E, top_k=K, score_func=score_func, renormalize=True)
    grouped = RouterConfig(
        **common, balancing_bias=True, n_groups=n_groups, topk_groups=topk_groups
    )
    router = TopKRouter(D, grouped)
    with torch.no_grad():
        router.gate.weight.mul_(20)  # decisive scores
        router.expert_bias_E.copy_(0.3 * torch.randn(E))
    x = torch.randn(64, D)
    r = router(x)
    logits = x @ router.gate.weight.T
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    expected = loop_choice(scores + router.expert_bias_E, n_groups, topk_groups, K)
    assert [sorted(ids) for ids in r.expert_ids_TK.tolist()] == [sorted(c) for c in expected]
    chosen = scores.gather(1, r.expert_ids_TK)  # the weights: unbiased scores, renormalized
    torch.testing.assert_close(r.weights_TK, chosen / chosen.sum(-1, keepdim=True))
    counts = torch.bincount(r.expert_ids_TK.flatten(), minlength=E)
    assert torch.equal(r.tokens_per_expert_E, counts)
    # without the limit some token chooses outside its best groups, so the limit did something
    ungrouped = TopKRouter(D, RouterConfig(**common, balancing_bias=True))
    ungrouped.load_state_dict(router.state_dict())
    assert not torch.equal(
        ungrouped(x).expert_ids_TK.sort(-1).values, r.expert_ids_TK.sort(-1).values
    )


def test_moe_layer_routes_by_its_config_groups():
    config = MoEConfig(num_experts=8, top_k=2, expert_hidden=32, n_groups=4, topk_groups=1)
    layer = MoELayer(config, 16)
    torch.nn.init.normal_(layer.router.gate.weight)
    ids = layer.router(torch.randn(100, 16)).expert_ids_TK
    assert torch.equal(ids // 2, ids[:, :1] // 2 * torch.ones_like(ids))  # one group of 2 each
