"""Pre-tokenized corpora: `prepare --pretokenized` indexes .npy / headerless .npy / .bin token
files without copying them, and runs read exactly those tokens back."""

import json
import os

import numpy as np
import pytest

from moetrain.cli import main
from moetrain.config import DataConfig
from moetrain.data import SequenceLoader, load_split, open_data, read_meta
from moetrain.data.pretokenized import prepare_pretokenized
from moetrain.data.sharded_tokens import ShardedTokens
from moetrain.data.tokens import fingerprint

EOS = 0


def corpus(num_docs, vocab_size, seed, dtype):
    """Documents of random ids in [1, vocab_size), each followed by EOS (0), as one stream."""
    rng = np.random.default_rng(seed)
    docs = [
        np.append(rng.integers(1, vocab_size, rng.integers(5, 60)), EOS) for _ in range(num_docs)
    ]
    return np.concatenate(docs).astype(dtype)


def write_three_layouts(directory, tokens):
    """The stream cut in three: a real .npy, a headerless .npy (OLMo-core's) and a raw .bin."""
    directory.mkdir()
    a, b, c = np.array_split(tokens, [len(tokens) // 3, 2 * len(tokens) // 3])
    np.save(directory / "part-00.npy", a)
    np.memmap(directory / "part-01.npy", dtype=b.dtype, mode="w+", shape=b.shape)[:] = b
    c.tofile(directory / "part-02.bin")
    return directory


@pytest.mark.parametrize("dtype, vocab_size", [("uint16", 300), ("uint32", 70_000)])
def test_layouts_index_without_copying_and_read_back(tmp_path, dtype, vocab_size):
    tokens = corpus(200, vocab_size, seed=1, dtype=dtype)
    shards = write_three_layouts(tmp_path / "shards", tokens)
    out = prepare_pretokenized(
        [shards], tmp_path / "tok", dtype=dtype, eos_id=EOS, vocab_size=vocab_size
    )
    assert sorted(p.name for p in out.iterdir()) == ["meta.json"]  # nothing copied
    meta = read_meta(out)
    assert (meta["vocab_size"], meta["eos_id"], meta["dtype"]) == (vocab_size, EOS, dtype)
    assert [f["path"] for f in meta["files"]] == [
        str((shards / n).resolve()) for n in ("part-00.npy", "part-01.npy", "part-02.bin")
    ]
    train, val = load_split(out, "train"), load_split(out, "val")
    assert np.array_equal(np.concatenate([train[: len(train)], val[: len(val)]]), tokens)
    assert train[len(train) - 1] == EOS  # val starts at a document
    assert len(val) == meta["num_tokens"]["val"] and 0.04 < len(val) / len(tokens) < 0.1
    num_docs = meta["num_documents"]
    assert num_docs["train"] + num_docs["val"] == 200
    assert num_docs["val"] == int(np.count_nonzero(np.asarray(val[: len(val)]) == EOS))


def test_sharded_tokens_gathers_like_one_array():
    rng = np.random.default_rng(0)
    whole = rng.integers(0, 1000, 500).astype(np.uint16)
    view = ShardedTokens(np.split(whole, [7, 200, 201, 450]))
    positions = rng.integers(0, 500, (8, 33))
    assert np.array_equal(view[positions], whole[positions])
    assert np.array_equal(view[190:460], whole[190:460]) and view.max() == whole.max()
    with pytest.raises(IndexError):
        view[np.array([500])]


def test_loader_batches_match_a_copied_array(tmp_path):
    tokens = corpus(300, 300, seed=2, dtype="uint16")
    shards = write_three_layouts(tmp_path / "shards", tokens)
    out = prepare_pretokenized(
        [str(shards / "part-*")], tmp_path / "tok", dtype="uint16", eos_id=EOS, vocab_size=300
    )
    train, _, tokenizer = open_data(DataConfig(path=str(out)), vocab_size=320)
    assert tokenizer is None and isinstance(train, ShardedTokens)
    copied = np.array(train[: len(train)])
    loaders = [SequenceLoader(t, 16, 4, seed=3) for t in (train, copied)]
    for _ in range(10):
        (x1, y1), (x2, y2) = next(loaders[0]), next(loaders[1])
        assert x1.equal(x2) and y1.equal(y2)


@pytest.mark.parametrize(
    "setup, kwargs, match",
    [
        (
            lambda d: np.save(d / "a.npy", np.array([5, 0, 400, 0], np.uint16)),
            {},
            r"a\.npy: token 2 is id 400, outside the vocabulary \[0, 300\)",
        ),
        (
            lambda d: np.save(d / "a.npy", np.array([5, 0, 7, 0], np.uint32)),
            {},
            r"a\.npy holds a uint32 array .* expected a 1-D little-endian uint16",
        ),
        (
            lambda d: (d / "a.bin").write_bytes(b"\x01\x00\x00"),
            {},
            r"a\.bin has 3 bytes, not a whole number of uint16 tokens",
        ),
        (
            lambda d: np.save(d / "a.npy", np.array([5, 6, 7, 8], np.uint16)),
            {},
            r"no EOS \(id 0\) before their last document",
        ),
        (
            lambda d: np.save(d / "a.npy", np.array([5, 0, 7, 0], np.uint16)),
            {"eos_id": 300},
            r"--eos-id \(300\) must be in \[0, --vocab-size \(300\)\)",
        ),
        (lambda d: (d / "a.txt").write_text("x"), {}, r"no \.npy or \.bin token file"),
    ],
)
def test_bad_token_files_are_errors_and_write_nothing(tmp_path, setup, kwargs, match):
    shards = tmp_path / "shards"
    shards.mkdir()
    setup(shards)
    args = {"dtype": "uint16", "eos_id": EOS, "vocab_size": 300, **kwargs}
    with pytest.raises(ValueError, match=match):
        prepare_pretokenized([shards], tmp_path / "tok", **args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"]


def test_changed_file_and_small_model_vocab_are_startup_errors(tmp_path):
    tokens = corpus(100, 300, seed=4, dtype="uint16")
    shards = write_three_layouts(tmp_path / "shards", tokens)
    out = prepare_pretokenized(
        [shards], tmp_path / "tok", dtype="uint16", eos_id=EOS, vocab_size=300
    )
    with pytest.raises(ValueError, match=r"model.vocab_size \(256\) is smaller .* \(300,"):
        open_data(DataConfig(path=str(out)), vocab_size=256)
    before = fingerprint(out)
    with open(shards / "part-02.bin", "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(ValueError, match=r"part-02\.bin of .* has \d+ bytes, not \d+: it changed"):
        open_data(DataConfig(path=str(out)), vocab_size=320)
    np.save(shards / "part-00.npy", np.zeros(5, np.uint16))
    prepare_pretokenized(
        [shards], tmp_path / "tok", dtype="uint16", eos_id=EOS, vocab_size=300, overwrite=True
    )
    assert fingerprint(out) != before


def test_cli_prepares_and_trains_tiny_on_pretokenized(tmp_path, capsys):
    tokens = corpus(400, 300, seed=5, dtype="uint16")
    shards = write_three_layouts(tmp_path / "shards", tokens)
    prepare = ["prepare", "--pretokenized", str(shards), "--out", str(tmp_path / "tok")]
    assert main(prepare) == 2
    assert "needs --dtype, --eos-id, --vocab-size" in capsys.readouterr().err
    flags = ["--dtype", "uint16", "--eos-id", "0", "--vocab-size", "300"]
    assert main([*prepare, *flags]) == 0
    train = [
        "train",
        "--preset",
        "tiny",
        "--quiet",
        "--set",
        f"data.path={tmp_path / 'tok'}",
        "--set",
        "train.steps=2",
        "--set",
        "train.eval_every=2",
        "--set",
        "train.eval_sequences=8",
    ]
    assert (
        main([*train, "--run-dir", str(tmp_path / "small"), "--set", "model.vocab_size=256"]) == 2
    )
    err = capsys.readouterr().err
    assert "model.vocab_size (256)" in err and "(300, from its meta.json)" in err
    assert main([*train, "--run-dir", str(tmp_path / "run"), "--set", "model.vocab_size=null"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "vocab_size: 320" in config  # 300 rounded up to a multiple of 64
    run = str(tmp_path / "run")
    resume = ["train", "--resume", "--quiet", "--run-dir", run, "--set", "train.steps=3"]
    assert main(resume) == 0  # the recorded fingerprint matches the indexed files
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 3
    assert main(["eval", "--checkpoint", run, "--sequences", "8"]) == 0
    assert main(["generate", "--checkpoint", run, "--prompt", "x"]) == 2
    assert "names no tokenizer, so its ids cannot be decoded" in capsys.readouterr().err


def test_recorded_tokenizer_lets_generate_decode(tmp_path, capsys):
    from moetrain.data import ByteTokenizer

    byte = ByteTokenizer()
    docs = [f"def f{i}(x):\n    return x * {i}\n" for i in range(300)]
    tokens = np.concatenate([np.append(byte.encode_array(d), byte.eos_id) for d in docs])
    shards = write_three_layouts(tmp_path / "shards", tokens.astype(np.uint16))
    with pytest.raises(ValueError, match=r"tokenizer byte has vocab_size 257 and eos_id 256, but"):
        prepare_pretokenized(
            [shards], tmp_path / "tok", dtype="uint16", eos_id=0, vocab_size=257, tokenizer="byte"
        )
    flags = ["--dtype", "uint16", "--eos-id", "256", "--vocab-size", "257", "--val-fraction", "0.2"]
    out = str(tmp_path / "tok")
    assert (
        main(
            ["prepare", "--pretokenized", str(shards), "--out", out, *flags, "--tokenizer", "byte"]
        )
        == 0
    )
    assert read_meta(out)["tokenizer"] == "byte"
    run = str(tmp_path / "run")
    train = [
        "train",
        "--preset",
        "tiny",
        "--quiet",
        "--run-dir",
        run,
        "--set",
        f"data.path={out}",
        "--set",
        "train.steps=2",
        "--set",
        "train.eval_every=0",
    ]
    assert main(train) == 0
    capsys.readouterr()
    assert main(["generate", "--checkpoint", run, "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("def ")


def test_a_file_rewritten_in_place_with_the_same_size_is_a_startup_error(tmp_path):
    """Size and modification time are checked at every start; when the time changed, the file's
    tokens are hashed again: other tokens of the same length are an error, a touch is not."""
    tokens = corpus(100, 300, seed=5, dtype="uint16")
    shards = write_three_layouts(tmp_path / "shards", tokens)
    out = prepare_pretokenized(
        [shards], tmp_path / "tok", dtype="uint16", eos_id=EOS, vocab_size=300
    )
    part = shards / "part-01.npy"
    later = part.stat().st_mtime_ns + 10**9
    os.utime(part, ns=(later, later))  # touched (or copied): same tokens, still readable
    assert np.array_equal(load_split(out, "train")[:10], tokens[:10])
    rewritten = np.memmap(part, dtype=np.uint16, mode="r+")
    rewritten[:3] = rewritten[:3] % 299 + 1  # other ids, same length
    rewritten.flush()
    del rewritten
    os.utime(part, ns=(later + 10**9, later + 10**9))
    with pytest.raises(ValueError, match=r"part-01\.npy of .* holds other tokens .* it changed"):
        open_data(DataConfig(path=str(out)), vocab_size=320)
