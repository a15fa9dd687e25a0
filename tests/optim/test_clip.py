"""Global gradient norm and clipping of replicated gradients: one process against torch, and
(dp=4, ep=2) and (pp=2, dp=2, ep=2) layouts against the single-process norm of the same global
gradients. Rank layout as in ParallelDims: rank = pp_rank * dp + edp_rank * ep + ep_rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed
from torch import nn

from moetrain.config import presets
from moetrain.model.transformer import build_model
from moetrain.optim.clip import clip_grad_norm_, global_grad_norm, params_with_kinds
from moetrain.optim.param_groups import build_param_groups

NUM_EXPERTS, MAX_NORM = 4, 0.1
DENSE_SHAPES = [(6, 5), (7,)]
EXPERT_SHAPES = [(NUM_EXPERTS, 3, 2), (NUM_EXPERTS, 2, 3)]


def _global_grads() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    dense = [torch.randn(s, generator=generator) for s in DENSE_SHAPES]
    expert = [torch.randn(s, generator=generator) for s in EXPERT_SHAPES]
    return dense, expert


def _param(grad: torch.Tensor) -> nn.Parameter:
    param = nn.Parameter(torch.zeros_like(grad))
    param.grad = grad.clone()
    return param


def test_one_process_matches_torch():
    model = build_model(presets.tiny())
    twin = copy.deepcopy(model)
    tokens = torch.randint(0, 320, (2, 17))
    for m in (model, twin):
        m.loss(m(tokens[:, :-1]), tokens[:, 1:]).backward()
    pairs = params_with_kinds(build_param_groups(model, presets.tiny().train))
    assert {kind for _, kind in pairs} == {"dense", "router", "expert"}

    norm = clip_grad_norm_(pairs, MAX_NORM)
    want = torch.nn.utils.clip_grad_norm_(twin.parameters(), MAX_NORM)
    torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
    assert norm > MAX_NORM
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    assert global_grad_norm(pairs) == pytest.approx(MAX_NORM, rel=1e-5)


def test_bf16_gradients_and_missing_gradients():
    grad = torch.randn(5, 3).to(torch.bfloat16)
    param, unused = _param(grad), nn.Parameter(torch.zeros(3))
    norm = clip_grad_norm_([(param, "dense"), (unused, "expert")], MAX_NORM)
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm, grad.float().norm(), rtol=1e-6, atol=0)
    assert param.grad.dtype == torch.bfloat16
    torch.testing.assert_close(param.grad.float().norm(), torch.tensor(MAX_NORM), rtol=1e-2, atol=0)


def _clip_worker(rank: int, world_size: int) -> dict:
    dense, expert = _global_grads()
    want = torch.nn.utils.get_total_norm(dense + expert)
    clipped = [g * min(1.0, MAX_NORM / (want.item() + 1e-6)) for g in dense + expert]
    out = {}

    # (dp=4, ep=2): dense gradients everywhere, expert rows of this ep rank.
    ep_groups = [dist.new_group([2 * i, 2 * i + 1]) for i in range(2)]
    ep_rank, ep_group = rank % 2, ep_groups[rank // 2]
    rows = slice(ep_rank * NUM_EXPERTS // 2, (ep_rank + 1) * NUM_EXPERTS // 2)
    pairs = [(_param(g), "dense") for g in dense] + [(_param(g[rows]), "expert") for g in expert]
    out["dp4_ep2"] = global_grad_norm(pairs, ep_group=ep_group)
    clip_grad_norm_(pairs, MAX_NORM, ep_group=ep_group)
    local_clipped = clipped[: len(dense)] + [g[rows] for g in clipped[len(dense) :]]
    out["dp4_ep2_clipped"] = all(
        torch.allclose(p.grad, g, rtol=1e-6, atol=0)
        for (p, _), g in zip(pairs, local_clipped, strict=True)
    )

    # (pp=2, dp=2, ep=2): stage s holds dense[s] and expert[s]; ep groups inside each stage.
    pp_groups = [dist.new_group([i, 2 + i]) for i in range(2)]
    stage = rank // 2
    pairs = [(_param(dense[stage]), "dense"), (_param(expert[stage][rows]), "expert")]
    out["pp2_dp2_ep2"] = global_grad_norm(pairs, ep_group=ep_group, pp_group=pp_groups[ep_rank])
    out["want"] = want
    return out


def test_norm_counts_every_element_once_across_dp_ep_pp():
    for rank, out in enumerate(run_distributed(_clip_worker, 4)):
        for layout in ("dp4_ep2", "pp2_dp2_ep2"):
            torch.testing.assert_close(
                out[layout], out["want"], rtol=1e-6, atol=0, msg=f"{layout}, rank {rank}"
            )
        assert out["dp4_ep2_clipped"], f"rank {rank}: clipped gradients differ"
