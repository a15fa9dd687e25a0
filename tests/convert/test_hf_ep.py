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


def _continue_from_import(rank, world, imported, run_dir, cache):
    """A Qwen3-MoE import trained on at ep=2: at start each rank holds its experts of the import."""
    os.environ["MOETRAIN_CACHE"] = cache
    from moetrain.checkpoint.trained_model import load_model
    from moetrain.train.trainer import Trainer

    _, config = load_model(imported)
    config = config.with_overrides([*OVERRIDES, "parallel.ep=2", "train.optimizer=sharded"])
    trainer = Trainer(config, run_dir, progress=False, init_from=imported)
    reference, _ = load_model(imported)
    local = trainer.model.blocks["0"].ffn.experts.w_up_eD2F
    experts = config.moe.num_experts // 2
    assert torch.equal(
        local, reference.blocks["0"].ffn.experts.w_up_eD2F[rank * experts : (rank + 1) * experts]
    )
    trainer.train()


def test_continued_pretraining_from_a_qwen3_import_at_ep2(tmp_path):
    """`moetrain import` of a transformers Qwen3-MoE model, then a new run at world 2 (ep=2,
    sharded optimizer) initialized from it; its checkpoint exports back to Qwen3MoeForCausalLM
    and differs from the import (it trained)."""
    hf_config = transformers.Qwen3MoeConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(hf_config).save_pretrained(tmp_path / "hf")
    imported = import_hf(tmp_path / "hf", tmp_path / "imported")
    run = tmp_path / "cpt"
    run_distributed(_continue_from_import, 2, imported, str(run), str(tmp_path / "cache"))

    from moetrain.checkpoint.trained_model import load_model

    trained, _ = load_model(run / "checkpoints" / "step-2")
    start, _ = load_model(imported)
    assert not torch.equal(trained.embed.weight, start.embed.weight)
    out = export_checkpoint(run / "checkpoints" / "step-2", tmp_path / "exported")
    hf_model = transformers.Qwen3MoeForCausalLM.from_pretrained(out, attn_implementation="eager")
    tokens = torch.randint(0, 320, (2, 23), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (trained.logits(trained(tokens)) - hf_model(tokens).logits).abs().max() < 1e-5
