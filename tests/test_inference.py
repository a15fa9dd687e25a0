"""A model loaded from a checkpoint computes exactly what the trained model computed (buffers
outside the state dict, such as RoPE frequencies, included)."""

import torch

from moetrain.inference import generate, load_model
from moetrain.presets import tiny
from moetrain.train.trainer import Trainer


def test_loaded_model_equals_trained_model(tmp_cache, tmp_path):
    trainer = Trainer(
        tiny().with_overrides(["train.steps=3", "train.eval_every=0"]), tmp_path, progress=False
    )
    trainer.train()
    loaded, _ = load_model(tmp_path)
    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(0))
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model.logits(trainer.model(tokens))
        got = loaded.logits(loaded(tokens))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    first = generate(loaded, [100, 101], max_new_tokens=5, seed=3)
    assert first == generate(loaded, [100, 101], max_new_tokens=5, seed=3) and len(first) <= 5
