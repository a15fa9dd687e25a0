"""Hugging Face interop: export -> transformers' OlmoeForCausalLM gives the same logits; import and
re-export are exact; settings OLMoE cannot express are errors that name the field."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re

import pytest
import torch
import yaml
from conftest import train_bpe

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from moetrain.checkpoint import manager  # noqa: E402
from moetrain.cli import main  # noqa: E402
from moetrain.config import RunConfig  # noqa: E402
from moetrain.config.fields import FORMATS, Only, rules_of, unexportable  # noqa: E402
from moetrain.config.presets import get_preset, tiny  # noqa: E402
from moetrain.model.transformer import build_model  # noqa: E402
from moetrain.tools.convert import hf  # noqa: E402
from moetrain.tools.convert.cli import add_convert_parsers, parse_size  # noqa: E402
from moetrain.tools.convert.io import (  # noqa: E402
    INDEX_FILE,
    SINGLE_FILE,
    export_checkpoint,
    import_hf,
    load_model_weights,
)


def random_model(config: RunConfig, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A tiny model with every tensor random, norms included (all-ones norms would hide swaps)."""
    model = build_model(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=generator))
            elif name.endswith("router.gate.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=generator))  # decisive routing
    return model.to(dtype).eval()


def save_checkpoint(root, config: RunConfig, model, step: int = 3):
    return manager.save(
        root / "run" / "checkpoints",
        step,
        {"model": model.state_dict()},
        {"step": step},
        yaml.safe_dump(config.to_dict(), sort_keys=False),
    )


def read_safetensors(hf_dir) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(safetensors_torch.load_file(str(file)))
    return tensors


VARIANTS = {
    "olmoe": [],
    "gqa-tied-renorm-theta": [
        "model.num_kv_heads=2",
        "model.tie_embeddings=true",
        "moe.renormalize=true",
        "model.rope_theta=500",
        "model.norm_eps=1e-3",
    ],
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_loads_in_transformers_with_equal_logits(tmp_path, variant, caplog):
    config = tiny().with_overrides(VARIANTS[variant])
    model = random_model(config)
    checkpoint = save_checkpoint(tmp_path, config, model)
    sharded = variant != "olmoe"
    out = export_checkpoint(checkpoint, tmp_path / "hf", max_shard_bytes=60_000 if sharded else 5e9)
    assert (out / INDEX_FILE).is_file() == sharded
    assert (out / SINGLE_FILE).is_file() != sharded
    if sharded:
        index = json.loads((out / INDEX_FILE).read_text())
        assert len(set(index["weight_map"].values())) > 1
        assert index["metadata"]["total_size"] == sum(p.nbytes for p in model.state_dict().values())

    hf_logger = logging.getLogger("transformers")  # does not propagate to caplog's root handler
    hf_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="transformers"):
            hf_model, info = transformers.OlmoeForCausalLM.from_pretrained(
                out, output_loading_info=True, attn_implementation="eager"
            )
    finally:
        hf_logger.removeHandler(caplog.handler)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"] and not info["error_msgs"], info
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert hf_model.config.tie_word_embeddings == config.model.tie_embeddings
    assert hf_model.config.eos_token_id == 256  # the byte tokenizer's end of document

    tokens = torch.randint(
        0, config.model.vocab_size, (3, 29), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        ours = model.logits(model(tokens))
        theirs = hf_model.eval()(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-4

    # The mapping also speaks the installed transformers' in-memory layout (fused 3-D experts in
    # transformers 5, per-expert modules in 4.x), detected from the model's own names.
    hf_sd = hf_model.state_dict()
    if config.model.tie_embeddings:
        hf_sd.pop("lm_head.weight")
    layout = "fused" if "model.layers.0.mlp.experts.gate_up_proj" in hf_sd else "per_expert"
    mapped = hf.to_hf_state_dict(model.state_dict(), config, expert_layout=layout)
    assert mapped.keys() == hf_sd.keys()
    for name, t in mapped.items():
        assert torch.equal(t, hf_sd[name]), name
    back = hf.from_hf_state_dict(hf_model.state_dict(), config)
    for name, t in model.state_dict().items():
        assert torch.equal(back[name], t), name


def test_import_is_exact_and_reexport_is_byte_identical(tmp_path):
    config = tiny().with_overrides(["model.num_kv_heads=2", "moe.renormalize=true"])
    model = random_model(config, seed=2)
    first = export_checkpoint(save_checkpoint(tmp_path, config, model), tmp_path / "hf1")

    imported = import_hf(first, tmp_path / "imported")
    assert imported == tmp_path / "imported" / "checkpoints" / "step-0"
    assert json.loads((imported / manager.TRAINER_STATE).read_text())["step"] == 0
    imported_config = RunConfig.load_yaml(imported / "config.yaml")
    assert imported_config.model == config.model
    assert imported_config.moe == config.moe
    assert imported_config.train.seq_len == config.train.seq_len

    fresh = build_model(imported_config)
    fresh.init_weights(seed=123)  # different weights, overwritten by the load
    load_model_weights(tmp_path / "imported", fresh.state_dict())  # a run dir resolves
    for name, t in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name

    second = export_checkpoint(imported, tmp_path / "hf2")
    a, b = read_safetensors(first), read_safetensors(second)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert json.loads((first / "config.json").read_text()) == json.loads(
        (second / "config.json").read_text()
    )


def test_bf16_checkpoint_keeps_its_dtype_unless_cast(tmp_path):
    config = tiny()
    model = random_model(config, dtype=torch.bfloat16)
    checkpoint = save_checkpoint(tmp_path, config, model)
    kept = export_checkpoint(checkpoint, tmp_path / "bf16")
    assert json.loads((kept / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = read_safetensors(kept)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert torch.equal(tensors["model.embed_tokens.weight"], model.embed.weight)
    cast = export_checkpoint(checkpoint, tmp_path / "fp32", dtype="float32")
    assert json.loads((cast / "config.json").read_text())["dtype"] == "float32"
    assert {t.dtype for t in read_safetensors(cast).values()} == {torch.float32}

    restored = hf.from_hf_state_dict(tensors, config)
    for name, t in model.state_dict().items():
        assert restored[name].dtype == torch.bfloat16 and torch.equal(restored[name], t), name

    # An imported bf16 checkpoint initializes an fp32 model (DCP casts on load).
    import_hf(kept, tmp_path / "imported")
    fp32_model = build_model(config)
    load_model_weights(tmp_path / "imported", fp32_model.state_dict())
    for name, t in model.state_dict().items():
        assert torch.equal(fp32_model.state_dict()[name], t.float()), name


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("model.num_dense_layers=1", "model.num_dense_layers (1): only 0"),
        ("moe.num_shared_experts=1", "moe.num_shared_experts (1): only 0"),
        ("moe.score_func=sigmoid", "moe.score_func ('sigmoid'): only 'softmax'"),
        ("moe.routing=random", "moe.routing ('random'): only 'learned'"),
        ("moe.bias_update_rate=0.001", "moe.bias_update_rate (0.001): only 0.0"),
        ("model.qk_norm=none", "model.qk_norm ('none'): only 'full'"),
        ("model.head_dim=32", "model.head_dim (32): head_dim x num_heads must equal model.d_model"),
    ],
)
def test_inexpressible_settings_name_the_field_and_value(override, problem):
    config = tiny().with_overrides([override])
    with pytest.raises(ValueError, match=re.escape(problem)):
        hf.check_expressible(config)
    with pytest.raises(ValueError, match=re.escape(problem)):
        hf.hf_config_dict(config)


def _other_values(value):
    """Candidates for a value besides `value`, smaller first (a None stands for an unset size)."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, tuple):  # model.dense_layers
        return [[1]] if not value else [[]]
    if value is None:
        return [1, 2, 16]
    if isinstance(value, int):
        return [v for v in (value // 2, 2 * value, value + 1) if v != value]
    if isinstance(value, float):
        return [v for v in (2 * value, value / 2, 1.0) if v != value]
    return []


# each export format: its tiny preset, its transformers config and model classes
FORMAT_CASES = {
    "olmoe": ("tiny", "OlmoeConfig", "OlmoeForCausalLM"),
    "qwen3_moe": ("qwen3-moe-tiny", "Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("mixtral-tiny", "MixtralConfig", "MixtralForCausalLM"),
}


def _varied(base, format_name):
    """(configs, changed, holding_more): each model and MoE field whose rule for the format holds
    more than one value set to another value the format holds, all in the first config where
    the values combine, else alone on `base` in a config of its own (model.dense_layers cannot
    join model.num_dense_layers)."""
    configs, changed, holding_more = [base], [], set()
    for section in ("model", "moe"):
        section_type = type(getattr(base, section))
        for f in dataclasses.fields(section_type):
            exports = rules_of(section_type, f.name).exports
            if exports is None:
                continue  # no exported model depends on it
            key = f"{section}.{f.name}"
            if not isinstance(exports.get(format_name), Only):
                holding_more.add(key)
            for start in (configs[0], base):
                candidate = _another_exportable_value(start, key, format_name)
                if candidate is not None:
                    if start is configs[0]:
                        configs[0] = candidate
                    else:
                        configs.append(candidate)
                    changed.append(key)
                    break
    return configs, changed, holding_more


def _another_exportable_value(config, key, format_name):
    section, name = key.split(".")
    for value in _other_values(getattr(getattr(config, section), name)):
        try:
            candidate = config.with_overrides([f"{key}={json.dumps(value)}"])
        except ValueError:
            continue
        if not unexportable(candidate, format_name):
            return candidate
    return None


@pytest.mark.parametrize("format_name", FORMATS)
def test_every_value_a_field_declares_expressible_exports_with_equal_logits(format_name):
    """Each model and MoE field whose rule for the format holds more than one value gets another
    value (in one tiny model of the family where they combine); mapped into the transformers
    model, each model gives the same logits. A declaration that claims more than the converter
    maps (a new routing option marked qwen3_moe=ANY) fails here."""
    preset, config_class, model_class = FORMAT_CASES[format_name]
    configs, changed, holding_more = _varied(get_preset(preset), format_name)
    assert set(changed) == holding_more
    for config in configs:
        model = random_model(config, seed=4)
        hf_config = getattr(transformers, config_class).from_dict(
            hf.hf_config_dict(config, format=format_name)
        )
        hf_config._attn_implementation = "eager"
        hf_model = getattr(transformers, model_class)(hf_config).eval()
        fused = "model.layers.0.mlp.experts.gate_up_proj" in hf_model.state_dict()
        mapped = hf.to_hf_state_dict(
            model.state_dict(), config, expert_layout="fused" if fused else "per_expert"
        )
        missing, unexpected = hf_model.load_state_dict(mapped, strict=False)
        assert missing == (["lm_head.weight"] if config.model.tie_embeddings else [])
        assert not unexpected
        vocab_size = config.model.vocab_size
        tokens = torch.randint(0, vocab_size, (2, 23), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            difference = (model.logits(model(tokens)) - hf_model(tokens).logits).abs().max()
        assert difference.item() < 1e-4, config


def test_export_refuses_inexpressible_checkpoint_and_used_output_dir(tmp_path):
    config = tiny().with_overrides(["model.num_dense_layers=1", "moe.score_func=sigmoid"])
    checkpoint = save_checkpoint(tmp_path, config, build_model(config))
    with pytest.raises(ValueError, match=r"model\.num_dense_layers.*moe\.score_func"):
        export_checkpoint(checkpoint, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()

    config = tiny()
    checkpoint = save_checkpoint(tmp_path / "ok", config, build_model(config))
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "file").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        export_checkpoint(checkpoint, tmp_path / "used")
    with pytest.raises(ValueError, match="not a moetrain checkpoint"):
        export_checkpoint(tmp_path / "nowhere", tmp_path / "hf")


def test_config_round_trip_and_unsupported_hf_options():
    config = tiny().with_overrides(
        ["model.num_kv_heads=2", "model.tie_embeddings=true", "model.rope_theta=500000"]
    )
    back = hf.run_config_from_hf(hf.hf_config_dict(config))
    assert back.model == config.model and back.moe.renormalize == config.moe.renormalize
    # transformers 4.x writes rope_theta at the top level
    legacy = hf.hf_config_dict(config)
    del legacy["rope_parameters"]
    assert hf.run_config_from_hf(legacy).model.rope_theta == 500000

    base = hf.hf_config_dict(tiny())
    for key, value in [
        ("model_type", "llama"),
        ("hidden_act", "gelu"),
        ("attention_bias", True),
        ("clip_qkv", 8.0),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
    ]:
        with pytest.raises(ValueError, match=key):
            hf.run_config_from_hf({**base, key: value})


def test_state_dict_errors_list_names_and_shapes_match_the_model():
    for overrides in ([], ["model.num_kv_heads=1", "model.tie_embeddings=true"]):
        config = tiny().with_overrides(overrides)
        built = build_model(config, "meta", init=False).state_dict()
        assert {k: tuple(v.shape) for k, v in built.items()} == hf.moetrain_shapes(config)

    config = tiny()
    hf_sd = hf.to_hf_state_dict(random_model(config).state_dict(), config)
    broken = dict(hf_sd)
    del broken["model.layers.1.mlp.experts.3.up_proj.weight"]
    broken["model.layers.0.mlp.shared_expert.weight"] = torch.zeros(1)
    with pytest.raises(
        ValueError,
        match=r"missing model\.layers\.1\.mlp\.experts\.3\.up_proj.*unexpected model\.layers\.0\.mlp\.shared_expert",
    ):
        hf.from_hf_state_dict(broken, config)
    wrong = dict(hf_sd, **{"model.norm.weight": torch.ones(7)})
    with pytest.raises(ValueError, match=r"norm\.weight has shape \(7,\)"):
        hf.from_hf_state_dict(wrong, config)


def test_tokenizer_files_travel_both_ways(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok_path = tmp_path / "tok" / "my-tokenizer.json"
    tok_path.parent.mkdir()
    tok.save(str(tok_path))

    config = tiny().with_overrides([f"data.tokenizer={tok_path}"])
    out = export_checkpoint(save_checkpoint(tmp_path, config, build_model(config)), tmp_path / "hf")
    eos = tok.token_to_id("<|endoftext|>")
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == eos
    auto = transformers.AutoTokenizer.from_pretrained(out)
    text = "the lazy fox"
    assert auto(text, add_special_tokens=False)["input_ids"] == tok.encode(text).ids
    assert auto.eos_token_id == eos

    imported = import_hf(out, tmp_path / "imported")
    tokenizer_path = RunConfig.load_yaml(imported / "config.yaml").data.tokenizer
    assert tokenizer_path == str((tmp_path / "imported" / "tokenizer" / "tokenizer.json").resolve())
    assert (tmp_path / "imported" / "tokenizer" / "tokenizer_config.json").is_file()


def test_export_refuses_a_tokenizer_of_another_vocabulary(tmp_path):
    """--tokenizer T fits a model when the model's vocab_size is what T would give a run
    (its size rounded up to a multiple of 64), or T is the run's own tokenizer within it."""
    from moetrain.data.tokenizer import load_tokenizer
    from moetrain.data.tokenizer_files import byte_tokenizer_json

    texts = ["the quick brown fox jumps over the lazy dog"] * 20
    small = train_bpe(tmp_path / "small" / "tokenizer.json", texts, 40, byte_alphabet=False)
    bpe = train_bpe(tmp_path / "bpe" / "tokenizer.json", texts, 300)
    byte = tmp_path / "byte" / "tokenizer.json"  # the byte tokenizer as a file: 257 ids
    byte.parent.mkdir()
    byte.write_text(json.dumps(byte_tokenizer_json()))
    size, bpe_size = (load_tokenizer(str(t)).vocab_size for t in (small, bpe))
    assert size <= 64 and 257 < bpe_size <= 320  # they give a run 64 and 320 ids
    config = tiny()  # byte-level, model.vocab_size 320
    run = save_checkpoint(tmp_path, config, build_model(config))
    with pytest.raises(ValueError, match=rf"has {size} ids, a model.vocab_size of 64 .* has 320"):
        export_checkpoint(run, tmp_path / "hf-small", tokenizer=str(small))
    export_checkpoint(run, tmp_path / "hf-bpe", tokenizer=str(bpe))
    export_checkpoint(run, tmp_path / "hf-byte", tokenizer=str(byte))  # rounds to 320 too

    wide = tiny().with_overrides(["model.vocab_size=448"])  # set by hand: no tokenizer gives it
    run = save_checkpoint(tmp_path / "wide", wide, build_model(wide))
    export_checkpoint(run, tmp_path / "hf-wide", tokenizer=str(byte))  # the run's own
    with pytest.raises(ValueError, match=rf"has {bpe_size} ids, a model.vocab_size of 320 .* 448"):
        export_checkpoint(run, tmp_path / "hf-wide-bpe", tokenizer=str(bpe))


def test_cli_export_and_import(tmp_path, tmp_cache, capsys):
    parser = argparse.ArgumentParser(prog="moetrain")
    add_convert_parsers(parser.add_subparsers(dest="command", required=True))
    config = tiny()
    save_checkpoint(tmp_path, config, random_model(config))

    args = parser.parse_args(
        [
            "export",
            "--checkpoint",
            str(tmp_path / "run"),
            "--out",
            str(tmp_path / "hf"),
            "--max-shard-size",
            "100KB",
        ]
    )
    assert args.max_shard_size == 100_000
    assert args.func(args) == 0
    assert (tmp_path / "hf" / INDEX_FILE).is_file()

    args = parser.parse_args(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "imp")])
    assert args.func(args) == 0
    assert "--init-from" in capsys.readouterr().out
    # `eval` of it says what it scored: the checkpoint names no data (#41.7)
    assert main(["eval", "--checkpoint", str(tmp_path / "imp"), "--sequences", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["data"].startswith("the val split of the embedded corpus")
    assert result["note"].startswith(f"imported from {(tmp_path / 'hf').resolve()}")
    with pytest.raises(ValueError, match="already holds checkpoints"):
        args.func(args)
    with pytest.raises(ValueError, match="only safetensors"):
        (tmp_path / "bin").mkdir()
        (tmp_path / "bin" / "config.json").write_text(json.dumps(hf.hf_config_dict(config)))
        import_hf(tmp_path / "bin", tmp_path / "imp-bin")

    assert parse_size("512MiB") == 512 * 2**20 and parse_size("1000") == 1000
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("5 parsecs")


def test_exported_byte_tokenizer_encodes_and_decodes_as_moetrain(tmp_path):
    """A byte-level run's export ships a tokenizer.json: AutoTokenizer encodes text to exactly
    moetrain's ids and decodes them back; the files are readable by all (0644 under umask 022)."""
    from moetrain.data import ByteTokenizer

    config = tiny()
    out = export_checkpoint(save_checkpoint(tmp_path, config, build_model(config)), tmp_path / "hf")
    auto = transformers.AutoTokenizer.from_pretrained(out)
    ours = ByteTokenizer()
    for text in ["hello", "héllo wörld ✓ 🚀\n\tdef f(x):\x00\x7f  end", " leading space", ""]:
        ids = ours.encode(text)
        assert auto(text)["input_ids"] == ids  # and no special tokens added by default
        assert auto.decode(ids) == text == ours.decode(ids)
    assert auto.eos_token_id == ours.eos_id == 256
    assert auto.decode([104, 105, 256], skip_special_tokens=True) == "hi"
    umask = os.umask(0)
    os.umask(umask)
    for file in out.iterdir():
        assert file.stat().st_mode & 0o777 == 0o666 & ~umask, file.name
