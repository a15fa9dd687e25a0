"""Qwen3-MoE and Mixtral both ways, offline: small random models built with transformers' own
config and model classes, saved by transformers, imported (logits equal in fp32), exported back
(weights bit for bit, logits equal again in transformers), both expert layouts; what a format
cannot express is an error naming the field, on import and on export."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from moetrain.checkpoint.trained_model import load_model  # noqa: E402
from moetrain.config.presets import get_preset  # noqa: E402
from moetrain.tools.convert import hf  # noqa: E402
from moetrain.tools.convert.io import export_checkpoint, import_hf  # noqa: E402

LOGITS_TOLERANCE = 1e-5  # fp32, absolute; the logits are O(1)
VOCAB = 320  # the byte tokenizer's, which an import without tokenizer files gets


def qwen3_config(**changes):
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )  # fmt: skip
    return transformers.Qwen3MoeConfig(**{**base, **changes})


def mixtral_config(**changes):
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )  # fmt: skip
    return transformers.MixtralConfig(**{**base, **changes})


MODELS = {"qwen3_moe": transformers.Qwen3MoeForCausalLM, "mixtral": transformers.MixtralForCausalLM}
VARIANTS = {
    # a dense layer between MoE ones, GQA, head_dim apart from hidden / heads, renormalized
    "qwen3": ("qwen3_moe", qwen3_config()),
    # dense layers off decoder_sparse_step (layers 0 and 2 of 4), no top-k renormalization
    "qwen3-sparse-step": (
        "qwen3_moe",
        qwen3_config(
            num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2, norm_topk_prob=False
        ),  # fmt: skip
    ),
    # the first layer dense (moetrain's num_dense_layers), tied embeddings, MHA
    "qwen3-first-dense-tied": (
        "qwen3_moe",
        qwen3_config(mlp_only_layers=[0], tie_word_embeddings=True, num_key_value_heads=4),
    ),
    "mixtral": ("mixtral", mixtral_config()),
    "mixtral-tied-mha": (
        "mixtral",
        mixtral_config(tie_word_embeddings=True, num_key_value_heads=4, head_dim=None),
    ),
}


def random_hf_model(family: str, hf_config, seed: int = 0):
    """The family's transformers model with every tensor random, norms included (ones would hide
    swaps), the routers decisive."""
    hf_config._attn_implementation = "eager"
    model = MODELS[family](hf_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=generator))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    return model.eval()


def tokens(vocab: int = VOCAB):
    return torch.randint(0, vocab, (3, 29), generator=torch.Generator().manual_seed(1))


def read_safetensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(safetensors_torch.load_file(str(file)))
    return tensors


def load_quietly(cls, directory, caplog):
    """from_pretrained, asserting no missing, unexpected or mismatched key and no warning."""
    hf_logger = logging.getLogger("transformers")  # does not propagate to caplog's root handler
    hf_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="transformers"):
            model, info = cls.from_pretrained(
                directory, output_loading_info=True, attn_implementation="eager"
            )
    finally:
        hf_logger.removeHandler(caplog.handler)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"] and not info["error_msgs"], info
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    return model.eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_import_export_round_trip_in_both_layouts(tmp_path, variant, caplog):
    family, hf_config = VARIANTS[variant]
    reference = random_hf_model(family, hf_config)
    reference.save_pretrained(tmp_path / "hf")  # the Hub's per-expert layout, by transformers
    with torch.no_grad():
        expected = reference(tokens()).logits

    checkpoint = import_hf(tmp_path / "hf", tmp_path / "imported")
    model, config = load_model(checkpoint)
    assert hf.export_format(config).name == family
    with torch.no_grad():
        assert (model.logits(model(tokens())) - expected).abs().max() <= LOGITS_TOLERANCE

    # transformers' in-memory layout (fused 3-D experts under `mlp`) maps to the same weights
    fused = hf.from_hf_state_dict(reference.state_dict(), config)
    for name, t in model.state_dict().items():
        assert torch.equal(fused[name], t), name
    in_memory = reference.state_dict()
    if hf_config.tie_word_embeddings:
        in_memory.pop("lm_head.weight")
    mapped = hf.to_hf_state_dict(model.state_dict(), config, expert_layout="fused")
    assert mapped.keys() == in_memory.keys()
    assert all(torch.equal(t, in_memory[name]) for name, t in mapped.items())

    out = export_checkpoint(checkpoint, tmp_path / "exported")
    saved, exported = read_safetensors(tmp_path / "hf"), read_safetensors(out)
    assert exported.keys() == saved.keys()
    for name, t in saved.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        MODELS[family].__name__
    ]
    again = load_quietly(MODELS[family], out, caplog)
    with torch.no_grad():
        assert torch.equal(again(tokens()).logits, expected)


def test_import_takes_the_module_names_of_either_layout():
    """Mixtral's Hub checkpoints name the MoE block `block_sparse_moe`, transformers 5 `mlp`:
    both import, per expert or fused, to the same weights."""
    family, hf_config = VARIANTS["mixtral"]
    reference = random_hf_model(family, hf_config, seed=3)
    config = hf.run_config_from_hf(hf_config.to_dict())
    model_sd = hf.from_hf_state_dict(reference.state_dict(), config)  # fused, `mlp`
    hub = hf.to_hf_state_dict(model_sd, config)
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in hub
    renamed = {k.replace("block_sparse_moe", "mlp"): v for k, v in hub.items()}
    fused = hf.to_hf_state_dict(model_sd, config, expert_layout="fused")
    fused_hub = {k.replace(".mlp.", ".block_sparse_moe."): v for k, v in fused.items()}
    for layout in (hub, renamed, fused_hub):
        back = hf.from_hf_state_dict(layout, config)
        assert all(torch.equal(back[k], v) for k, v in model_sd.items())
    del hub["model.layers.1.block_sparse_moe.experts.2.w2.weight"]
    with pytest.raises(
        ValueError, match=r"missing model\.layers\.1\.block_sparse_moe\.experts\.2\.w2"
    ):
        hf.from_hf_state_dict(hub, config)


IMPORT_REFUSALS = [
    (qwen3_config(attention_bias=True), "attention_bias (True) must be false"),
    (qwen3_config(use_sliding_window=True, sliding_window=16), "use_sliding_window (True)"),
    (
        qwen3_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}),
        "rope_parameters.rope_type ('yarn') must be 'default'",
    ),
    (qwen3_config(hidden_act="gelu"), "hidden_act ('gelu') must be 'silu'"),
    (mixtral_config(sliding_window=4096), "sliding_window (4096) must be null"),
    (mixtral_config(router_jitter_noise=0.1), "router_jitter_noise (0.1) must be 0"),
    (transformers.Qwen2MoeConfig(), "model_type ('qwen2_moe') must be one of"),
]


@pytest.mark.parametrize(("hf_config", "problem"), IMPORT_REFUSALS)
def test_import_refuses_what_moetrain_cannot_represent(hf_config, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        hf.run_config_from_hf(hf_config.to_dict())


def test_import_refuses_weights_the_config_does_not_explain():
    """A shared expert (Qwen2-MoE's) in a Qwen3-MoE state dict is named, never dropped."""
    family, hf_config = VARIANTS["qwen3"]
    config = hf.run_config_from_hf(hf_config.to_dict())
    hf_sd = dict(random_hf_model(family, hf_config).state_dict())
    hf_sd["model.layers.0.mlp.shared_expert.gate_proj.weight"] = torch.zeros(32, 64)
    with pytest.raises(ValueError, match=r"unexpected model\.layers\.0\.mlp\.shared_expert"):
        hf.from_hf_state_dict(hf_sd, config)


EXPORT_REFUSALS = [
    ("qwen3-moe-tiny", ["moe.num_shared_experts=1"], None, "moe.num_shared_experts (1): only 0"),
    ("qwen3-moe-tiny", ["moe.score_func=sigmoid"], None, "moe.score_func ('sigmoid'): only"),
    ("qwen3-moe-tiny", ["moe.bias_update_rate=0.01"], None, "moe.bias_update_rate (0.01)"),
    (
        "qwen3-moe-tiny",
        ["moe.n_groups=4", "moe.topk_groups=2"],
        "qwen3_moe",
        "as Qwen3MoeForCausalLM: moe.n_groups (4): only 1 is expressible; moe.topk_groups (2)",
    ),
    ("mixtral-tiny", ["moe.n_groups=2"], "mixtral", "moe.n_groups (2): only 1"),
    ("mixtral-tiny", ["moe.renormalize=false"], "mixtral", "moe.renormalize (False): only True"),
    ("mixtral-tiny", ["model.dense_layers=[1]"], "mixtral", "model.dense_layers ((1,)): only ()"),
    ("qwen3-moe-tiny", [], "olmoe", "model.qk_norm ('per_head'): only 'full'"),
    ("tiny", ["model.head_dim=32"], "qwen3_moe", "model.qk_norm ('full'): only 'per_head'"),
]


@pytest.mark.parametrize(("preset", "overrides", "format", "problem"), EXPORT_REFUSALS)
def test_export_refuses_what_the_format_cannot_express(
    tmp_path, preset, overrides, format, problem
):
    config = get_preset(preset).with_overrides(overrides)
    with pytest.raises(ValueError, match=re.escape(problem)):
        hf.hf_config_dict(config, format=format)
    if format is None:  # no format at all: each one's refusals are named
        with pytest.raises(ValueError, match="no export format expresses this model; as Olmoe"):
            hf.check_expressible(config)


TRAINED = {
    # per-head q/k norm, a dense layer between MoE ones, GQA, head_dim 32, tied embeddings
    "qwen3_moe": (
        "qwen3-moe-tiny",
        ["model.num_layers=3", "model.dense_layers=[1]", "model.tie_embeddings=true"],
    ),  # fmt: skip
    # no q/k norm, GQA, head_dim apart from d_model / heads
    "mixtral": ("mixtral-tiny", ["model.head_dim=24"]),
}


@pytest.mark.parametrize("family", list(TRAINED))
def test_a_model_trained_in_moetrain_exports_with_equal_logits(tmp_path, tmp_cache, family, caplog):
    from moetrain.train.trainer import Trainer

    preset, overrides = TRAINED[family]
    steps = ["train.steps=3", "train.eval_every=0", "train.checkpoint_every=0"]
    config = get_preset(preset).with_overrides([*overrides, *steps, "parallel.compile=false"])
    Trainer(config, tmp_path / "run", progress=False).train()
    model, _ = load_model(tmp_path / "run" / "checkpoints" / "step-3")
    out = export_checkpoint(tmp_path / "run", tmp_path / "hf")
    hf_model = load_quietly(MODELS[family], out, caplog)
    ids = tokens(config.model.vocab_size)
    with torch.no_grad():
        assert (model.logits(model(ids)) - hf_model(ids).logits).abs().max() <= LOGITS_TOLERANCE
    imported, _ = load_model(import_hf(out, tmp_path / "imported"))
    for name, t in model.state_dict().items():
        assert torch.equal(imported.state_dict()[name], t), name
