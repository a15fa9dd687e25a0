"""A Trainer's optimizer and gradient sync are freed with it: their gradient hooks stay on the
parameters but hold them weakly (moetrain.optim.grad_buckets). Before, the ShardedAdamW and the
GradientSync of every Trainer built in one process stayed alive, with their buffers."""

import gc
import weakref

import pytest

from moetrain.optim.sharded import ShardedAdamW
from moetrain.parallel.data import GradientSync
from moetrain.presets import tiny
from moetrain.train.trainer import Trainer


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
