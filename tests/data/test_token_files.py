import hashlib
import json

import numpy as np
import pytest
from conftest import assert_failed_prepare_left

from moetrain.data import ByteTokenizer, load_split, prepare, read_meta, split_documents
from moetrain.data.tokens import fingerprint, write_token_dir

EOS = ByteTokenizer.eos_id

TEXTS = [
    "Mixture of experts.\n\nTwo paragraphs, one document.",
    "héllo wörld ✓ 🚀",
    "line one\nline two\n",
    "a" * 1000,
    "last but not least",
]


def documents(tokens: np.ndarray) -> list[str]:
    """Decode a split back into its documents (each one ends with EOS)."""
    assert tokens[-1] == EOS
    parts = np.split(np.asarray(tokens), np.flatnonzero(tokens == EOS) + 1)[:-1]
    return [ByteTokenizer().decode(p) for p in parts]


def expected_splits(texts: list[str], val_fraction: float) -> dict[str, list[str]]:
    out = {"train": [], "val": []}
    for split, text in split_documents(texts, val_fraction):
        out[split].append(text)
    return out


def write_txt(tmp_path, texts):
    paths = []
    for i, text in enumerate(texts):
        paths.append(tmp_path / f"in{i}.txt")
        paths[-1].write_text(text, encoding="utf-8")
    return paths


def assert_nothing_left(tmp_path, inputs):
    assert_failed_prepare_left(tmp_path, inputs, tmp_path / "tokens")


def test_prepare_txt_round_trip(tmp_path):
    inputs = write_txt(tmp_path, TEXTS)
    out = prepare(inputs, tmp_path / "tokens", val_fraction=0.4, progress=False)
    meta = read_meta(out)
    expected = expected_splits(TEXTS, 0.4)
    assert (meta["format"], meta["version"], meta["tokenizer"]) == ("moetrain-tokens", 1, "byte")
    assert (meta["vocab_size"], meta["eos_id"], meta["dtype"]) == (257, EOS, "uint16")
    for split in ("train", "val"):
        tokens = load_split(out, split, vocab_size=257)
        assert tokens.dtype == np.uint16 and isinstance(tokens, np.memmap)
        assert documents(tokens) == expected[split]
        assert meta["num_tokens"][split] == len(tokens)
        assert meta["num_documents"][split] == len(expected[split])
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.npy", "val.npy"]


def test_prepare_jsonl_round_trip_with_progress(tmp_path, capsys):
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(TEXTS)]
    lines.insert(2, "")  # blank lines and empty texts are skipped
    lines.insert(3, json.dumps({"text": ""}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = prepare([path], tmp_path / "tokens", val_fraction=0.2, progress=True)
    expected = expected_splits(TEXTS, 0.2)
    assert expected["val"] == [TEXTS[4]]
    for split in ("train", "val"):
        assert documents(load_split(out, split)) == expected[split]


def test_split_documents_spreads_val_evenly_and_never_leaves_it_empty():
    labeled = list(split_documents(range(100), 0.05))
    assert [d for s, d in labeled if s == "val"] == [19, 39, 59, 79, 99]
    assert [d for s, d in labeled if s == "train"] == [d for d in range(100) if d % 20 != 19]
    for f in (0.05, 0.3, 0.5, 0.9):
        val = [d for s, d in split_documents(range(1000), f) if s == "val"]
        assert len(val) == int(1000 * f)
    assert list(split_documents(["a", "b", "c"], 0.05)) == [
        ("train", "a"),
        ("train", "b"),
        ("val", "c"),
    ]
    with pytest.raises(ValueError, match=r"val_fraction \(1.0\) must be in \(0, 1\)"):
        list(split_documents([], 1.0))


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("missing.txt", None, r"input file .*missing\.txt does not exist"),
        ("bad.jsonl", '{"text": "ok"}\n{"txt": "oops"}\n', r"bad\.jsonl:2: expected .*\"text\""),
        ("num.jsonl", '{"text": "ok"}\n\n{"text": 3}\n', r"num\.jsonl:3: expected .*\"text\""),
        ("junk.jsonl", '{"text": "ok"}\nnot json\n', r"junk\.jsonl:2: not valid JSON"),
        ("none.jsonl", '{"text": ""}\n', r"none\.jsonl holds no documents"),
        ("data.csv", "a,b\n", r"data\.csv has an unsupported type"),
        ("latin1.txt", b"caf\xe9", r"latin1\.txt: not UTF-8 text .*--replace-bad-bytes"),
    ],
)
def test_bad_inputs_raise_and_leave_no_output(tmp_path, name, content, match):
    good = write_txt(tmp_path, TEXTS[:3])
    bad = tmp_path / name
    if isinstance(content, bytes):
        bad.write_bytes(content)
    elif content is not None:
        bad.write_text(content)
    inputs = [*good, bad] if content is not None else good
    with pytest.raises(ValueError, match=match):
        prepare([*good, bad], tmp_path / "tokens", progress=False)
    assert_nothing_left(tmp_path, inputs)


def test_too_few_documents_for_two_splits(tmp_path):
    inputs = write_txt(tmp_path, ["1"])  # one token: nothing to split by tokens either
    with pytest.raises(ValueError, match="the train split would be empty"):
        prepare(inputs, tmp_path / "tokens", progress=False)
    assert_nothing_left(tmp_path, inputs)
    with pytest.raises(ValueError, match="the val split would be empty"):
        write_token_dir(tmp_path / "tokens", [("train", [1, 2])], ByteTokenizer())
    assert_nothing_left(tmp_path, inputs)


def test_failed_prepare_keeps_the_previous_directory(tmp_path):
    inputs = write_txt(tmp_path, TEXTS)
    out = prepare(inputs, tmp_path / "tokens", progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match="not UTF-8"):
        prepare([*inputs, tmp_path / "bad.txt"], out, progress=False, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # A successful run replaces it, and leaves no temporary directories behind.
    prepare(inputs[:2], out, val_fraction=0.5, progress=False, overwrite=True)
    assert read_meta(out)["num_documents"] == {"train": 1, "val": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [p.name for p in inputs] + ["bad.txt", "tokens"]
    )


def test_refuses_to_overwrite_a_foreign_directory(tmp_path):
    inputs = write_txt(tmp_path, TEXTS)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a moetrain token directory; refusing"):
        prepare(inputs, foreign, progress=False)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    assert not (tmp_path / "mine.partial").exists()  # refused before any tokenizing
    (foreign / "notes.txt").unlink()
    prepare(inputs, foreign, progress=False)  # an empty directory is fine
    assert read_meta(foreign)["num_documents"]["train"] == 4


def test_prepare_refuses_a_used_directory_without_overwrite(tmp_path):
    inputs = write_txt(tmp_path, TEXTS)
    out = prepare(inputs, tmp_path / "tokens", progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError, match="is not empty: it holds a token directory.*--overwrite"):
        prepare(inputs[:2], out, val_fraction=0.5, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    prepare(inputs[:2], out, val_fraction=0.5, progress=False, overwrite=True)
    assert read_meta(out)["num_documents"] == {"train": 1, "val": 1}


def test_fingerprint_follows_the_content(tmp_path):
    inputs = write_txt(tmp_path, TEXTS)
    a = prepare(inputs, tmp_path / "a", progress=False)
    again = prepare(inputs, tmp_path / "again", progress=False)
    other = prepare(inputs[:4], tmp_path / "other", progress=False)
    meta = read_meta(a)
    for split in ("train", "val"):  # the recorded hash is that of the token bytes
        data = np.load(a / f"{split}.npy").tobytes()
        assert meta["sha256"][split] == hashlib.sha256(data).hexdigest()
    assert fingerprint(a) == fingerprint(again) != fingerprint(other)
    # A directory from before hashes were recorded gets a sampled hash of its files.
    for d in (a, other):
        meta = read_meta(d)
        del meta["sha256"]
        (d / "meta.json").write_text(json.dumps(meta))
    sampled = fingerprint(a)
    assert sampled != fingerprint(again) and sampled != fingerprint(other)
    tokens = np.load(a / "train.npy")
    tokens[len(tokens) // 2] ^= 1  # same size, one token changed
    np.save(a / "train.npy", tokens)
    assert fingerprint(a) != sampled


@pytest.fixture
def token_dir(tmp_path):
    return prepare(write_txt(tmp_path, TEXTS), tmp_path / "tokens", progress=False)


def test_truncated_npy(token_dir):
    path = token_dir / "train.npy"
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(ValueError, match=r"train\.npy is truncated or corrupt"):
        load_split(token_dir, "train")
    path.write_bytes(path.read_bytes()[:40])  # cut into the header
    with pytest.raises(ValueError, match=r"train\.npy is truncated or corrupt"):
        load_split(token_dir, "train")


def test_shorter_array_than_meta(token_dir):
    path = token_dir / "val.npy"
    np.save(path, np.load(path)[:-1])
    with pytest.raises(ValueError, match=r"val\.npy has shape .* but meta.json says \d+ tokens"):
        load_split(token_dir, "val")


def test_dtype_mismatch(token_dir):
    path = token_dir / "train.npy"
    np.save(path, np.load(path).astype(np.int32))
    with pytest.raises(
        ValueError, match=r"train\.npy holds int32 values but meta.json says uint16"
    ):
        load_split(token_dir, "train")


def test_token_id_out_of_model_vocab(token_dir):
    with pytest.raises(
        ValueError, match=r"token id 256 in .*train\.npy is >= model.vocab_size \(256\)"
    ):
        load_split(token_dir, "train", vocab_size=256)
    assert len(load_split(token_dir, "train", vocab_size=257)) > 0


def test_missing_or_foreign_directories(tmp_path, token_dir):
    with pytest.raises(ValueError, match=r"token directory .*nowhere does not exist"):
        load_split(tmp_path / "nowhere", "train")
    with pytest.raises(ValueError, match="split 'test' must be one of train, val"):
        load_split(token_dir, "test")
    meta = json.loads((token_dir / "meta.json").read_text())
    (token_dir / "meta.json").write_text(json.dumps({**meta, "version": 2}))
    with pytest.raises(ValueError, match=r"meta\.json has \(format, version\)"):
        read_meta(token_dir)
    (token_dir / "meta.json").unlink()
    with pytest.raises(ValueError, match=r"meta\.json is missing"):
        load_split(token_dir, "train")


def test_large_vocab_uses_uint32(tmp_path):
    class BigVocab:
        name, vocab_size, eos_id = "big", 70_000, 69_999

    docs = [("train", [1, 69_998]), ("val", np.array([65_536], dtype=np.int64))]
    out = write_token_dir(tmp_path / "big", docs, BigVocab())
    assert read_meta(out)["dtype"] == "uint32"
    assert load_split(out, "train").tolist() == [1, 69_998, 69_999]
    assert load_split(out, "val", vocab_size=70_000).tolist() == [65_536, 69_999]
    with pytest.raises(ValueError, match=r"token id 70000 is outside the vocabulary"):
        write_token_dir(tmp_path / "bad", [("train", [70_000])], BigVocab())
    assert not (tmp_path / "bad").exists()
