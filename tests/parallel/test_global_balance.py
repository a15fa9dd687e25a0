"""moe.lb_scope = global_batch: with the route counts summed over data-parallel ranks, dp ranks
reproduce one process on the whole global micro-batch, balance loss included; the micro-batch
scope does not (so the test can tell them apart)."""

import torch
import torch.distributed as dist
from conftest import run_distributed

from moetrain.model.transformer import Transformer, build_model
from moetrain.parallel import init_distributed, parallelize
from moetrain.presets import tiny

OVERRIDES = [
    "model.d_model=32",
    "moe.lb_loss_weight=0.5",
    "moe.z_loss_weight=0.0",
    "parallel.compile=false",
]


def _batch():
    return torch.randint(0, 320, (4, 17), generator=torch.Generator().manual_seed(5))


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _reference(scope):
    model = build_model(tiny().with_overrides([*OVERRIDES, f"moe.lb_scope={scope}"]))
    tokens = _batch()
    model.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    return _grads(model)


def _dp_grads(rank, world, scope):
    config = tiny().with_overrides([*OVERRIDES, f"moe.lb_scope={scope}"])
    dims = init_distributed(config, device_type="cpu")
    with torch.device("meta"):
        model = Transformer(config)
    parallelize(model, config, dims)
    model.to_empty(device="cpu")
    model.init_weights()
    tokens = _batch().chunk(world)[rank]
    model.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    grads = _grads(model)
    for g in grads.values():
        dist.all_reduce(g)
        g /= world
    return grads


def test_global_batch_scope_matches_one_process():
    reference = _reference("micro_batch")
    global_scope = run_distributed(_dp_grads, 2, "global_batch")[0]
    local_scope = run_distributed(_dp_grads, 2, "micro_batch")[0]
    router = "blocks.0.ffn.router.gate.weight"
    for name, g in reference.items():
        torch.testing.assert_close(global_scope[name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert not torch.allclose(local_scope[router], reference[router], rtol=1e-5, atol=1e-7)
