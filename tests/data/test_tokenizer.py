import sys

import numpy as np
import pytest

from moetrain.data import ByteTokenizer, HFTokenizer, load_dir_tokenizer, load_split, prepare
from moetrain.data.tokenizer import load_tokenizer


def random_unicode(rng: np.random.Generator, length: int) -> str:
    # Mix ASCII, Latin, CJK and astral code points; skip surrogates, which UTF-8 cannot encode.
    ranges = [(0x20, 0x7F), (0xA0, 0x800), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF), (0x0, 0x20)]
    chars = []
    for _ in range(length):
        lo, hi = ranges[rng.integers(len(ranges))]
        chars.append(chr(int(rng.integers(lo, hi))))
    return "".join(chars)


@pytest.mark.parametrize("seed", range(5))
def test_byte_round_trip_random_unicode(seed):
    tok = ByteTokenizer()
    text = random_unicode(np.random.default_rng(seed), 500)
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert ids == list(text.encode("utf-8"))
    assert tok.encode_array(text).tolist() == ids
    assert tok.decode(ids) == text
    assert tok.decode(np.asarray(ids + [tok.eos_id], dtype=np.uint16)) == text


def test_byte_tokenizer_constants_and_decode_edge_cases():
    tok = ByteTokenizer()
    assert (tok.name, tok.vocab_size, tok.eos_id) == ("byte", 257, 256)
    assert tok.encode("") == []
    assert tok.decode([104, 256, 105]) == "hi"  # EOS is dropped
    assert tok.decode([0xFF]) == "\ufffd"  # invalid UTF-8 is replaced, not raised


def test_load_tokenizer_byte_and_missing_file(tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    missing = tmp_path / "nope.json"
    with pytest.raises(ValueError, match=r"nope\.json does not exist"):
        load_tokenizer(str(missing))


def test_missing_tokenizers_package_is_a_clear_error(tmp_path, monkeypatch):
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ValueError, match="install tokenizers"):
        load_tokenizer(str(path))


def train_bpe(path, texts, special=("<|endoftext|>",)):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return path


def test_hf_tokenizer_prepare_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    texts = [f"document {i}: the quick brown fox ✓ " * (i + 1) for i in range(6)]
    texts.append(random_unicode(rng, 200))
    tok_path = train_bpe(tmp_path / "tokenizer.json", texts)
    tok = load_tokenizer(str(tok_path))
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == tok._tokenizer.token_to_id("<|endoftext|>")
    for text in texts:
        assert tok.decode(tok.encode(text)) == text

    inputs = []
    for i, text in enumerate(texts):
        inputs.append(tmp_path / f"doc{i}.txt")
        inputs[-1].write_text(text, encoding="utf-8")
    out = prepare(
        inputs, tmp_path / "tokens", tokenizer=str(tok_path), val_fraction=0.3, progress=False
    )
    tok_path.unlink()  # the directory keeps its own copy of the tokenizer
    dir_tok = load_dir_tokenizer(out)
    assert dir_tok.name == str(tok_path) and dir_tok.eos_id == tok.eos_id
    decoded = []
    for split in ("train", "val"):
        ids = load_split(out, split, vocab_size=tok.vocab_size)
        assert ids.dtype == np.uint16 and ids[-1] == tok.eos_id
        docs = np.split(ids, np.flatnonzero(ids == tok.eos_id) + 1)[:-1]
        decoded += [dir_tok.decode(d) for d in docs]
    assert sorted(decoded) == sorted(texts)


def test_hf_tokenizer_without_eos_token(tmp_path):
    path = train_bpe(tmp_path / "tokenizer.json", ["abc abd"], special=("<pad>",))
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        load_tokenizer(str(path))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": {"content": "<pad>"}}')
    assert load_tokenizer(str(path)).eos_id == 0
