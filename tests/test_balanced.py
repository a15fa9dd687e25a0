"""BalancedDispatcher against a per-route reference, and the model one rank runs in the 8-GPU
projection: exactly one rank's expert parameters and rows."""

import pytest
import torch

from moetrain.config.presets import tiny
from moetrain.model.transformer import Transformer
from moetrain.moe.experts import GroupedExperts
from moetrain.moe.router import RouterConfig, TopKRouter
from moetrain.tools import plan as P
from moetrain.tools.bench.balanced import BalancedDispatcher
from moetrain.tools.bench.measure_rank import rank_transform
from moetrain.tools.plan.rank_compute import rank_model_params


@pytest.mark.parametrize(("num_local", "top_k"), [(3, 2), (1, 4), (4, 4)])
def test_balanced_dispatch_equals_the_per_route_sum(num_local, top_k):
    torch.manual_seed(num_local)
    T, D, F, E = 10, 8, 16, 12
    router = TopKRouter(D, RouterConfig(num_experts=E, top_k=top_k)).double()
    experts = GroupedExperts(num_local, D, F).double()
    torch.nn.init.normal_(experts.w_up_eD2F)
    torch.nn.init.normal_(experts.w_down_eFD)
    x = torch.randn(T, D, dtype=torch.float64)
    routing = router(x)
    dispatcher = BalancedDispatcher(num_local)
    rows, offsets, handle = dispatcher.dispatch(x, routing)
    y = dispatcher.combine(experts(rows, offsets, handle.row_weights_N), handle)

    expected = torch.zeros_like(x)
    for t in range(T):
        for k in range(top_k):
            e = (t * top_k + k) % num_local
            gate, up = (x[t] @ experts.w_up_eD2F[e]).chunk(2, dim=-1)
            h = torch.nn.functional.silu(gate) * up * routing.weights_TK[t, k]
            expected[t] += h @ experts.w_down_eFD[e]
    torch.testing.assert_close(y, expected)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    assert rows.shape[0] == T * top_k and counts.sum() == T * top_k
    assert counts.max() - counts.min() <= 1
    # the router's weights carry the gradient: its gate gets one
    y.sum().backward()
    assert router.gate.weight.grad is not None and router.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_the_rank_model_has_one_ranks_experts_and_rows(gpus):
    """tiny: E = 8, K = 2. At ep = N a rank holds E / N experts a layer (the dry run's and the
    planner's count) and its experts take T K rows, N T K / E each: the share of uniform routing
    over the N ranks' N T K routes."""
    config = tiny()
    E, K = config.moe.num_experts, config.moe.top_k
    num_local = E // gpus
    with torch.device("meta"):
        model = Transformer(config)
    rank_transform(num_local)(model)
    model.to_empty(device="cpu")
    model.init_weights(0)
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    planned = P.rank_params(config, pp=1, ep=gpus, stage=0)
    assert expert_params == planned.experts == rank_model_params(config, num_local)[1]
    assert sum(p.numel() for p in model.parameters()) == planned.total

    seen = []
    for layer in model.moe_layers():
        layer.experts.register_forward_hook(
            lambda m, args, out: seen.append(
                (args[0].shape[0], torch.diff(args[1], prepend=args[1].new_zeros(1)))
            )
        )
    B, S = 2, config.train.seq_len
    T = B * S
    tokens = torch.randint(0, config.model.vocab_size, (B, S))
    model.loss(model(tokens), tokens).backward()
    assert len(seen) == config.model.num_layers
    for rows, per_expert in seen:
        assert rows == T * K
        assert per_expert.tolist() == [gpus * T * K // E] * num_local
    # the router still chooses among all E experts
    assert all(layer.router.gate.weight.shape[0] == E for layer in model.moe_layers())


def test_the_rank_model_keeps_the_precision_plan():
    """The transform runs after the recipe installed the precision plan: its dispatchers move
    the rows with the plan's payload and hand the FP8 experts the rows they quantized."""
    from moetrain.moe.payload import FP8_PAYLOAD
    from moetrain.parallel.mesh import ParallelDims
    from moetrain.parallel.parallelize import parallelize
    from moetrain.parallel.precision import resolve_precision

    config = tiny().with_overrides(["precision.experts=fp8_rowwise", "precision.dispatch=fp8"])
    plan = resolve_precision(config, torch.device("cpu"))
    with torch.device("meta"):
        model = Transformer(config)
    parallelize(model, config, ParallelDims(local_rank=0, device=torch.device("cpu")), plan)
    rank_transform(2)(model)
    for layer in model.moe_layers():
        assert layer.dispatcher.payload is FP8_PAYLOAD
        x = torch.randn(6, config.model.d_model)
        rows, _, handle = layer.dispatcher.dispatch(
            x, TopKRouter(x.shape[1], RouterConfig(num_experts=8, top_k=2))(x)
        )
        q, scale = handle.rows_fp8
        assert q.shape == rows.shape and scale.shape == rows.shape[:1]
