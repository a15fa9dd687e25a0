"""moe.lb_scope = micro_batch_dp: the balance loss's fractions count the route counts of each
micro-batch summed over the data-parallel ranks. dp ranks under gradient accumulation reproduce
one process that runs each accumulation micro-batch of every rank at once, balance loss included;
the micro_batch scope does not (so the test can tell them apart), and neither reproduces one
micro-batch of the whole global batch: the counts never span a step's micro-batches, which is why
the scope is not called global_batch (its old name, now an error naming the new one)."""

import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed

from moetrain.config.presets import tiny
from moetrain.model.transformer import Transformer, build_model
from moetrain.parallel import init_distributed, parallelize
from moetrain.train.step import forward_backward

OVERRIDES = [
    "model.d_model=32",
    "moe.lb_loss_weight=0.5",
    "moe.z_loss_weight=0.0",
    "parallel.compile=false",
]
ACCUM, MICRO, SEQ = 2, 2, 16
ROUTER = "blocks.0.ffn.router.gate.weight"


def _config(scope):
    return tiny().with_overrides([*OVERRIDES, f"moe.lb_scope={scope}"])


def _micro_batches(world):
    """Every micro-batch of one step, [accumulation micro-batch, rank, sequence, position]."""
    shape = (ACCUM, world, MICRO, SEQ + 1)
    return torch.randint(0, 320, shape, generator=torch.Generator().manual_seed(5))


def _step_grads(model, micro_batches):
    """The gradients of one step's forward and backward (the trainer's, 1/accum scaling)."""
    batches = iter((tokens[:, :-1], tokens[:, 1:]) for tokens in micro_batches)
    forward_backward(model, batches, len(micro_batches))
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _dp_grads(rank, world):
    """Per scope, this rank's step over its micro-batches, gradients averaged over the ranks."""
    out = {}
    for scope in ("micro_batch_dp", "micro_batch"):
        config = _config(scope)
        dims = init_distributed(config, device_type="cpu")
        with torch.device("meta"):
            model = Transformer(config)
        parallelize(model, config, dims)
        model.to_empty(device="cpu")
        model.init_weights()
        grads = _step_grads(model, list(_micro_batches(world)[:, rank]))
        for g in grads.values():
            dist.all_reduce(g)
            g /= world
        out[scope] = grads
    return out


def test_micro_batch_dp_scope_matches_one_process_on_each_micro_batch_of_all_ranks():
    world = 2
    dp = run_distributed(_dp_grads, world)[0]
    step = _micro_batches(world)
    per_micro_batch = _step_grads(build_model(_config("micro_batch")), list(step.flatten(1, 2)))
    for name, g in per_micro_batch.items():
        torch.testing.assert_close(dp["micro_batch_dp"][name], g, rtol=1e-5, atol=1e-7, msg=name)
    close = {"rtol": 1e-5, "atol": 1e-7}
    assert not torch.allclose(dp["micro_batch"][ROUTER], per_micro_batch[ROUTER], **close)
    whole = _step_grads(build_model(_config("micro_batch")), [step.flatten(0, 2)])
    assert not torch.allclose(dp["micro_batch_dp"][ROUTER], whole[ROUTER], **close)


def test_the_old_name_global_batch_is_an_error_naming_the_new_one():
    with pytest.raises(ValueError, match=r"^moe\.lb_scope \('global_batch'\) was renamed micro_b"):
        tiny().with_overrides(["moe.lb_scope=global_batch"])
