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
            "train.cuda_graph=false",  # the eager step is what a graph captures; capture syncs once
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


def test_cuda_graph_replays_the_eager_step_bit_for_bit(tmp_path):
    """Two trainers from the same seed, one graphed (2 eager warm-up steps, capture, replays),
    one running the same device step eagerly with the same device learning rate: losses and
    weights agree bit for bit through warm-up, capture and replays, with gradient accumulation
    and a learning rate that changes every step. Math attention: cuDNN's backward accumulates
    with atomics, so two of its runs differ in the last bits."""
    from moetrain.optim.schedule import lr_at
    from moetrain.train.trainer import Trainer

    config = small().with_overrides(
        [
            "model.num_layers=2",
            "model.attention_backend=math",
            "train.seq_len=256",
            "train.micro_batch_size=2",
            "train.global_batch_tokens=1024",  # two micro-batches per step
            "train.warmup_steps=10",
            "data.random_tokens=true",
            "train.eval_every=0",
        ]
    )
    graphed = Trainer(config, tmp_path / "g", device="cuda", progress=False)
    eager = Trainer(
        config.with_overrides(["train.cuda_graph=false"]),
        tmp_path / "e",
        device="cuda",
        progress=False,
    )
    assert graphed.step_graph is not None and eager.step_graph is None
    it_g, it_e = iter(graphed.train_loader), iter(eager.train_loader)
    losses_g, losses_e = [], []
    for step in range(7):
        if step >= 4:  # steps 4-6 are replays: no host sync in them
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


def test_grouped_mm_bf16_on_gpu_matches_loop():
    torch.manual_seed(0)
    counts = torch.tensor([300, 0, 1200, 77, 513])
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(5, 256, 512, device="cuda", dtype=torch.bfloat16) / 16
    offs = counts.cumsum(0).to(device="cuda", dtype=torch.int32)
    y, ref = grouped_mm(x, w, offs), grouped_mm_reference(x.float(), w.float(), offs)
    rel = (y.float() - ref).norm() / ref.norm()
    assert rel < 1e-2, rel
