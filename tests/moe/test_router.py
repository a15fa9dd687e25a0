import math

import pytest
import torch

from moetrain.config import MoEConfig
from moetrain.moe import balance
from moetrain.moe.layer import MoELayer
from moetrain.moe.random_router import RandomRouter
from moetrain.moe.router import RouterConfig, TopKRouter


def moe(num_experts: int, top_k: int, **fields) -> MoEConfig:
    return MoEConfig(num_experts=num_experts, top_k=top_k, **fields)


def router_config(num_experts: int, top_k: int, **fields) -> RouterConfig:
    """The router's config as the MoE layer resolves it from moe.*."""
    return RouterConfig.of(moe(num_experts, top_k, **fields))


def test_topk_matches_brute_force():
    torch.manual_seed(0)
    router = TopKRouter(16, router_config(10, 3))
    x = torch.randn(50, 16)
    r = router(x)
    scores = (x @ router.gate.weight.T).softmax(-1)
    for t in range(50):
        order = sorted(range(10), key=lambda e: -scores[t, e].item())[:3]
        assert sorted(r.expert_ids_TK[t].tolist()) == sorted(order)
        torch.testing.assert_close(r.weights_TK[t].sort().values, scores[t, order].sort().values)
    counts = torch.zeros(10, dtype=torch.int64)
    for e in r.expert_ids_TK.flatten().tolist():
        counts[e] += 1
    assert torch.equal(r.tokens_per_expert_E, counts)


def test_renormalized_weights_sum_to_one():
    router = TopKRouter(8, router_config(6, 2, score_func="sigmoid", renormalize=True))
    r = router(torch.randn(20, 8))
    torch.testing.assert_close(r.weights_TK.sum(-1), torch.ones(20))


def test_random_routing_is_uniform_and_seeded():
    E, K, T = 8, 2, 4000
    a = RandomRouter(16, router_config(E, K), seed=7)
    b = RandomRouter(16, router_config(E, K), seed=7)
    b.load_state_dict(a.state_dict())
    x = torch.randn(T, 16)
    ra, rb = a(x), b(x)
    assert torch.equal(ra.expert_ids_TK, rb.expert_ids_TK)  # reproducible by seed
    assert (ra.expert_ids_TK[:, 0] != ra.expert_ids_TK[:, 1]).all()  # distinct experts
    counts = ra.tokens_per_expert_E.double()
    expected = T * K / E
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 24.3, chi2  # 99.9% quantile of chi-square with 7 degrees of freedom
    c = RandomRouter(16, router_config(E, K), seed=8)
    c.load_state_dict(a.state_dict())
    assert not torch.equal(c(x).expert_ids_TK, ra.expert_ids_TK)


def test_random_router_draws_travel_in_its_state_dict():
    """A router loaded from another's state dict continues its draws (what a checkpoint keeps)
    instead of starting over; the counter stays on the CPU (read without a device sync)."""
    config, x = router_config(8, 2), torch.randn(64, 16)
    drawn = RandomRouter(16, config, seed=3)
    first = drawn(x).expert_ids_TK
    for _ in range(2):
        drawn(x)
    resumed = RandomRouter(16, config, seed=3)
    resumed.load_state_dict(drawn.state_dict())
    assert resumed.draws == drawn.draws == 3 and resumed.get_extra_state().device.type == "cpu"
    fourth = drawn(x).expert_ids_TK
    assert torch.equal(resumed(x).expert_ids_TK, fourth)
    assert not torch.equal(fourth, first)


def test_moe_routing_random_builds_the_random_router():
    """moe.routing: random gives the MoE layer a router whose experts are not the top-k of its
    scores; learned, the same gate's top-k."""
    x = torch.randn(64, 16)
    learned = MoELayer(moe(8, 2), 16)
    random = MoELayer(moe(8, 2, routing="random"), 16, seed=1)
    random.router.gate.load_state_dict(learned.router.gate.state_dict())
    top_TK = (x @ learned.router.gate.weight.T).topk(2, dim=-1).indices.sort(-1).values
    assert torch.equal(learned.router(x).expert_ids_TK.sort(-1).values, top_TK)
    assert not torch.equal(random.router(x).expert_ids_TK.sort(-1).values, top_TK)


def test_load_balancing_loss_is_one_under_perfect_balance_and_grows():
    E, K, T = 4, 1, 8
    probs = torch.full((T, E), 1.0 / E)
    counts = torch.full((E,), T * K // E)
    assert balance.load_balancing_loss(probs, counts).item() == pytest.approx(1.0)
    skewed_probs = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(T, 1)
    skewed_counts = torch.tensor([5, 1, 1, 1])
    worse = torch.tensor([8, 0, 0, 0])
    lb1 = balance.load_balancing_loss(skewed_probs, skewed_counts).item()
    lb2 = balance.load_balancing_loss(skewed_probs, worse).item()
    assert 1.0 < lb1 < lb2
    assert lb2 == pytest.approx(4 * 0.7)


def test_z_loss_formula():
    logits = torch.randn(6, 5)
    expected = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 6
    assert balance.router_z_loss(logits).item() == pytest.approx(expected, rel=1e-5)


def test_bias_moves_selection_not_weights():
    router = TopKRouter(8, router_config(4, 1, bias_update_rate=1e-3))
    x = torch.randn(32, 8)
    before = router(x)
    router.expert_bias_E[:] = torch.tensor([10.0, 0, 0, 0])
    after = router(x)
    assert (after.expert_ids_TK == 0).all()
    scores = (x @ router.gate.weight.T).softmax(-1)
    torch.testing.assert_close(after.weights_TK[:, 0], scores[:, 0])
    assert not torch.equal(before.expert_ids_TK, after.expert_ids_TK)


def test_bias_update_reduces_imbalance():
    torch.manual_seed(0)
    router = TopKRouter(16, router_config(8, 2, bias_update_rate=1e-3))
    router.gate.weight.data[0] += 0.2  # skew towards expert 0
    x = torch.randn(512, 16) + 0.5
    start = balance.load_imbalance(router(x).tokens_per_expert_E).item()
    for _ in range(300):
        balance.update_expert_bias(router.expert_bias_E, router(x).tokens_per_expert_E, 2e-3)
    end = balance.load_imbalance(router(x).tokens_per_expert_E).item()
    assert end < start and end < 1.5, (start, end)
