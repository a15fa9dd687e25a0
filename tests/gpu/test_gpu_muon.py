"""Muon on the GPU (`pytest -m gpu`): the bf16 Newton-Schulz on CUDA against the fp32
per-matrix reference, training steps without a host sync for both Muon optimizers, and the
graphed step equal bit for bit to the eager one."""

import pytest
import torch

from moetrain.config.presets import small
from moetrain.optim.newton_schulz import QUINTIC, newton_schulz, newton_schulz_reference

pytestmark = pytest.mark.gpu

BF16_REL = 4e-2  # tests/optim/test_muon.py: measured 1.4-1.9% per orthogonalization on the CPU


def _quintic_peak() -> float:
    """The largest value a * x + b * x^3 + c * x^5 takes on [0, 1]: no singular value of an
    iterate whose values lie in [0, 1] can leave [0, peak] (about 1.2025) in exact arithmetic."""
    a, b, c = QUINTIC
    x = torch.linspace(0, 1, 100_001, dtype=torch.float64)
    return float((a * x + b * x**3 + c * x**5).max())


SV_MAX = _quintic_peak() * (1 + 2**-6)  # plus bf16 rounding of the last product


@pytest.mark.parametrize("shape", [(16, 1024, 512), (8, 512, 1024), (4, 1024, 1024)])
def test_newton_schulz_on_cuda_matches_the_fp32_reference(shape):
    generator = torch.Generator(device="cuda").manual_seed(sum(shape))
    g = torch.randn(shape, device="cuda", generator=generator)
    fast = newton_schulz(g, 5)
    assert fast.dtype == torch.bfloat16
    for fast_m, g_m in zip(fast, g, strict=True):
        ref = newton_schulz_reference(g_m, 5)
        err = (fast_m.double() - ref.double()).norm() / ref.double().norm()
        assert err <= BF16_REL, err.item()
        # the quintic's band, whose floor a square Gaussian matrix's smallest values are below
        sv = torch.linalg.svdvals(fast_m.float())
        low = 0.65 if shape[1] != shape[2] else 0.0
        assert low <= sv.min() and sv.max() <= SV_MAX, (sv.min().item(), sv.max().item())


def _config(optimizer: str, *extra: str):
    return small().with_overrides(
        [
            "model.num_layers=2",
            "train.micro_batch_size=2",
            "train.global_batch_tokens=8192",  # two micro-batches of 2 x 2048
            "data.random_tokens=true",
            "train.eval_every=0",
            f"train.optimizer={optimizer}",
            *extra,
        ]
    )


@pytest.mark.parametrize("optimizer", ["muon", "muon_sharded"])
def test_muon_training_steps_have_no_host_sync(tmp_path, optimizer):
    from moetrain.train.trainer import Trainer

    config = _config(optimizer, "train.cuda_graph=false")
    trainer = Trainer(config, tmp_path, device="cuda", progress=False)
    it = iter(trainer.train_loader)
    trainer.train_step(it)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            loss = trainer.train_step(it)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()


def test_muon_step_is_graphed_and_replays_the_eager_step_bit_for_bit(tmp_path):
    """train.optimizer=muon is captured with the rest of the step (the Triton AdamW reads the
    device learning rate, Muon's update takes it as a tensor): losses and weights of the graphed
    trainer equal an eager one's through warm-up, capture and replays (math attention, as
    cuDNN's backward is not deterministic)."""
    from moetrain.optim.schedule import lr_at
    from moetrain.train.trainer import Trainer

    config = _config("muon", "model.attention_backend=math", "train.warmup_steps=10")
    graphed = Trainer(config, tmp_path / "g", device="cuda", progress=False)
    eager = Trainer(
        config.with_overrides(["train.cuda_graph=false"]),
        tmp_path / "e",
        device="cuda",
        progress=False,
    )
    assert graphed.step_graph is not None
    it_g, it_e = iter(graphed.train_loader), iter(eager.train_loader)
    losses_g, losses_e = [], []
    for step in range(6):
        if step >= 3:
            assert graphed.step_graph.graph is not None
            torch.cuda.set_sync_debug_mode("error")
        losses_g.append(graphed.train_step(it_g).clone())
        torch.cuda.set_sync_debug_mode("default")
        lr = torch.tensor(lr_at(step, config.train), dtype=torch.float64, device="cuda")
        losses_e.append(eager._device_step(it_e, lr))
    assert torch.equal(torch.stack(losses_g), torch.stack(losses_e)), (losses_g, losses_e)
    for (name, p), q in zip(
        graphed.model.named_parameters(), eager.model.parameters(), strict=True
    ):
        assert torch.equal(p, q), name
