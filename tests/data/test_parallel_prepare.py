"""`prepare` in worker processes and in units: the token directory is bitwise the same for any
number of workers and unit size, an interrupted prepare resumes without redoing finished units,
and errors of a worker name the file and line."""

import gzip
import hashlib
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
from conftest import assert_failed_prepare_left
from test_tokenizer import train_bpe

from moetrain.data import ByteTokenizer, load_split, prepare
from moetrain.data import parallel_tokenize as pt
from moetrain.data.inputs import expand_inputs

EOS = ByteTokenizer.eos_id
WRITE_UNIT = pt.write_unit
WORDS = ["the", "expert", "router", "token", "Größe", "✓", "数据", "🚀", "a", "of", "\n", "\t"]


def random_texts(rng, count, max_words=60):
    texts = []
    for _ in range(count):
        words = rng.choice(WORDS, size=int(rng.integers(0, max_words)))
        texts.append(" ".join(words))
    return texts


def write_jsonl(path, texts, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"text": text, "id": i}) + "\n")
            if i % 7 == 3:
                f.write("\n")  # blank lines are skipped
    return path


def random_inputs(tmp_path, seed=0):
    """Shards of every format, each with random documents; returns (inputs, their documents)."""
    rng = np.random.default_rng(seed)
    texts = [random_texts(rng, n) for n in (150, 40, 60)]
    inputs = [
        write_jsonl(tmp_path / "a.jsonl", texts[0]),
        write_jsonl(tmp_path / "b.jsonl.gz", texts[1], opener=gzip.open),
        tmp_path / "c.txt",
    ]
    inputs[2].write_text("one document\nof two lines ✓", encoding="utf-8")
    documents = [t for t in texts[0] + texts[1] if t] + [inputs[2].read_text(encoding="utf-8")]
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts[2]}), tmp_path / "d.parquet", row_group_size=7)
    inputs.append(tmp_path / "d.parquet")
    documents += [t for t in texts[2] if t]
    return inputs, documents


def digests(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


def decoded(out):
    parts = []
    for split in ("train", "val"):
        tokens = np.asarray(load_split(out, split))
        parts += np.split(tokens, np.flatnonzero(tokens == EOS) + 1)[:-1]
    return [ByteTokenizer().decode(p) for p in parts]


def test_workers_and_unit_sizes_give_bitwise_the_same_directory(tmp_path):
    inputs, documents = random_inputs(tmp_path)
    units = pt.plan_units(expand_inputs(inputs), unit_bytes=1500)
    assert len(units) > 2 * len(inputs)  # the JSON lines and the Parquet file were split
    one = prepare(inputs, tmp_path / "one", workers=1, progress=False)
    two = prepare(inputs, tmp_path / "two", workers=2, unit_bytes=1500, progress=False)
    assert digests(one) == digests(two)
    assert sorted(decoded(one)) == sorted(documents)
    assert not (tmp_path / "two.partial").exists()


def test_hf_tokenizer_is_rebuilt_in_each_worker(tmp_path):
    inputs, documents = random_inputs(tmp_path, seed=1)
    tokenizer = str(train_bpe(tmp_path / "tokenizer.json", documents))
    one = prepare(inputs, tmp_path / "one", tokenizer=tokenizer, workers=1, progress=False)
    two = prepare(inputs, tmp_path / "two", tokenizer, workers=2, unit_bytes=2000, progress=False)
    assert digests(one) == digests(two)
    assert np.asarray(load_split(one, "train")).max() > 256  # merges were used


def test_a_bad_line_deep_in_a_split_file_names_its_line_from_a_worker(tmp_path):
    rng = np.random.default_rng(2)
    lines = [json.dumps({"text": t or "x"}) for t in random_texts(rng, 300)]
    lines[236] = '{"text": "cut off'
    (tmp_path / "big.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    before = sorted(tmp_path.iterdir())
    with pytest.raises(ValueError, match=r"big\.jsonl:237: not valid JSON"):
        prepare([tmp_path / "big.jsonl"], tmp_path / "tok", workers=2, unit_bytes=2000)
    assert_failed_prepare_left(tmp_path, before, tmp_path / "tok")
    # Fixed, the same command resumes: the units before the bad line were kept.
    kept = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "tok.partial").glob("*.tokens")}
    assert kept
    lines[236] = '{"text": "mended"}'
    (tmp_path / "big.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = prepare([tmp_path / "big.jsonl"], tmp_path / "tok", workers=2, unit_bytes=2000)
    assert "mended" in decoded(out) and not (tmp_path / "tok.partial").exists()


def spy_on_units(monkeypatch, stop_after=None):
    """The keys of the units `write_unit` is called for; KeyboardInterrupt (Ctrl-C in the
    middle of a unit) after `stop_after` of them."""
    written = []

    def write_unit(work, unit, *args):
        if len(written) == stop_after:
            raise KeyboardInterrupt
        written.append(unit.key)
        return WRITE_UNIT(work, unit, *args)

    monkeypatch.setattr(pt, "write_unit", write_unit)
    return written


def test_resume_after_an_interrupt_redoes_only_unfinished_units(tmp_path, monkeypatch, capsys):
    inputs, _ = random_inputs(tmp_path, seed=3)
    reference = prepare(inputs, tmp_path / "reference", progress=False)
    first = spy_on_units(monkeypatch, stop_after=5)
    with pytest.raises(KeyboardInterrupt):
        prepare(inputs, tmp_path / "tok", workers=1, unit_bytes=1500, progress=False)
    assert "the 5 finished units in" in capsys.readouterr().err
    work = tmp_path / "tok.partial"
    (work / f"{first[-1]}.json").unlink()  # as a kill between a unit's data and its record

    again = spy_on_units(monkeypatch)
    out = prepare(inputs, tmp_path / "tok", workers=1, unit_bytes=1500, progress=True)
    num_units = len(pt.plan_units(expand_inputs(inputs), 1500))
    assert f"resuming: 4 of {num_units} units done" in capsys.readouterr().err
    assert sorted(again) == sorted(
        set(u.key for u in pt.plan_units(expand_inputs(inputs), 1500)) - set(first[:4])
    )
    assert digests(out) == digests(reference)
    assert not work.exists()


def test_changed_inputs_or_settings_are_redone(tmp_path, capsys):
    a = tmp_path / "a.jsonl"
    a.write_text(
        "".join(json.dumps({"text": f"old {i}", "body": f"body {i}"}) + "\n" for i in range(9))
    )
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        prepare([a, tmp_path / "bad.jsonl"], tmp_path / "tok", progress=False)
    assert (tmp_path / "tok.partial").is_dir()  # a.jsonl's unit is kept
    # Another text field: the kept unit holds other texts, so the work starts over.
    out = prepare([a], tmp_path / "tok", text_field="body", progress=False)
    assert "holds units made with another text_field; starting over" in capsys.readouterr().err
    assert sorted(decoded(out)) == [f"body {i}" for i in range(9)]

    with pytest.raises(ValueError, match="not valid JSON"):
        prepare([a, tmp_path / "bad.jsonl"], tmp_path / "tok2", progress=False)
    a.write_text("".join(json.dumps({"text": f"new {i}"}) + "\n" for i in range(9)))
    out = prepare([a], tmp_path / "tok2", progress=False)  # a.jsonl changed: redone
    assert sorted(decoded(out)) == [f"new {i}" for i in range(9)]


def test_progress_off_a_terminal_is_one_summary_line(tmp_path, capsys):
    inputs, documents = random_inputs(tmp_path, seed=4)
    prepare(inputs, tmp_path / "tok", workers=1, unit_bytes=3000, progress=True)
    num_bytes = sum(p.stat().st_size for p in inputs) / 1e6
    num_tokens = sum(len(d.encode()) + 1 for d in documents)  # each document ends with EOS
    text_mb = sum(len(d.encode()) for d in documents) / 1e6
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        f"tokenized {len(documents):,} documents, {num_bytes:,.1f} MB of files ({text_mb:,.1f} "
        f"MB of text), into {num_tokens:,} tokens"
    )
    assert line.endswith("MB/s with 1 worker")


def test_the_summary_says_where_the_default_worker_count_comes_from(tmp_path, capsys):
    inputs, _ = random_inputs(tmp_path, seed=5)
    prepare(inputs, tmp_path / "tok", unit_bytes=3000, progress=True)
    cores = len(os.sched_getaffinity(0))
    line = capsys.readouterr().err.splitlines()[-1]
    match = re.search(
        r"with 1 worker \(the default, the fewest of: (\d+) cores, (\d+) units to do, 0 x 8 MiB of input; at least 1\)$",
        line,
    )
    assert match and int(match[1]) == cores and int(match[2]) > 1, line


def test_progress_counts_the_text_a_compressed_input_holds(tmp_path, capsys):
    """The files' MB is what the bar's fraction and rate count; the MB of text is what they
    hold uncompressed, also for the units a resume keeps."""
    texts = [f"line {i} " + "the same words again " * 40 for i in range(300)]
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "plain ✓"}) + "\n")
    inputs = [tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl"]
    file_mb = sum(p.stat().st_size for p in inputs) / 1e6
    text_mb = (sum(len(t) for t in texts) + len("plain ✓".encode())) / 1e6
    assert text_mb > 10 * file_mb
    prepare(inputs, tmp_path / "tok", workers=1, progress=True)
    expected = f"{file_mb:,.1f} MB of files ({text_mb:,.1f} MB of text)"
    assert expected in capsys.readouterr().err
    (tmp_path / "d.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match="not valid JSON"):  # the units before it are kept
        prepare([*inputs, tmp_path / "d.jsonl"], tmp_path / "tok2", workers=1, progress=False)
    prepare(inputs, tmp_path / "tok2", workers=1, progress=True)
    assert expected in capsys.readouterr().err


def test_a_killed_prepare_resumes_bitwise(tmp_path, monkeypatch, capsys):
    """kill -9 of a prepare and its two workers, then the same prepare again (in-process, with
    one worker, watched): it tokenizes only the units the killed one had not finished."""
    inputs, _ = random_inputs(tmp_path, seed=5)
    reference = prepare(inputs, tmp_path / "reference", progress=False)
    out, work = tmp_path / "tok", tmp_path / "tok.partial"
    code = (
        "import sys; from moetrain.data import prepare; "
        f"prepare({[str(p) for p in inputs]!r}, {str(out)!r}, workers=2, unit_bytes=200, "
        "progress=False)"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    run = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    deadline = time.time() + 60
    while len(list(work.glob("*.json"))) < 6 and time.time() < deadline and run.poll() is None:
        time.sleep(0.002)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    assert not out.exists(), "the kill came too late to test a resume"
    finished = {p.stem for p in work.glob("*.json") if p.name != "settings.json"}
    assert finished

    written = spy_on_units(monkeypatch)
    prepare(inputs, out, workers=1, unit_bytes=200, progress=True)
    units = pt.plan_units(expand_inputs(inputs), 200)
    assert f"resuming: {len(finished)} of {len(units)} units done" in capsys.readouterr().err
    assert sorted(written) == sorted({u.key for u in units} - finished)
    assert digests(out) == digests(reference)


def test_a_foreign_directory_at_the_work_path_is_never_emptied(tmp_path):
    (tmp_path / "a.jsonl").write_text(
        "".join(json.dumps({"text": f"d{i}"}) + "\n" for i in range(4))
    )
    (tmp_path / "tok.partial").mkdir()
    (tmp_path / "tok.partial" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"tok\.partial exists and is not the work directory"):
        prepare([tmp_path / "a.jsonl"], tmp_path / "tok", progress=False)
    assert [p.name for p in (tmp_path / "tok.partial").iterdir()] == ["notes.txt"]
