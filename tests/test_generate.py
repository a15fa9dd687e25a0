"""A model loaded from a checkpoint computes exactly what the trained model computed (buffers
outside the state dict, such as RoPE frequencies, included)."""

import json
import shutil

import pytest
import torch

from moetrain.checkpoint import manager
from moetrain.checkpoint.trained_model import checkpoint_tokenizer, load_model
from moetrain.cli import main
from moetrain.config.presets import tiny
from moetrain.data import HFTokenizer, prepare, read_meta
from moetrain.tools.generate import generate
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


def test_checkpoints_carry_their_tokenizer(tmp_cache, tmp_path, capsys):
    """A run on Hugging Face-tokenized data without model.vocab_size takes it from the
    tokenizer (rounded up to a multiple of 64); its checkpoint carries the tokenizer, so
    generate decodes with it after the data and the tokenizer file are gone."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = "the quick brown fox jumps over a lazy dog while seven wizards box".split()
    texts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(40)) for i in range(300)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok_path = tmp_path / "bpe.json"
    bpe.save(str(tok_path))
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    data = prepare([docs], tmp_path / "data", tokenizer=str(tok_path), progress=False)
    vocab = read_meta(data)["vocab_size"]
    config = tiny().with_overrides(
        ["model.vocab_size=null", f"data.path={data}", "train.steps=2", "train.eval_every=0"]
    )
    trainer = Trainer(config, tmp_path / "run", progress=False)
    assert trainer.config.model.vocab_size == -(-vocab // 64) * 64 != vocab
    trainer.train()
    shutil.rmtree(data)
    tok_path.unlink()
    path = manager.resolve(tmp_path / "run")
    _, saved = load_model(path)
    carried = checkpoint_tokenizer(path, saved)
    assert isinstance(carried, HFTokenizer) and carried.vocab_size == vocab
    assert carried.encode("the lazy fox") == bpe.encode("the lazy fox").ids
    capsys.readouterr()
    args = ["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "the lazy"]
    assert main([*args, "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.startswith("the lazy")
