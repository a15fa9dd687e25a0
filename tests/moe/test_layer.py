"""MoE layer against a naive per-token reference in float64: outputs and all gradients."""

import pytest
import torch
import torch.nn.functional as F

from moetrain.config import MoEConfig
from moetrain.moe.layer import MoELayer


def _naive_moe(layer: MoELayer, x_TD: torch.Tensor) -> torch.Tensor:
    """Loop over tokens and their k experts, straight from the definition."""
    cfg = layer.config
    logits_TE = x_TD @ layer.router.gate.weight.T
    scores = logits_TE.softmax(-1) if cfg.score_func == "softmax" else logits_TE.sigmoid()
    w_up, w_down = layer.experts.w_up_eD2F, layer.experts.w_down_eFD
    outs = []
    for t in range(x_TD.shape[0]):
        top = torch.topk(scores[t].detach(), cfg.top_k).indices
        weights = scores[t, top]
        if cfg.renormalize:
            weights = weights / weights.sum()
        y = torch.zeros_like(x_TD[t])
        for k, e in enumerate(top.tolist()):
            gate, up = (x_TD[t] @ w_up[e]).chunk(2)
            y = y + weights[k] * ((F.silu(gate) * up) @ w_down[e])
        outs.append(y)
    return torch.stack(outs)


@pytest.mark.parametrize("score_func,renormalize", [("softmax", False), ("sigmoid", True)])
def test_moe_layer_matches_naive_reference(score_func, renormalize):
    torch.manual_seed(1)
    cfg = MoEConfig(
        num_experts=6,
        top_k=2,
        expert_hidden=12,
        score_func=score_func,
        renormalize=renormalize,
        lb_loss_weight=0.0,
        z_loss_weight=0.0,
    )
    layer = MoELayer(cfg, d_model=8).double()
    for p in layer.parameters():
        p.data.normal_(0, 0.5)
    ref = MoELayer(cfg, d_model=8).double()
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = layer(x1)
    y_ref = _naive_moe(ref, x2.view(-1, 8)).view(3, 5, 8)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-9)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-6, atol=1e-9)
    for (name, p), (_, q) in zip(layer.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9, msg=name)
        assert p.grad.abs().sum() > 0, name


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_moe_layer_in_training_dtypes_matches_naive_reference(dtype, tol):
    """The path training takes: aligned widths, torch._grouped_mm and the swiglu op in fp32 and
    bf16, against the float64 per-token reference on the same (rounded) weights."""
    torch.manual_seed(2)
    cfg = MoEConfig(num_experts=8, top_k=2, expert_hidden=32, lb_loss_weight=0.0, z_loss_weight=0.0)
    layer = MoELayer(cfg, d_model=16)
    for p in layer.parameters():
        p.data.normal_(0, 0.5)
    layer = layer.to(dtype)
    ref = MoELayer(cfg, d_model=16).double()
    ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    x = torch.randn(4, 8, 16).to(dtype)
    x1, x2 = x.clone().requires_grad_(), x.double().requires_grad_()
    y = layer(x1)
    y_ref = _naive_moe(ref, x2.view(-1, 16)).view(4, 8, 16)
    assert y.dtype == dtype and _rel(y, y_ref) < tol
    g = torch.randn(4, 8, 16, dtype=torch.float64)
    y.backward(g.to(dtype))
    y_ref.backward(g)
    assert _rel(x1.grad, x2.grad) < tol
    for (name, p), (_, q) in zip(layer.named_parameters(), ref.named_parameters(), strict=True):
        assert _rel(p.grad, q.grad) < tol, name


def test_aux_losses_reach_router_through_output():
    """The weighted aux losses are backpropagated by a plain loss on the output."""
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, lb_loss_weight=0.5, z_loss_weight=0.1)
    layer = MoELayer(cfg, d_model=8).double()
    for p in layer.parameters():
        p.data.normal_(0, 0.5)
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    layer.zero_grad()
    layer(x).sum().backward()
    with_aux = layer.router.gate.weight.grad.clone()

    layer.zero_grad()
    y = layer(x)
    routing = layer.router(x.view(-1, 8))
    aux = cfg.lb_loss_weight * routing.lb_loss + cfg.z_loss_weight * routing.z_loss
    (y.sum() + aux).backward()
    expected_total = layer.router.gate.weight.grad.clone()
    # second pass counted the aux gradient twice (once through the output, once directly)
    layer.zero_grad()
    layer.aux_grad_scale = 0.0
    layer(x).sum().backward()
    without = layer.router.gate.weight.grad
    torch.testing.assert_close(with_aux - without, (expected_total - with_aux))
    assert (with_aux - without).abs().max() > 1e-6


def test_stats_accumulate_and_reset():
    cfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=8)
    layer = MoELayer(cfg, d_model=8)
    x = torch.randn(2, 5, 8)
    layer(x)
    layer(x)
    stats = layer.read_stats()
    assert stats["tokens_per_expert"].sum().item() == 2 * 10 * 2
    assert layer.read_stats()["tokens_per_expert"].sum().item() == 0
