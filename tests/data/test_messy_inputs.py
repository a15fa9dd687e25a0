"""`moetrain prepare` on the data users bring, driven through the command line: one big text
file, empty files, bad records and bytes, a JSON array, leftovers of a killed prepare, Ctrl-C,
and token files read with the wrong dtype or EOS id."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moetrain.cli import main
from moetrain.data import ByteTokenizer, load_split, read_meta

EOS = ByteTokenizer.eos_id


def documents(out):
    """The texts of a token directory's documents, train then val."""
    tokens = np.concatenate([np.asarray(load_split(out, s)) for s in ("train", "val")])
    parts = np.split(tokens, np.flatnonzero(tokens == EOS) + 1)[:-1]
    return [bytes(p[:-1].astype(np.uint8)).decode() for p in parts]


def prepare(*args):
    return main(["prepare", *map(str, args), "--quiet"])


def test_one_text_file_splits_by_tokens_paragraphs_or_lines(tmp_path, capsys):
    paragraphs = [f"paragraph {i}\nits second line" for i in range(30)]
    book = tmp_path / "book.txt"
    book.write_text("\n\n".join(paragraphs) + "\n")
    assert prepare(book, "--out", tmp_path / "whole", "--val-fraction", "0.1") == 0
    meta = read_meta(tmp_path / "whole")
    val_tokens = round(len(book.read_bytes()) * 0.1)
    assert meta["num_tokens"]["val"] == val_tokens + 1  # the tail of the text, and its EOS
    assert "".join(documents(tmp_path / "whole")) == book.read_text()
    assert prepare(book, "--out", tmp_path / "par", "--split-text", "paragraph") == 0
    assert sorted(documents(tmp_path / "par")) == sorted(paragraphs[:-1] + [paragraphs[-1] + "\n"])
    assert prepare(book, "--out", tmp_path / "lines", "--split-text", "line") == 0
    assert sorted(documents(tmp_path / "lines")) == sorted(
        line for p in paragraphs for line in p.splitlines()
    )
    # a directory of texts with empty ones: they are skipped and counted, as empty records are
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(4):
        (texts / f"{i}.txt").write_text(f"text {i}" if i % 2 else " \n")
    capsys.readouterr()
    assert prepare(texts, "--out", tmp_path / "dir") == 0
    assert "skipped 2 empty text files" in capsys.readouterr().err
    assert sorted(documents(tmp_path / "dir")) == ["text 1", "text 3"]
    # a text that is not UTF-8, skipped as a bad record, is counted as that alone, not as empty
    (texts / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    capsys.readouterr()
    assert prepare(texts, "--out", tmp_path / "bad", "--on-bad-record", "skip") == 0
    err = capsys.readouterr().err
    assert "skipped 1 bad records" in err and "latin1.txt" in err, err
    empty = next(line for line in err.splitlines() if "empty text files" in line)
    assert "skipped 2 empty text files (" in empty and "latin1.txt" not in empty, err
    # nothing but empty texts: an error saying so, and no work directory offered for a resume
    empty_dir = tmp_path / "blank"
    empty_dir.mkdir()
    (empty_dir / "a.txt").write_text(" \n")
    assert prepare(empty_dir, "--out", tmp_path / "none") == 2
    err = capsys.readouterr().err
    assert "the input holds no documents" in err and "resumes" not in err, err
    assert not list(tmp_path.glob("none*"))


def test_bad_records_stop_or_are_skipped_and_counted(tmp_path, capsys):
    good = [json.dumps({"text": f"doc {i}"}).encode() for i in range(30)]
    lines = [*good[:3], b"{oops", *good[3:6], b'{"body": 1}', b'{"text": "caf\xe9"}', *good[6:]]
    data = tmp_path / "data.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    assert prepare(data, "--out", tmp_path / "a") == 2
    err = capsys.readouterr().err
    assert "data.jsonl:4: not valid JSON" in err and "--on-bad-record=skip" in err
    assert not (tmp_path / "a").exists()

    assert prepare(data, "--out", tmp_path / "a", "--on-bad-record", "skip") == 0
    err = capsys.readouterr().err
    assert "skipped 3 bad records" in err
    for where in (
        "data.jsonl:4: not valid JSON",
        "data.jsonl:8: expected",
        "data.jsonl:9: not UTF",
    ):
        assert where in err
    assert read_meta(tmp_path / "a")["skipped_records"] == 3
    assert sorted(documents(tmp_path / "a")) == sorted(f"doc {i}" for i in range(30))

    flags = ["--on-bad-record", "skip", "--replace-bad-bytes"]
    assert prepare(data, "--out", tmp_path / "b", *flags) == 0
    assert read_meta(tmp_path / "b")["skipped_records"] == 2
    assert "caf\ufffd" in documents(tmp_path / "b")


def test_a_json_array_is_named_as_such(tmp_path, capsys):
    path = tmp_path / "docs.json"
    path.write_text(json.dumps([{"text": "a"}, {"text": "b"}], indent=1))
    assert prepare(path, "--out", tmp_path / "tok") == 2
    assert "holds a JSON array, not JSON lines" in capsys.readouterr().err


def test_leftovers_of_a_killed_install_are_removed_and_a_kept_work_dir_is_explained(
    tmp_path, capsys
):
    texts = [tmp_path / f"{i}.txt" for i in range(3)]
    for i, path in enumerate(texts):
        path.write_text(f"text number {i}")
    leftover = tmp_path / ".tok.tmp-0123abcd"  # a prepare killed while installing tok
    leftover.mkdir()
    (leftover / "train.bin").write_bytes(b"x" * 1000)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe")
    assert prepare(*texts, bad, "--out", tmp_path / "tok") == 2
    err = capsys.readouterr().err
    assert f"removed {leftover}" in err and not leftover.exists()
    assert f"rm -r {tmp_path / 'tok.partial'} discards them" in err


def test_ctrl_c_in_prepare_is_one_line(tmp_path):
    big = tmp_path / "big.jsonl"
    line = json.dumps({"text": "some words " * 40}) + "\n"
    big.write_text(line * 60_000)  # ~27 MB: seconds of tokenizing
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    cmd = [sys.executable, "-m", "moetrain", "prepare", str(big), "--out", str(tmp_path / "tok")]
    run = subprocess.Popen([*cmd, "--workers", "1"], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (tmp_path / "tok.partial").exists() and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130, err
    assert "Traceback" not in err and "moetrain prepare: interrupted" in err


@pytest.mark.parametrize(
    "stored, read_as, eos_id, match",
    [
        ("uint32", "uint16", 0, "likely --dtype uint32"),
        ("uint16", "uint32", 0, "likely --dtype uint16"),
        ("uint16", "uint16", 7, r"ends a document every 2\.0 tokens .* check --eos-id"),
    ],
)
def test_token_files_read_with_the_wrong_dtype_or_eos_id(
    tmp_path, capsys, stored, read_as, eos_id, match
):
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, 300, rng.integers(20, 200)), 0) for _ in range(100)]
    tokens = np.concatenate(docs).astype(stored)
    tokens = tokens[: len(tokens) // 2 * 2]  # whole tokens in either dtype
    if eos_id == 7:  # a frequent id given as the EOS
        tokens[::2] = 7
    tokens.tofile(tmp_path / "tokens.bin")
    flags = ["--dtype", read_as, "--eos-id", str(eos_id), "--vocab-size", "300"]
    out = ["--out", str(tmp_path / "tok")]
    assert main(["prepare", "--pretokenized", str(tmp_path / "tokens.bin"), *out, *flags]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert re.search(match, line), line
