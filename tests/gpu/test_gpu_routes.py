"""GPU checks of recorded and replayed routes (run on the GPU with `pytest -m gpu`)."""

import pytest
import torch

from moetrain.config.presets import small
from moetrain.train.routes import load_routes

pytestmark = pytest.mark.gpu


def test_a_graphed_recording_holds_the_eager_steps_routes_and_a_replay_repeats_them(tmp_path):
    """The recorder's in-step copies are captured in the step's CUDA graph and its ring copy runs
    after each replay: a graphed run records what the eager run does, step by step, with two
    micro-batches a step; replaying it (eagerly) routes alike without a host sync in the step."""
    from moetrain.train.trainer import Trainer

    config = small().with_overrides(
        [
            "model.num_layers=2",
            "model.attention_backend=math",
            "train.seq_len=256",
            "train.micro_batch_size=2",
            "train.global_batch_tokens=1024",
            "data.random_tokens=true",
            "train.eval_every=0",
            "train.steps=7",
            "train.log_every=3",
            "moe.record_routes=true",
        ]
    )
    runs = {"g": config, "e": config.with_overrides(["train.cuda_graph=false"])}
    for name, run_config in runs.items():
        Trainer(run_config, tmp_path / name, device="cuda", progress=False).train()
    graphed, eager = (load_routes(tmp_path / name / "routes")["routes"] for name in "ge")
    assert graphed.shape[0] == 14 and torch.equal(graphed, eager)
    replay = config.with_overrides([f"moe.replay_routes={tmp_path / 'g' / 'routes'}"])
    trainer = Trainer(replay, tmp_path / "r", device="cuda", progress=False)
    it = iter(trainer.train_loader)
    trainer.train_step(it)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            trainer.train_step(it)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    trainer.train()
    assert torch.equal(load_routes(tmp_path / "r" / "routes")["routes"], graphed)
