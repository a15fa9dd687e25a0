import math
from pathlib import Path

import numpy as np
import pytest

import moetrain.data.corpus as corpus
from moetrain.data import (
    ByteTokenizer,
    cache_dir,
    embedded_corpus,
    load_split,
    read_meta,
    split_documents,
    unigram_entropy,
    write_token_dir,
)


def test_real_embedded_corpus_is_deterministic(tmp_path, monkeypatch):
    builds = []
    for name in ("cache-a", "cache-b"):
        monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path / name))
        out = embedded_corpus()
        assert out.parent == tmp_path / name and out.name.startswith("corpus-")
        builds.append(
            {split: np.array(load_split(out, split, vocab_size=257)) for split in ("train", "val")}
        )
    a, b = builds
    assert a["train"].size > 3_000_000 and a["val"].size > 100_000
    assert a["train"].max() < 257 and a["val"].max() < 257
    assert np.array_equal(a["train"], b["train"]) and np.array_equal(a["val"], b["val"])
    meta = read_meta(out)
    assert meta["num_documents"]["val"] >= 1 and meta["tokenizer"] == "byte"
    # Byte-level English and Python: well below the uniform log(257), well above zero.
    assert 2.5 < unigram_entropy(a["train"]) < math.log(257)


def small_docs():
    return [f"doc {i}: " + "text " * (i + 1) for i in range(30)]


@pytest.fixture
def small_corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(corpus, "embedded_documents", small_docs)
    return tmp_path / "cache"


def test_embedded_corpus_is_cached_per_settings(small_corpus):
    first = embedded_corpus()
    mtime = (first / "meta.json").stat().st_mtime_ns
    assert embedded_corpus() == first
    assert (first / "meta.json").stat().st_mtime_ns == mtime  # reused, not rebuilt
    other = embedded_corpus(val_fraction=0.2)
    assert other != first and read_meta(other)["num_documents"]["val"] == 6
    assert sorted(p.name for p in small_corpus.iterdir()) == sorted([first.name, other.name])
    with pytest.raises(ValueError, match=r"val_fraction \(0.0\)"):
        embedded_corpus(val_fraction=0.0)


def test_losing_the_build_race_keeps_the_winner(small_corpus, monkeypatch):
    tok = ByteTokenizer()
    out = small_corpus / "corpus-race"

    def docs_with_a_competitor():
        # Another process finishes the same directory while this one is half-way through.
        winner = [("train", [1, 2, 3]), ("val", [4])]
        write_token_dir(out, winner, tok, if_exists="keep")
        yield from ((split, tok.encode_array(t)) for split, t in split_documents(small_docs(), 0.1))

    assert write_token_dir(out, docs_with_a_competitor(), tok, if_exists="keep") == out
    assert load_split(out, "train").tolist() == [1, 2, 3, 256]
    assert [p.name for p in small_corpus.iterdir()] == ["corpus-race"]  # no temporary left


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("MOETRAIN_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == Path(tmp_path) / ".cache" / "moetrain"


def test_embedded_documents_sources_are_sorted_and_present():
    files = corpus._source_files()
    assert len(files) > 100 and all(f.suffix == ".py" and f.is_file() for f in files)
    assert not any(part in ("test", "tests") for f in files for part in f.parts[-3:-1])


def test_unigram_entropy():
    assert unigram_entropy(np.zeros(10, dtype=np.uint16)) == 0.0
    uniform = np.tile(np.arange(8, dtype=np.uint16), 100)
    assert unigram_entropy(uniform) == pytest.approx(math.log(8))
    assert unigram_entropy(np.array([0, 0, 0, 1])) == pytest.approx(
        -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    )
    with pytest.raises(ValueError, match="at least one token"):
        unigram_entropy(np.array([], dtype=np.uint16))
