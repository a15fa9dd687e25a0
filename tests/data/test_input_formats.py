"""`prepare` on every input format it reads: each test writes its own small files, and the
token directory must hold exactly the documents of the plain .jsonl equivalent."""

import gzip
import json
import re

import numpy as np
import pytest
from conftest import assert_failed_prepare_left

from moetrain.data import ByteTokenizer, load_split, prepare
from moetrain.data.inputs import expand_inputs

EOS = ByteTokenizer.eos_id
TEXTS = ["first document", "zweites Dokument ✓", "third\nwith two lines", "4th", "fifth one"]


def decoded(out, split):
    tokens = np.asarray(load_split(out, split))
    parts = np.split(tokens, np.flatnonzero(tokens == EOS) + 1)[:-1]
    return [ByteTokenizer().decode(p) for p in parts]


def all_docs(out):
    return decoded(out, "train") + decoded(out, "val")


def jsonl_bytes(texts, field="text"):
    return "".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()


def write_parquet(path, texts, field="text", row_group_size=2):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({field: texts}), path, row_group_size=row_group_size)


def test_gzip_json_lines(tmp_path):
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(TEXTS[:3])))
    (tmp_path / "b.json.gz").write_bytes(gzip.compress(jsonl_bytes(TEXTS[3:])))
    out = prepare([tmp_path / "*.gz"], tmp_path / "tok", val_fraction=0.2, progress=False)
    # The pattern's matches are read in sorted order: a.jsonl.gz, then b.json.gz.
    assert decoded(out, "train") == TEXTS[:4]
    assert decoded(out, "val") == [TEXTS[4]]


def test_zstd_json_lines_and_text_field(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    data = zstandard.ZstdCompressor().compress(jsonl_bytes(TEXTS, field="content"))
    (tmp_path / "shard.jsonl.zst").write_bytes(data)
    out = prepare(
        [tmp_path / "shard.jsonl.zst"], tmp_path / "tok", progress=False, text_field="content"
    )
    assert sorted(all_docs(out)) == sorted(TEXTS)
    with pytest.raises(ValueError, match=r'shard\.jsonl\.zst:1: expected .*"text"'):
        prepare([tmp_path / "shard.jsonl.zst"], tmp_path / "tok2", progress=False)
    assert not (tmp_path / "tok2").exists() and not (tmp_path / "tok2.partial").exists()


def test_parquet_directory_of_shards(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    write_parquet(shards / "part-0.parquet", TEXTS[:3])
    write_parquet(shards / "part-1.parquet", TEXTS[3:])
    (shards / "README.md").write_text("not a shard")  # files of other types are passed over
    out = prepare([shards], tmp_path / "tok", val_fraction=0.2, progress=False)
    # Directory shards are read in sorted order, so the split is that of TEXTS in order.
    assert decoded(out, "val") == [TEXTS[4]]
    assert decoded(out, "train") == TEXTS[:4]


def test_hf_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": TEXTS, "n": list(range(5))}).save_to_disk(tmp_path / "ds")
    out = prepare([tmp_path / "ds"], tmp_path / "tok", val_fraction=0.2, progress=False)
    assert decoded(out, "train") + decoded(out, "val") == TEXTS[:4] + [TEXTS[4]]
    with pytest.raises(ValueError, match=r"ds has no column 'body'"):
        prepare([tmp_path / "ds"], tmp_path / "tok2", progress=False, text_field="body")
    splits = {"train": datasets.Dataset.from_dict({"text": TEXTS})}
    datasets.DatasetDict(splits).save_to_disk(tmp_path / "dd")
    with pytest.raises(
        ValueError, match=r"dd is a saved Hugging Face DatasetDict \(splits train\)"
    ):
        prepare([tmp_path / "dd"], tmp_path / "tok3", progress=False)
    out = prepare([tmp_path / "dd" / "train"], tmp_path / "tok3", val_fraction=0.2, progress=False)
    assert decoded(out, "val") == [TEXTS[4]]


def test_hf_dataset_by_name_from_a_local_directory(tmp_path, monkeypatch, capsys):
    datasets = pytest.importorskip("datasets")
    from moetrain.cli import main
    from moetrain.data.inputs import load_named_dataset

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "part-0.jsonl").write_bytes(jsonl_bytes(TEXTS[:3]))
    (tmp_path / "corpus" / "part-1.jsonl").write_bytes(jsonl_bytes(TEXTS[3:]))
    args = ["prepare", "--hf-dataset", str(tmp_path / "corpus"), "--val-fraction", "0.2"]
    assert main([*args, "--out", str(tmp_path / "tok"), "--quiet"]) == 0
    assert decoded(tmp_path / "tok", "train") + decoded(tmp_path / "tok", "val") == TEXTS
    # In row parts, in two workers, and saved to disk: the same tokens.
    named = load_named_dataset(str(tmp_path / "corpus"))
    datasets.Dataset.from_file(str(named.files[0])).save_to_disk(tmp_path / "ds")
    for name, source, workers in (("named", named, 2), ("saved", tmp_path / "ds", 1)):
        prepare([source], tmp_path / name, val_fraction=0.2, workers=workers, unit_bytes=64)
        for split in ("train", "val"):
            expected = np.asarray(load_split(tmp_path / "tok", split))
            assert np.array_equal(load_split(tmp_path / name, split), expected)
    capsys.readouterr()
    assert main([*args, "--hf-split", "test", "--out", str(tmp_path / "x")]) == 2
    assert "cannot load the Hugging Face dataset" in capsys.readouterr().err
    assert main(["prepare", "--hf-config", "en", "--out", str(tmp_path / "x")]) == 2
    assert "--hf-config needs --hf-dataset NAME" in capsys.readouterr().err
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)
    with pytest.raises(
        ValueError, match=r"needs the optional package datasets: .*moetrain\[data\]"
    ):
        load_named_dataset(str(tmp_path / "corpus"))


def test_formats_agree_with_plain_jsonl(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    (tmp_path / "plain.jsonl").write_bytes(jsonl_bytes(TEXTS))
    (tmp_path / "z.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl_bytes(TEXTS)))
    write_parquet(tmp_path / "p.parquet", TEXTS)
    outs = [
        prepare([tmp_path / name], tmp_path / f"tok-{name}", val_fraction=0.4, progress=False)
        for name in ("plain.jsonl", "z.jsonl.zst", "p.parquet")
    ]
    reference = [np.asarray(load_split(outs[0], s)).tolist() for s in ("train", "val")]
    for out in outs[1:]:
        assert [np.asarray(load_split(out, s)).tolist() for s in ("train", "val")] == reference


@pytest.mark.parametrize(
    "name, make, match",
    [
        (
            "bad.jsonl.gz",
            lambda: gzip.compress(b'{"text": "ok"}\n{"text": "ok"}\n{oops\n'),
            r"bad\.jsonl\.gz:3: not valid JSON",
        ),
        (
            "cut.jsonl.gz",
            lambda: gzip.compress(jsonl_bytes(TEXTS * 50))[:-20],
            r"cut\.jsonl\.gz:\d+: cannot decompress",
        ),
        (
            "bad.jsonl.zst",
            lambda: __import__("zstandard").ZstdCompressor().compress(b'{"text": 1}\n'),
            r"bad\.jsonl\.zst:1: expected .*\"text\"",
        ),
        ("junk.jsonl.zst", lambda: b"definitely not zstd" * 10, r"junk\.jsonl\.zst:1: cannot"),
        ("junk.parquet", lambda: b"PAR1 not really", r"junk\.parquet is not a readable Parquet"),
    ],
)
def test_malformed_records_name_file_and_line_and_install_nothing(tmp_path, name, make, match):
    if "zst" in name:
        pytest.importorskip("zstandard")
    if "parquet" in name:
        pytest.importorskip("pyarrow")
    good = tmp_path / "good.jsonl"
    good.write_bytes(jsonl_bytes(TEXTS))
    (tmp_path / name).write_bytes(make())
    before = sorted(tmp_path.iterdir())
    with pytest.raises(ValueError, match=match):
        prepare([good, tmp_path / name], tmp_path / "tok", progress=False)
    assert_failed_prepare_left(tmp_path, before, tmp_path / "tok")


def test_parquet_non_string_row_names_the_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", "b", None]}), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match=r"x\.parquet: row 3: column 'text' holds None"):
        prepare([tmp_path / "x.parquet"], tmp_path / "tok", progress=False)
    assert not (tmp_path / "tok").exists()


def test_missing_optional_package_names_the_extra(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_zstd(name, *args, **kwargs):
        if name == "zstandard":
            raise ImportError("no zstandard here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_zstd)
    (tmp_path / "a.jsonl.zst").write_bytes(b"whatever")
    with pytest.raises(
        ValueError, match=r"needs the optional package zstandard: .*moetrain\[data\]"
    ):
        prepare([tmp_path / "a.jsonl.zst"], tmp_path / "tok", progress=False)


def test_expand_inputs_globs_directories_and_errors(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for rel in ("d/b.jsonl", "d/sub/a.jsonl.gz", "d/notes.csv", "c.txt"):
        (tmp_path / rel).write_text("x")
    assert expand_inputs([tmp_path / "d"]) == [
        tmp_path / "d/b.jsonl",
        tmp_path / "d/sub/a.jsonl.gz",
    ]
    assert expand_inputs([str(tmp_path / "**" / "*.jsonl*"), tmp_path / "d/b.jsonl"]) == [
        tmp_path / "d/b.jsonl",
        tmp_path / "d/sub/a.jsonl.gz",
    ]
    # A walk takes saved datasets whole and leaves plain .json (metadata) to explicit naming.
    for rel in ("d/ds/state.json", "d/ds/dataset_info.json", "d/ds/x.arrow", "d/config.json"):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text("{}")
    assert expand_inputs([tmp_path / "d"]) == [
        tmp_path / "d/b.jsonl",
        tmp_path / "d/ds",
        tmp_path / "d/sub/a.jsonl.gz",
    ]
    assert expand_inputs([tmp_path / "d/config.json"]) == [tmp_path / "d/config.json"]
    (tmp_path / "d/dataset_dict.json").write_text("{}")
    with pytest.raises(ValueError, match=r"is a saved Hugging Face DatasetDict \(splits ds\)"):
        expand_inputs([tmp_path / "d"])
    with pytest.raises(ValueError, match=r"matches no input file"):
        expand_inputs([str(tmp_path / "*.parquet")])
    with pytest.raises(ValueError, match=r"notes\.csv has an unsupported type"):
        expand_inputs([tmp_path / "d/notes.csv"])


def test_cli_prepare_directory_with_text_field(tmp_path, capsys):
    from moetrain.cli import main

    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(TEXTS, field="body")))
    args = ["prepare", str(shards), "--out", str(tmp_path / "tok"), "--quiet"]
    assert main(args) == 2
    assert 'a.jsonl.gz:1: expected a JSON object with a string "text" field' in (
        capsys.readouterr().err
    )
    assert main([*args, "--text-field", "body"]) == 0
    assert sorted(all_docs(tmp_path / "tok")) == sorted(TEXTS)
    assert main(["prepare", "--out", str(tmp_path / "x")]) == 2
    assert "prepare needs input files" in capsys.readouterr().err
    assert main([*args, "--text-field", "body", "--overwrite", "--workers", "0"]) == 2
    assert "workers (0) must be >= 1" in capsys.readouterr().err
    pretokenized = ["prepare", "--pretokenized", str(shards), "--out", str(tmp_path / "y")]
    pretokenized += ["--dtype", "uint16", "--eos-id", "0", "--vocab-size", "9"]
    assert main([*pretokenized, "--workers", "2"]) == 2
    assert "--workers does not apply to --pretokenized" in capsys.readouterr().err


def test_a_truncated_gzip_is_skipped_with_on_bad_record_skip(tmp_path, capsys):
    """--on-bad-record skip keeps a cut .gz's documents before the damage and the other files'
    in full, counting the cut as one bad record named by file and line; without it, the error
    says how to skip it."""
    good = tmp_path / "good.jsonl"
    good.write_bytes(jsonl_bytes(TEXTS))
    texts = [f"document {i} " + "text " * (i % 7) for i in range(400)]
    whole = gzip.compress(jsonl_bytes(texts))
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    inputs = [good, tmp_path / "cut.jsonl.gz"]
    with pytest.raises(
        ValueError, match=r"cut\.jsonl\.gz:\d+: cannot decompress .*--on-bad-record=skip"
    ):
        prepare(inputs, tmp_path / "err", progress=False)
    out = tmp_path / "tok"
    prepare(inputs, out, progress=False, on_bad_record="skip")
    docs = all_docs(out)
    kept = len(docs) - len(TEXTS)  # the cut file's documents up to its damage
    assert 0 < kept < len(texts) and sorted(docs) == sorted(TEXTS + texts[:kept])
    assert json.loads((out / "meta.json").read_text())["skipped_records"] == 1
    assert re.search(
        r"skipped 1 bad records.*cut\.jsonl\.gz:\d+: cannot decompress",
        capsys.readouterr().err,
        re.S,
    )
