"""Tokenizing `prepare`'s sources in worker processes, into a work directory that survives a kill.

`plan_units` cuts the sources into units (a source, or a `Part` of a large one, about
`UNIT_BYTES` of input each); `tokenize_units` tokenizes them in a spawn pool (or in this process
for one worker). A finished unit is three files in the work directory (`work_dir_of(out)`): raw
tokens (no EOS), int64 document lengths, and a JSON record renamed into place last, so a unit is
done only when complete. A unit's name hashes its source's identity and its part; the directory
records what else tokens depend on (`work_settings`). A re-run keeps every finished unit whose
input is unchanged, whatever the number of workers; a work directory of other settings is
emptied. The units in plan order give exactly the documents of one sequential read, so the
token directory does not depend on workers, unit size or interruptions. One prepare at a time
holds a work directory (an advisory lock).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import multiprocessing
import os
import queue
import shutil
import signal
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moetrain.data.input_readers import BadRecords, ReadOptions, read_documents
from moetrain.data.inputs import Part, Source, source_identity, split_source, suffix_of
from moetrain.data.progress import TokenizeProgress
from moetrain.data.tokenizer import ByteTokenizer, HFTokenizer
from moetrain.data.tokens import token_dtype

UNIT_BYTES = 8 << 20
FORMAT = "moetrain-prepare-work"
VERSION = 1
_FLUSH_TOKENS = 1 << 20  # tokens a worker buffers before writing
_REPORT_BYTES = 1 << 20  # input bytes between progress reports


@dataclass(frozen=True)
class Unit:
    """One piece of work: a part of the source at `source_index`, named by `key`."""

    source: Source
    part: Part
    source_index: int
    key: str


def plan_units(sources: list[Source], unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    units = []
    for index, source in enumerate(sources):
        identity = source_identity(source)
        for part in split_source(source, unit_bytes):
            name = json.dumps([identity, part.start, part.stop]).encode()
            units.append(Unit(source, part, index, hashlib.sha256(name).hexdigest()[:24]))
    return units


def work_dir_of(out_dir: Path) -> Path:
    return out_dir.with_name(f"{out_dir.name}.partial")


def work_settings(tokenizer: ByteTokenizer | HFTokenizer, options: ReadOptions) -> dict[str, Any]:
    """What a unit's tokens depend on besides its input (its file name covers that). Not the
    bad-record policy: a unit finishes under `error` only without bad records, and then holds
    what `skip` would give."""
    tokenizer_hash = (
        hashlib.sha256(tokenizer.path.read_bytes()).hexdigest()
        if isinstance(tokenizer, HFTokenizer)
        else "byte"
    )
    return {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer_sha256": tokenizer_hash,
        "dtype": token_dtype(tokenizer.vocab_size).newbyteorder("<").str,
        "text_field": options.text_field,
        "split_text": options.split_text,
        "replace_bad_bytes": options.replace_bad_bytes,
    }


def _write_atomically(path: Path, data: bytes) -> None:
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    with open(part, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file; {} when it is missing, unreadable or not an object."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


class WorkDir:
    """The work directory of one prepare: held (locked) inside a ``with`` block."""

    def __init__(self, path: Path, settings: dict[str, Any]):
        self.path = path
        self.settings = settings
        self.dtype = np.dtype(settings["dtype"])
        self._lock: Any = None

    def __enter__(self) -> WorkDir:
        self._check_ours()
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.path / "lock", "w")  # noqa: SIM115 (held until __exit__)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise ValueError(
                f"another moetrain prepare is writing {self.path} (it holds {self.path / 'lock'})"
            ) from None
        settings_file = self.path / "settings.json"
        found = _read_json(settings_file)
        if found != self.settings:
            if found:
                changed = [k for k in self.settings if found.get(k) != self.settings[k]]
                print(
                    f"prepare: {self.path} holds units made with another {', '.join(changed)}; "
                    "starting over",
                    file=sys.stderr,
                )
            self._empty()
            _write_atomically(settings_file, json.dumps(self.settings, indent=2).encode())
        self._remove_parts()
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None and self.path.is_dir():
            self._remove_parts()
            kept = len(list(self.path.glob("*.json"))) - 1  # settings.json is not a unit
            if kept > 0:
                print(
                    f"prepare: stopped; the {kept} finished units in {self.path} are kept, and "
                    f"running the same command again resumes from them (rm -r {self.path} "
                    "discards them)",
                    file=sys.stderr,
                )
            else:
                self.remove()
        self._lock.close()

    def _check_ours(self) -> None:
        """Refuse a path that holds something else: starting over empties the directory."""
        if not self.path.exists():
            return
        ours = self.path.is_dir() and (
            _read_json(self.path / "settings.json").get("format") == FORMAT
            or all(p.name == "lock" for p in self.path.iterdir())
        )
        if not ours:
            raise ValueError(
                f"{self.path} exists and is not the work directory of a moetrain prepare (it "
                "holds the finished parts of an interrupted prepare of the same --out); move it "
                "away or choose another --out"
            )

    def _empty(self) -> None:
        for entry in self.path.iterdir():
            if entry.name != "lock":
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()

    def _remove_parts(self) -> None:
        for part in self.path.glob("*.part"):
            part.unlink(missing_ok=True)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def files(self, unit: Unit) -> tuple[Path, Path, Path]:
        """The unit's tokens, document lengths and record."""
        return tuple(self.path / f"{unit.key}.{s}" for s in ("tokens", "lengths", "json"))

    def finished(self, unit: Unit) -> dict[str, Any] | None:
        """The record of a unit finished by an earlier run, when its files are intact."""
        tokens, lengths, record = self.files(unit)
        found = _read_json(record)
        if found.get("key") != unit.key or not tokens.is_file() or not lengths.is_file():
            return None
        sizes = (tokens.stat().st_size, lengths.stat().st_size)
        expected = (found["num_tokens"] * self.dtype.itemsize, found["num_documents"] * 8)
        return found if sizes == expected else None

    def documents(self, unit: Unit, record: dict[str, Any]) -> Iterator[np.ndarray]:
        """The token ids of each document of a finished unit, in order."""
        tokens_file, lengths_file, _ = self.files(unit)
        if record["num_tokens"]:
            tokens = np.memmap(tokens_file, dtype=self.dtype, mode="r")
        else:  # memmap refuses an empty file
            tokens = np.zeros(0, self.dtype)
        ends = np.cumsum(np.fromfile(lengths_file, dtype="<i8"))
        start = 0
        for end in ends.tolist():
            yield tokens[start:end]
            start = end


class _Tally:
    """Counts a worker's progress and hands it to `sink(bytes, documents, tokens, text bytes)`
    in batches: input bytes as the files hold them, and the documents' UTF-8 text bytes (what
    the input holds uncompressed)."""

    def __init__(self, sink: Callable[[int, int, int, int], None]):
        self.sink = sink
        self.counts = [0, 0, 0, 0]
        self.reported_bytes = 0

    def add(
        self, num_bytes: int = 0, num_docs: int = 0, num_tokens: int = 0, text_bytes: int = 0
    ) -> None:
        added = (num_bytes, num_docs, num_tokens, text_bytes)
        self.counts = [a + b for a, b in zip(self.counts, added, strict=True)]
        if self.counts[0] >= _REPORT_BYTES:
            self.flush()

    def flush(self) -> None:
        self.reported_bytes += self.counts[0]
        self.sink(*self.counts)
        self.counts = [0, 0, 0, 0]

    def finish(self, unit_bytes: int) -> None:
        """Report the rest of the unit: readers' byte counts are estimates for some formats."""
        self.add(max(unit_bytes - self.reported_bytes - self.counts[0], 0))
        self.flush()
        self.reported_bytes = 0


def write_unit(
    work: WorkDir,
    unit: Unit,
    tokenizer: ByteTokenizer | HFTokenizer,
    options: ReadOptions,
    tally: _Tally,
) -> dict[str, Any]:
    """Tokenize one unit into its files (see the module docstring); returns its record, with
    the count and the first few of the bad records skipped."""
    final = work.files(unit)
    parts = [f.with_name(f"{f.name}.{os.getpid()}.part") for f in final[:2]]
    num_docs = num_tokens = written = text_bytes = 0
    with open(parts[0], "wb") as tokens_f, open(parts[1], "wb") as lengths_f:
        pending: list[np.ndarray] = []
        bad = BadRecords(skip=options.on_bad_record == "skip")
        for text in read_documents(unit.source, options, tally.add, unit.part, bad):
            pending.append(tokenizer.encode_array(text).astype(work.dtype))
            size = len(text.encode("utf-8", errors="surrogatepass"))
            tally.add(num_docs=1, num_tokens=pending[-1].size, text_bytes=size)
            num_docs, num_tokens = num_docs + 1, num_tokens + pending[-1].size
            text_bytes += size
            if num_tokens - written >= _FLUSH_TOKENS:
                written = num_tokens
                _write_arrays(tokens_f, lengths_f, pending)
        _write_arrays(tokens_f, lengths_f, pending)
        for f in (tokens_f, lengths_f):
            f.flush()
            os.fsync(f.fileno())
    for part, path in zip(parts, final, strict=False):
        os.replace(part, path)
    record = {
        "key": unit.key,
        "source": str(unit.source),
        "part": [unit.part.start, unit.part.stop],
        "num_documents": num_docs,
        "num_tokens": num_tokens,
        "text_bytes": text_bytes,
        "skipped": bad.count,
        "skipped_first": bad.first,
    }
    _write_atomically(final[2], json.dumps(record).encode())
    tally.finish(unit.part.num_bytes)
    return record


def _write_arrays(tokens_f: Any, lengths_f: Any, pending: list[np.ndarray]) -> None:
    if pending:
        tokens_f.write(np.concatenate(pending).tobytes())
        lengths_f.write(np.array([len(p) for p in pending], dtype="<i8").tobytes())
        pending.clear()


def default_workers(units: list[Unit]) -> int:
    """One per core, but no more than the units to do, nor than one per `UNIT_BYTES` of them
    (starting a worker costs about as much as tokenizing a MB or two)."""
    return max(1, min(_worker_limits(units).values()))


def _worker_limits(units: list[Unit]) -> dict[str, int]:
    """`default_workers`' bounds, by what each counts (the progress line names them)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    by_bytes = sum(u.part.num_bytes for u in units) // UNIT_BYTES
    mib = f"x {UNIT_BYTES >> 20} MiB of input"
    return {"cores": cores or 1, "units to do": len(units), mib: by_bytes}


def tokenize_units(
    units: list[Unit],
    work: WorkDir,
    tokenizer: ByteTokenizer | HFTokenizer,
    options: ReadOptions,
    workers: int | None = None,
    progress: bool = True,
) -> dict[str, dict[str, Any]]:
    """Tokenize every unit not finished in `work`, with `workers` processes (default
    `default_workers`; 1 = in this process). Returns the record of every unit, by key. Empty
    text files and skipped bad records are reported on stderr."""
    records = {u.key: r for u in units if (r := work.finished(u)) is not None}
    todo = [u for u in units if u.key not in records]
    why = ""
    if workers is None:  # say where the default comes from: the smallest of its limits
        limits = ", ".join(f"{n} {what}" for what, n in _worker_limits(todo).items())
        why = f"the default, the fewest of: {limits}; at least 1"
    workers = max(1, min(default_workers(todo) if workers is None else workers, len(todo)))
    check = _SourceCheck(units, options.text_field)
    for unit in units:
        if unit.key in records:
            check.add(unit, records[unit.key])
    kept = [u for u in units if u.key in records]
    if kept and progress:
        print(f"prepare: resuming: {len(kept)} of {len(units)} units done", file=sys.stderr)
    done = (
        sum(u.part.num_bytes for u in kept),
        sum(records[u.key]["num_documents"] for u in kept),
        sum(records[u.key]["num_tokens"] for u in kept),
        sum(records[u.key].get("text_bytes", 0) for u in kept),
    )
    bar = TokenizeProgress(progress, sum(u.part.num_bytes for u in units), done, workers, why)
    with bar:
        if workers == 1:
            for unit in todo:
                record = write_unit(work, unit, tokenizer, options, _Tally(bar.add))
                records[unit.key] = check.add(unit, record)
        else:
            for unit, record in _run_pool(todo, work, tokenizer, options, workers, bar):
                records[unit.key] = check.add(unit, record)
        bar.finish(check.totals())
    if check.empty:
        shown = ", ".join(str(p) for p in check.empty[:3]) + (
            ", ..." if len(check.empty) > 3 else ""
        )
        print(f"prepare: skipped {len(check.empty)} empty text files ({shown})", file=sys.stderr)
    skipped = [r for u in units if (r := records[u.key]).get("skipped")]
    if skipped:
        first = [where for r in skipped for where in r["skipped_first"]][: BadRecords.SHOWN]
        print(
            f"prepare: skipped {sum(r['skipped'] for r in skipped):,} bad records "
            f"(--on-bad-record=skip); the first: {'; '.join(first)}",
            file=sys.stderr,
        )
    return records


class _SourceCheck:
    """Raises the error of a source without documents as soon as all its units are done; text
    files without any are listed in `empty` instead (a directory of texts may hold some), unless
    their text was skipped as a bad record (counted there, not as empty)."""

    def __init__(self, units: list[Unit], text_field: str):
        self.remaining = Counter(u.source_index for u in units)
        self.docs: Counter[int] = Counter()
        self.skipped: Counter[int] = Counter()
        self.empty: list[Source] = []
        self.sums = [sum(u.part.num_bytes for u in units), 0, 0, 0]
        self.text_field = text_field

    def add(self, unit: Unit, record: dict[str, Any]) -> dict[str, Any]:
        self.remaining[unit.source_index] -= 1
        self.docs[unit.source_index] += record["num_documents"]
        self.skipped[unit.source_index] += record.get("skipped", 0)
        self.sums[1] += record["num_documents"]
        self.sums[2] += record["num_tokens"]
        self.sums[3] += record.get("text_bytes", 0)  # units of an older prepare lack it
        if self.remaining[unit.source_index] == 0 and self.docs[unit.source_index] == 0:
            if isinstance(unit.source, Path) and suffix_of(unit.source) == ".txt":
                if self.skipped[unit.source_index] == 0:
                    self.empty.append(unit.source)
            else:
                raise ValueError(
                    f"input {unit.source} holds no documents (no non-empty {self.text_field!r} "
                    "text)"
                )
        return record

    def totals(self) -> tuple[int, int, int, int]:
        return tuple(self.sums)


# A pool worker's state, set by `_init_worker`: the work directory, tokenizer, read options and
# the queue progress goes to.
_WORKER: dict[str, Any] = {}


def _init_worker(
    work: tuple[Path, dict[str, Any]],
    tokenizer_file: tuple[str, str, int] | None,
    options: ReadOptions,
    reports: Any,
) -> None:
    # Ctrl-C reaches the whole process group: the parent alone stops, after the units in flight.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if tokenizer_file is None:
        tokenizer: ByteTokenizer | HFTokenizer = ByteTokenizer()
    else:
        path, name, eos_id = tokenizer_file
        tokenizer = HFTokenizer(path, name=name, eos_id=eos_id)
    _WORKER.update(work=WorkDir(*work), tokenizer=tokenizer, options=options, reports=reports)


def _run_unit(unit: Unit) -> tuple[Unit, dict[str, Any]]:
    tally = _Tally(lambda *counts: _WORKER["reports"].put(counts))
    w = _WORKER
    return unit, write_unit(w["work"], unit, w["tokenizer"], w["options"], tally)


def _run_pool(
    todo: list[Unit],
    work: WorkDir,
    tokenizer: ByteTokenizer | HFTokenizer,
    options: ReadOptions,
    workers: int,
    bar: TokenizeProgress,
) -> Iterator[tuple[Unit, dict[str, Any]]]:
    """Finished units, as they finish, from a pool of spawned processes. A worker's error (a
    ValueError naming a file and line) is raised here once the units in flight are finished;
    a worker that dies (killed, out of memory) is an error too, never a hang."""
    # spawn, not fork: the parent may hold threads (rich, torch) that a fork would copy broken.
    context = multiprocessing.get_context("spawn")
    reports = context.Queue()
    tokenizer_file = (
        None
        if isinstance(tokenizer, ByteTokenizer)
        else (str(tokenizer.path), tokenizer.name, tokenizer.eos_id)
    )
    args = ((work.path, work.settings), tokenizer_file, options, reports)
    with ProcessPoolExecutor(workers, context, _init_worker, args) as pool:
        pending = {pool.submit(_run_unit, unit) for unit in todo}  # run in submission order
        try:
            while pending:
                finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                _drain(reports, bar)
                for future in finished:
                    yield future.result()
        except BrokenProcessPool:
            raise ValueError(
                f"a tokenizing worker process died (killed, or out of memory?); the units it "
                f"finished are kept in {work.path}: run again to resume, perhaps with fewer "
                "--workers"
            ) from None
        finally:
            for future in pending:
                future.cancel()
        _drain(reports, bar)


def _drain(reports: Any, bar: TokenizeProgress) -> None:
    while True:
        try:
            bar.add(*reports.get_nowait())
        except queue.Empty:
            return
