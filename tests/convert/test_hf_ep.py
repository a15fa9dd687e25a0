"""Export works for a checkpoint saved under expert parallelism (ep=2, two gloo processes): the
Hugging Face model's logits equal those of the same weights built at ep=1 with the same seed."""

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors.torch")

from conftest import run_distributed  # noqa: E402

from moetrain.config.presets import tiny  # noqa: E402
from moetrain.model.transformer import build_model  # noqa: E402
from moetrain.tools.convert.io import export_checkpoint, import_hf  # noqa: E402

OVERRIDES = ["train.steps=2", "train.eval_every=0", "train.log_every=1", "parallel.compile=false"]


def _train_ep2(rank, world, run_dir, cache):
    os.environ["MOETRAIN_CACHE"] = cache
    from moetrain.train.trainer import Trainer

    config = tiny().with_overrides([*OVERRIDES, "parallel.ep=2"])
    trainer = Trainer(config, run_dir, progress=False)
    # at init, the global weights equal the one-process model's of the same seed
    if rank == 0:
        reference = build_model(tiny())
        local = trainer.model.blocks["0"].ffn.experts.w_up_eD2F
        assert torch.equal(local, reference.blocks["0"].ffn.experts.w_up_eD2F[:4])
    trainer.train()


def test_export_of_an_ep2_checkpoint(tmp_path):
    run = tmp_path / "run"
    run_distributed(_train_ep2, 2, str(run), str(tmp_path / "cache"))
    checkpoint = run / "checkpoints" / "step-2"
    hf_dir = export_checkpoint(checkpoint, tmp_path / "hf")

    from moetrain.checkpoint.trained_model import load_model

    model, config = load_model(checkpoint)  # the ep=2 checkpoint loaded at world size 1
    assert model.blocks["1"].ffn.experts.w_down_eFD.shape[0] == config.moe.num_experts
    hf_model = transformers.OlmoeForCausalLM.from_pretrained(hf_dir, attn_implementation="eager")
    tokens = torch.randint(
        0, config.model.vocab_size, (2, 23), generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        ours = model.logits(model(tokens))
        theirs = hf_model(tokens).logits
    assert (ours - theirs).abs().max() < 1e-4
    imported = import_hf(hf_dir, tmp_path / "imported")
    again, _ = load_model(imported)
    for (name, p), (_, q) in zip(
        model.state_dict().items(), again.state_dict().items(), strict=True
    ):
        assert torch.equal(p, q), name
