"""The bucket protocol GradientSync and ShardedAdamW share (moetrain.optim.grad_buckets), tested
once through an owner that records what each launch sees: gradients into flat buckets, a bucket
launched once its gradients are final, in bucket order, while backward runs; a launched bucket
holds exactly this step's sum (nothing from the step before, zero for an unused parameter)."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
from torch import nn

from moetrain.config.presets import tiny
from moetrain.optim.grad_buckets import BucketedGrads, GradBucket, split_into_buckets
from moetrain.optim.sharded import ShardedAdamW
from moetrain.parallel.data import GradientSync
from moetrain.train.trainer import Trainer


class Recorder(BucketedGrads):
    """Buckets of about `size` bytes over `model`'s parameters in reverse order; each launch
    records (bucket index, a copy of its buffer)."""

    def __init__(self, model: nn.Module, grad_dtype: torch.dtype | None, size: float) -> None:
        self.launches = []
        buckets = []
        for params in split_into_buckets(
            list(reversed(list(model.parameters()))),
            key=lambda p: p.dtype,
            nbytes=lambda p: p.numel() * p.element_size(),
            size=size,
        ):
            starts = [0]
            for p in params[:-1]:
                starts.append(starts[-1] + p.numel())
            flat = torch.zeros(sum(p.numel() for p in params), dtype=grad_dtype or params[0].dtype)
            buckets.append(
                GradBucket(
                    params=params, grads_flat=flat, starts=starts, accumulate=grad_dtype is not None
                )
            )
        self._init_buckets(buckets)

    def _launch(self, bucket: GradBucket):
        self.launches.append((self.buckets.index(bucket), bucket.grads_flat.clone()))


def _model(dtype: torch.dtype) -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8), "c": nn.Linear(8, 4)}).to(
        dtype
    )


def _loss(model: nn.ModuleDict, x: torch.Tensor, branches: tuple[str, ...]) -> torch.Tensor:
    h = model["a"](x).tanh()
    return sum(model[n](h).float().square().sum() for n in branches)


@pytest.mark.parametrize(
    "param_dtype, grad_dtype", [(torch.float32, None), (torch.bfloat16, torch.float32)],
    ids=["view", "accumulate"],
)  # fmt: skip
def test_launched_buckets_hold_this_steps_gradients_in_bucket_order(param_dtype, grad_dtype):
    model = _model(param_dtype)
    sync = Recorder(model, grad_dtype, size=1)  # one parameter a bucket
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(1)
    for step, branches in enumerate([("b", "c"), ("b",), ("b", "c")]):  # c unused in step 1
        xs = [torch.randn(6, 8, generator=gen).to(param_dtype) for _ in range(3)]
        expected = [torch.zeros_like(p, dtype=grad_dtype or param_dtype) for p in params]
        sync.launches.clear()
        for i, x in enumerate(xs):
            with sync.no_sync() if i < len(xs) - 1 else contextlib.nullcontext():
                _loss(model, x, branches).backward()
            grads = torch.autograd.grad(_loss(model, x, branches), params, allow_unused=True)
            for e, g in zip(expected, grads, strict=True):
                if g is not None:
                    e += g.to(e.dtype)
        # the hooks launched during backward, in order: all when every parameter got a
        # gradient; none while the first bucket (c's bias, unused in step 1) is not final
        assert len(sync.launches) == (len(sync.buckets) if "c" in branches else 0), step
        sync.launch_remaining()
        assert [b for b, _ in sync.launches] == list(range(len(sync.buckets))), step
        for b, flat in sync.launches:
            bucket = sync.buckets[b]
            (param,) = bucket.params
            want = expected[next(i for i, p in enumerate(params) if p is param)]
            assert torch.equal(flat.view_as(want), want), (step, b)
            if grad_dtype is None:
                assert param.grad.data_ptr() == bucket.grad_view(0).data_ptr()
            else:
                assert param.grad is None  # moved into the wider buffer
        with pytest.raises(RuntimeError, match="no_sync"):
            _loss(model, xs[0], branches).backward()  # a backward after the step's last one
        sync.end_step()
        for p in params:
            p.grad = None  # the optimizers' zero_grad


# A Trainer's optimizer and gradient sync are freed with it: their hooks stay on the parameters
# but hold them weakly. Before, the ShardedAdamW and the GradientSync of every Trainer built in
# one process stayed alive, with their buffers.
@pytest.mark.parametrize(
    "overrides,kind",
    [
        (["train.optimizer=sharded"], ShardedAdamW),
        # two micro-batches in bf16: fp32 gradient buffers in a GradientSync
        (["precision.param_dtype=bf16", "train.global_batch_tokens=512"], GradientSync),
    ],
    ids=["sharded", "grad-sync"],
)
def test_a_trainer_and_its_gradient_owners_are_freed(tmp_path, overrides, kind):
    config = tiny().with_overrides(
        [*overrides, "train.seq_len=64", "train.micro_batch_size=4", "parallel.compile=false"]
    )
    trainer = Trainer(config, tmp_path, device="cpu", progress=False)
    it = iter(trainer.train_loader)
    trainer.train_step(it)
    owner = trainer.optimizer if kind is ShardedAdamW else trainer.optimizer.grad_sync
    assert isinstance(owner, kind)
    param = next(trainer.model.parameters())
    assert param._post_accumulate_grad_hooks  # the hooks are there, on a parameter kept below
    owner_ref, model_ref = weakref.ref(owner), weakref.ref(trainer.model)
    trainer.metrics.close()
    del trainer, it, owner
    gc.collect()
    assert model_ref() is None and owner_ref() is None
