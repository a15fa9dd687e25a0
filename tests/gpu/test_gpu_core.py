"""GPU-only checks of the single-device path (run on the H200 with `pytest -m gpu`)."""

import pytest
import torch

from moetrain.moe.experts import grouped_mm, grouped_mm_reference
from moetrain.presets import small

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "precision",
    [[], ["precision.dispatch=fp8", "precision.experts=fp8_rowwise"]],
    ids=["bf16", "fp8"],
)
def test_training_steps_of_small_have_no_host_sync(tmp_path, precision):
    from moetrain.train.trainer import Trainer

    config = small().with_overrides(
        [
            "model.num_layers=2",
            "train.micro_batch_size=2",
            "data.random_tokens=true",
            "train.eval_every=0",
            *precision,
        ]
    )
    trainer = Trainer(config, tmp_path, device="cuda", progress=False)
    it = iter(trainer.train_loader)
    trainer.train_step(it)  # first step allocates optimizer state; not part of the steady state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            loss = trainer.train_step(it)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()


def test_grouped_mm_bf16_on_gpu_matches_loop():
    torch.manual_seed(0)
    counts = torch.tensor([300, 0, 1200, 77, 513])
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(5, 256, 512, device="cuda", dtype=torch.bfloat16) / 16
    offs = counts.cumsum(0).to(device="cuda", dtype=torch.int32)
    y, ref = grouped_mm(x, w, offs), grouped_mm_reference(x.float(), w.float(), offs)
    rel = (y.float() - ref).norm() / ref.norm()
    assert rel < 1e-2, rel
