"""Optimizers that write parameters where autograd's version counter cannot see it (the Triton
AdamW through raw pointers, ZeRO-1 through bucket views) bump the counter themselves, so the FP8
expert GEMM's weight cache never serves quantized weights of an earlier step.

Checked end to end: after a few training steps every cached quantization equals a fresh
quantization of the weight as it is now, and the cache re-quantized at every step."""

from __future__ import annotations

import pytest
import torch

from moetrain.moe.fp8_gemm import FP8RowwiseGroupedGemm
from moetrain.presets import tiny
from moetrain.train.trainer import Trainer

STEPS = 3


def _check_cache_is_current(trainer: Trainer) -> None:
    layers = list(trainer.model.moe_layers())
    gemm = layers[0].experts.gemm
    assert isinstance(gemm, FP8RowwiseGroupedGemm)
    # every layer quantizes both weights in two layouts (forward, input gradient) each step
    assert gemm.weight_cache.num_quantizations == STEPS * 4 * len(layers)
    fresh = FP8RowwiseGroupedGemm(emulate=True, cache_weights=False)
    fresh.quantize = gemm.quantize  # the same quantizer (Triton on the GPU), no cache
    checked = 0
    for layer in layers:
        for w in (layer.experts.w_up_eD2F, layer.experts.w_down_eFD):
            for reduction in ("D", "F"):
                cached = gemm.quantized_weight(w, reduction)  # what the next step would use
                expected = fresh.quantized_weight(w, reduction)
                for a, b in zip(cached, expected, strict=True):
                    assert torch.equal(a.float(), b.float()), "stale quantized weight served"
                checked += 1
    assert checked == 4 * len(layers)


def _config(optimizer: str, *extra: str):
    return tiny().with_overrides(
        [
            f"train.optimizer={optimizer}",
            "precision.experts=fp8_rowwise",
            f"train.steps={STEPS}",
            "train.eval_every=0",
            "train.log_every=1",
            "train.lr=1e-2",
            "data.random_tokens=true",
            *extra,
        ]
    )


@pytest.mark.parametrize("optimizer", ["adamw", "sharded"])
def test_fp8_weight_cache_follows_the_optimizer_on_cpu(tmp_cache, tmp_path, optimizer):
    trainer = Trainer(_config(optimizer), tmp_path / "run", progress=False)
    trainer.train()
    _check_cache_is_current(trainer)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10),
    reason="needs a CUDA GPU with FP8 tensor cores (compute capability 9.x or 10.x)",
)
@pytest.mark.parametrize("optimizer", ["adamw", "sharded"])
def test_fp8_weight_cache_follows_the_optimizer_on_gpu(tmp_path, optimizer):
    """The users' path: bf16 parameters, the Triton AdamW (adamw) or torch's fused CUDA AdamW
    on the flat shards (sharded), real FP8 tensor-core GEMMs."""
    config = _config(optimizer, "model.d_model=128", "moe.expert_hidden=64")
    trainer = Trainer(config, tmp_path / "run", device="cuda", progress=False)
    if optimizer == "adamw":
        assert trainer.optimizer.kernel == "triton"
    trainer.train()
    _check_cache_is_current(trainer)
