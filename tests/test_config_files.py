"""Config files: a YAML layered on the preset it names (or on --preset), the starter that
`moetrain config` prints, the shipped example, and the memory check before a run allocates."""

import json
from pathlib import Path

import pytest
import yaml

from moetrain.cli import main
from moetrain.config import RunConfig
from moetrain.config.presets import load_config, tiny
from moetrain.tools import fits

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "my_run.yaml"


def test_a_yaml_layers_over_its_preset(tmp_path):
    partial = tmp_path / "partial.yaml"
    partial.write_text("preset: tiny\ntrain:\n  steps: 7\n")
    expected = tiny().with_overrides(["train.steps=7"])
    assert load_config(path=partial) == expected
    bare = tmp_path / "bare.yaml"
    bare.write_text("train:\n  steps: 7\n")
    assert load_config("tiny", bare) == expected
    assert load_config(path=bare).model.d_model == RunConfig().model.d_model  # no base: defaults
    with pytest.raises(ValueError, match="--preset demo and the `preset: tiny` of"):
        load_config("demo", partial)
    partial.write_text("preset: tiny\ntrain:\n  stepz: 7\n")
    with pytest.raises(ValueError, match=r"unknown field\(s\) train\.stepz"):
        load_config(path=partial)


def test_printed_starter_config_round_trips(tmp_path, capsys):
    assert main(["config", "--preset", "tiny", "--set", "train.lr=1e-3"]) == 0
    starter = tmp_path / "starter.yaml"
    starter.write_text(capsys.readouterr().out)
    assert yaml.safe_load(starter.read_text())["preset"] == "tiny"
    assert load_config(path=starter) == tiny().with_overrides(["train.lr=1e-3"])


def test_the_example_yaml_builds_on_its_preset():
    config = load_config(path=EXAMPLE)
    assert (config.name, config.model.d_model, config.train.steps) == ("my_run", 192, 600)
    assert config.model.vocab_size == 320 and config.train.seq_len == 128  # from `demo`
    assert fits.predicted_peak(config, 1, "cpu") < 2**30


def test_a_run_that_cannot_fit_is_refused_before_allocating(
    tmp_path, tmp_cache, capsys, monkeypatch
):
    huge = ["--set", "model.d_model=65536", "--set", "model.num_layers=64"]
    run = ["train", "--preset", "tiny", "--quiet", "--run-dir", str(tmp_path / "run")]
    assert main([*run, *huge, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "this run needs about" in err and "GiB available RAM" in err and "--force" in err
    assert not (tmp_path / "run").exists()
    # --force starts anyway (here: a tiny run, with the available memory faked to 1 MiB)
    monkeypatch.setattr(fits, "_mem_available", lambda: 1 << 20)
    fast = ["--set", "train.steps=2", "--set", "train.eval_every=0"]
    assert main([*run, *fast]) == 2
    assert "more than the 0.0 GiB available RAM" in capsys.readouterr().err
    assert main([*run, *fast, "--force"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 2


def test_a_yaml_builds_on_another_yaml_and_config_prints_the_result(tmp_path, capsys):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "a.yaml").write_text("preset: tiny\ntrain:\n  steps: 7\n  lr: 1.0e-3\n")
    (tmp_path / "b.yaml").write_text("base: base/a.yaml\ntrain:\n  steps: 9\n")
    (tmp_path / "c.yaml").write_text("base: b.yaml\nmoe:\n  top_k: 1\n")
    expected = tiny().with_overrides(["train.steps=9", "train.lr=1e-3", "moe.top_k=1"])
    assert load_config(path=tmp_path / "c.yaml") == expected
    assert main(["config", str(tmp_path / "c.yaml")]) == 0
    printed = capsys.readouterr().out
    assert f"config of {tmp_path / 'c.yaml'} on {tmp_path / 'b.yaml'} on " in printed
    assert RunConfig.from_dict(yaml.safe_load(printed)) == expected
    (tmp_path / "base" / "a.yaml").write_text("base: ../c.yaml\n")
    assert main(["config", str(tmp_path / "c.yaml")]) == 2
    assert "name each other as base in a cycle" in capsys.readouterr().err


def test_a_set_without_a_value_and_a_file_as_data_path_say_what_to_do(tmp_path, capsys):
    assert main(["inspect", "--preset", "tiny", "--set", "train.steps", "2"]) == 2
    assert "--set train.steps needs a value: write --set train.steps=2" in capsys.readouterr().err
    (tmp_path / "corpus.jsonl").write_text('{"text": "a"}\n')
    bad = ["inspect", "--preset", "tiny", "--set", "model.vocab_size=null"]
    assert main([*bad, "--set", f"data.path={tmp_path / 'corpus.jsonl'}"]) == 2
    assert "is a file, not a token directory; make one of it with" in capsys.readouterr().err


def test_a_presets_vocabulary_follows_the_datas_tokenizer_unless_the_user_sets_it(
    tmp_path, tmp_cache, capsys
):
    """`tiny` pins 320 ids (the byte tokenizer's); on a token directory of a 400-id tokenizer,
    `inspect`, `config` and `train` all take 448 (400 rounded up to a multiple of 64) unless a
    YAML or --set names model.vocab_size. The embedded corpus keeps the preset's."""
    from conftest import train_bpe

    from moetrain.data import prepare, read_meta
    from moetrain.model.flops import param_counts

    texts = [" ".join(f"w{(i * j) % 211} z{j % 37}" for j in range(80)) for i in range(60)]
    tokenizer = train_bpe(tmp_path / "bpe.json", texts, 400)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    data = prepare(
        [tmp_path / "docs.jsonl"], tmp_path / "tok", tokenizer=str(tokenizer), progress=False
    )
    assert 384 < read_meta(data)["vocab_size"] <= 448
    on_data = ["--preset", "tiny", "--set", f"data.path={data}"]

    def inspected(*args: str) -> dict:
        assert main(["inspect", *args, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    info = inspected(*on_data)
    expected = tiny().with_overrides(["model.vocab_size=448"])
    assert (info["vocab_size"], info["total_params"]) == (448, param_counts(expected).total)
    assert main(["config", *on_data]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"]["vocab_size"] == 448
    run = ["--run-dir", str(tmp_path / "run"), "--quiet", "--set", "train.steps=1"]
    assert main(["train", *on_data, *run, "--set", "train.eval_every=0"]) == 0
    assert RunConfig.load_yaml(tmp_path / "run" / "config.yaml").model.vocab_size == 448
    capsys.readouterr()

    assert inspected(*on_data, "--set", "model.vocab_size=512")["vocab_size"] == 512
    pinned = tmp_path / "pinned.yaml"
    pinned.write_text(f"preset: tiny\nmodel:\n  vocab_size: 320\ndata:\n  path: {data}\n")
    assert inspected(str(pinned))["vocab_size"] == 320  # the user's, though too small to train
    assert inspected("--preset", "tiny")["vocab_size"] == 320
    assert inspected("--preset", "olmoe-1b-7b")["vocab_size"] == 50304
