"""GPU-only checks of the single-device path (run on the H200 with `pytest -m gpu`)."""

import pytest
import torch

from moetrain.config.presets import small
from moetrain.moe.experts import grouped_mm, grouped_mm_reference

pytestmark = pytest.mark.gpu

FP8 = [
    "precision.dispatch=fp8",
    "precision.experts=fp8_rowwise",
    "precision.linear=fp8_rowwise",
    "precision.lm_head=fp8_rowwise",
]


@pytest.mark.parametrize(
    "precision",
    [[], FP8],
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


@pytest.mark.parametrize("precision", [[], FP8], ids=["bf16", "fp8"])
def test_cuda_graph_replays_the_eager_step_bit_for_bit(tmp_path, precision):
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
            *precision,
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


def test_graphed_run_with_eval_checkpoints_and_resume_matches_uninterrupted(tmp_cache, tmp_path):
    """A graphed training run on the embedded corpus, with evaluation (val loss and the built-in
    task, compiled) and checkpoints between replays, stopped at step 6 and resumed (which
    rebuilds the graph: two eager steps, a new capture): losses, eval rows and weights bit for
    bit those of the uninterrupted run (math attention, as cuDNN's backward is not
    deterministic)."""
    import json

    from moetrain.config.presets import tiny
    from moetrain.train.trainer import Trainer

    def cfg(steps):
        return tiny().with_overrides(
            [
                f"train.steps={steps}",
                "train.checkpoint_every=6",
                "train.eval_every=4",
                "train.log_every=2",
                "model.attention_backend=math",
                "train.cuda_graph=true",
                "train.eval_tasks=[continuation]",
            ]
        )

    def losses(run_dir, kind="train"):
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r if kind == "eval" else r["loss"] for r in lines if r["kind"] == kind}

    full = Trainer(cfg(12), tmp_path / "full", device="cuda", progress=False)
    full.train()
    assert full.step_graph.graph is not None
    Trainer(cfg(6), tmp_path / "part", device="cuda", progress=False).train()
    resumed = Trainer(cfg(12), tmp_path / "part", resume=True, device="cuda", progress=False)
    assert resumed.step == 6
    resumed.train()
    a, b = losses(tmp_path / "full"), losses(tmp_path / "part")
    assert all(a[step] == b[step] for step in (8, 10, 12)), (a, b)
    a, b = losses(tmp_path / "full", "eval"), losses(tmp_path / "part", "eval")
    assert a[8] == b[8] and a[12] == b[12] and "continuation" in a[12]["tasks"], (a, b)
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters(), strict=True):
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


@pytest.mark.parametrize("optimizer", ["adamw", "sharded"])
def test_fp8_training_tracks_bf16(tmp_path, optimizer):
    """FP8 row-wise expert GEMMs, projections and LM head (tensor cores, compiled) and the FP8
    dispatch payload against the bf16 run from the same seed on the same batches, with the Triton
    AdamW or ZeRO-1 (torch's fused AdamW writing through bucket views): the loss at every step
    within 2%.
    A stale quantized weight or a wrong scale shows as a drift far past that."""
    from moetrain.train.trainer import Trainer

    def losses(precision: list[str], run_dir) -> list[float]:
        config = small().with_overrides(
            [
                "model.num_layers=2",
                "train.micro_batch_size=2",
                "data.random_tokens=true",
                "train.eval_every=0",
                "train.cuda_graph=false",
                "train.lr=1e-3",
                f"train.optimizer={optimizer}",
                *precision,
            ]
        )
        trainer = Trainer(config, run_dir, device="cuda", progress=False)
        it = iter(trainer.train_loader)
        return [trainer.train_step(it).item() for _ in range(6)]

    bf16 = losses([], tmp_path / "bf16")
    fp8 = losses(FP8, tmp_path / "fp8")
    assert bf16[-1] < bf16[0]
    for step, (a, b) in enumerate(zip(fp8, bf16, strict=True)):
        assert abs(a - b) <= 0.02 * b, (step, a, b)
