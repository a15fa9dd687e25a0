"""The documents in `moetrain prepare`'s sources (`moetrain.data.inputs`), one text at a time.

A ``.txt`` file is one document, or one per paragraph or line (`ReadOptions.split_text`); JSON
lines (``.jsonl``, ``.json``, optionally ``.gz`` or ``.zst``) one per line in a string field;
``.parquet`` files and Hugging Face datasets one per row in a string column. Blank lines, empty
texts and empty text files are skipped. A bad record (not a JSON object with a string text
field, a non-string row, non-UTF-8 text) goes to `BadRecords`: a `ValueError` naming the file and
line (or row), or with ``on_bad_record="skip"`` counted; ``replace_bad_bytes`` reads non-UTF-8
bytes as U+FFFD. A compressed JSON-lines file that cannot be decompressed to its end (truncated,
corrupt) is a bad record too: skipped, it keeps the documents before the damage. A damaged
Parquet file or dataset is always an error. A source's parts read in order yield exactly its
documents, with the same line and row numbers in messages.
"""

from __future__ import annotations

import gzip
import io
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from moetrain.data.inputs import (
    NamedDataset,
    Part,
    Source,
    is_hf_dataset,
    open_dataset,
    open_parquet,
    optional_package,
    parquet_group_rows,
    source_bytes,
    suffix_of,
)

SPLIT_TEXT = ("file", "paragraph", "line")
ON_BAD_RECORD = ("error", "skip")
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")  # one or more blank (or whitespace-only) lines


@dataclass(frozen=True)
class ReadOptions:
    """How documents are read: the JSON field or column holding the text, how a .txt file is
    cut into documents, what a bad record does, and whether non-UTF-8 bytes become U+FFFD."""

    text_field: str = "text"
    split_text: str = "file"
    on_bad_record: str = "error"
    replace_bad_bytes: bool = False

    def __post_init__(self) -> None:
        for flag, value, allowed in (
            ("--split-text", self.split_text, SPLIT_TEXT),
            ("--on-bad-record", self.on_bad_record, ON_BAD_RECORD),
        ):
            if value not in allowed:
                raise ValueError(f"{flag} ({value!r}) must be one of {', '.join(allowed)}")


@dataclass
class BadRecords:
    """The bad records met while reading: raised at once, or (`skip`) counted, the first
    `SHOWN` named."""

    skip: bool = False
    count: int = 0
    first: list[str] = field(default_factory=list)
    SHOWN = 5

    def add(self, where: str, why: str, bad_bytes: bool = False) -> None:
        if not self.skip:
            fix = "pass --replace-bad-bytes to read them as U+FFFD, or " if bad_bytes else ""
            raise ValueError(f"{where}: {why}; {fix}pass --on-bad-record=skip to skip such records")
        self.count += 1
        if len(self.first) < self.SHOWN:
            self.first.append(f"{where}: {why}")


def read_documents(
    source: Source,
    options: ReadOptions,
    advance: Callable[[int], None],
    part: Part | None = None,
    bad: BadRecords | None = None,
) -> Iterator[str]:
    """The non-empty documents of one source, or of one part of it (default: all of it);
    `advance` is told the input bytes consumed, `bad` the bad records (default: raise at the
    first)."""
    part = part if part is not None else Part()
    bad = bad if bad is not None else BadRecords(skip=options.on_bad_record == "skip")
    if isinstance(source, NamedDataset) or is_hf_dataset(source):
        reader = _read_dataset(source, options.text_field, advance, part, bad)
    elif suffix_of(source) == ".txt":
        reader = _read_txt(source, options, advance, bad)
    elif suffix_of(source) == ".parquet":
        reader = _read_parquet(source, options.text_field, advance, part, bad)
    else:
        reader = _read_json_lines(source, options, advance, part, bad)
    return (text for text in reader if text)


def _decode(data: bytes, options: ReadOptions) -> str:
    return data.decode("utf-8", errors="replace" if options.replace_bad_bytes else "strict")


def _read_txt(
    path: Path, options: ReadOptions, advance: Callable[[int], None], bad: BadRecords
) -> Iterator[str]:
    data = path.read_bytes()
    advance(len(data))
    try:
        text = _decode(data, options)
    except UnicodeDecodeError as exc:
        bad.add(str(path), f"not UTF-8 text ({exc})", bad_bytes=True)
        return
    if options.split_text == "file":
        pieces = [text] if text.strip() else []
    elif options.split_text == "paragraph":
        pieces = _PARAGRAPH_BREAK.split(text)
    else:
        pieces = text.splitlines()
    yield from (piece for piece in pieces if piece.strip())


def _open_stream(path: Path, raw: IO[bytes]) -> tuple[IO[bytes], tuple[type[Exception], ...]]:
    """The decompressed byte stream of `raw` and the exceptions its decompressor raises."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb"), (OSError, EOFError)
    if name.endswith(".zst"):
        zstandard = optional_package("zstandard", "zstandard", f"{path} (.zst)")
        reader = zstandard.ZstdDecompressor().stream_reader(raw)
        return io.BufferedReader(reader), (zstandard.ZstdError, OSError, EOFError)
    return raw, ()


def _lines_before(path: Path, offset: int) -> int:
    """The number of line ends in the first `offset` bytes of a file (for messages only, so a
    part that starts deep in a file pays nothing unless one of its records is bad)."""
    count = 0
    with open(path, "rb") as f:
        while offset > 0:
            block = f.read(min(offset, 16 << 20))
            count += block.count(b"\n")
            offset -= len(block)
    return count


def _read_json_lines(
    path: Path,
    options: ReadOptions,
    advance: Callable[[int], None],
    part: Part,
    bad: BadRecords,
) -> Iterator[str]:
    field_name = json.dumps(options.text_field)
    before: list[int] = []  # the lines before the part, counted at the first bad record

    def where(n: int) -> str:
        if part.start and not before:
            before.append(_lines_before(path, part.start))
        return f"{path}:{n + (before[0] if before else 0)}"

    with open(path, "rb") as raw:
        stream, damaged = _open_stream(path, raw)
        raw.seek(part.start)  # only plain files are split, so start is 0 for the others
        consumed, line_no = part.start, 0
        lines = enumerate(stream, start=1)
        while part.stop is None or consumed < part.stop:
            try:
                line_no, line = next(lines)
            except StopIteration:
                break
            except damaged as exc:  # skipped: the documents before it count, the rest is lost
                why = f"cannot decompress ({exc}); the file is truncated or corrupt"
                bad.add(where(line_no + 1), f"{why} (the rest of the file is skipped)")
                advance(path.stat().st_size - consumed)  # compressed files are never split
                break
            advance(raw.tell() - consumed)
            consumed = raw.tell()
            if not line.strip():
                continue
            if part.start == 0 and line_no == 1 and line.lstrip().startswith(b"["):
                raise ValueError(
                    f"{path} holds a JSON array, not JSON lines (one object per line); convert "
                    f"it, e.g. jq -c '.[]' {path} > {path.stem}.jsonl"
                )
            try:
                record = json.loads(_decode(line, options))
            except UnicodeDecodeError as exc:
                bad.add(where(line_no), f"not UTF-8 text ({exc})", bad_bytes=True)
                continue
            except ValueError as exc:
                bad.add(where(line_no), f"not valid JSON ({exc})")
                continue
            text = record.get(options.text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                bad.add(where(line_no), f"expected a JSON object with a string {field_name} field")
                continue
            yield text


def _texts_of_tables(
    where: Source,
    tables: Iterator[Any],
    text_field: str,
    advance: Callable[[int], None],
    num_bytes: int,
    rows: tuple[int, int],
    bad: BadRecords,
) -> Iterator[str]:
    """The strings of column `text_field` of Arrow tables or record batches that hold rows
    [rows[0], rows[1]) of `where`, row by row; the part's `num_bytes` are reported in proportion
    to the rows read (columnar files have no line positions)."""
    first, stop = rows
    row, reported = first, 0
    for table in tables:
        for text in table.column(text_field).to_pylist():
            row += 1
            if isinstance(text, str):
                yield text
            else:
                bad.add(
                    f"{where}: row {row}", f"column {text_field!r} holds {text!r}, not a string"
                )
        done = num_bytes * (row - first) // max(stop - first, 1)
        advance(done - reported)
        reported = done


def _check_column(where: Source, names: list[str], text_field: str) -> None:
    if text_field not in names:
        raise ValueError(
            f"{where} has no column {text_field!r} (its columns: {', '.join(names)}); "
            "choose one with --text-field"
        )


def _read_parquet(
    path: Path, text_field: str, advance: Callable[[int], None], part: Part, bad: BadRecords
) -> Iterator[str]:
    parquet = open_parquet(path)
    _check_column(path, parquet.schema_arrow.names, text_field)
    rows = parquet_group_rows(parquet)
    groups = range(part.start, parquet.num_row_groups if part.stop is None else part.stop)
    tables = (parquet.read_row_group(i, columns=[text_field]) for i in groups)
    num_bytes = part.num_bytes if part.stop is not None else path.stat().st_size
    span = (rows[groups.start], rows[groups.stop])
    yield from _texts_of_tables(path, tables, text_field, advance, num_bytes, span, bad)


def _read_dataset(
    source: Source, text_field: str, advance: Callable[[int], None], part: Part, bad: BadRecords
) -> Iterator[str]:
    dataset = open_dataset(source)
    _check_column(source, dataset.column_names, text_field)
    stop = len(dataset) if part.stop is None else part.stop
    rows = dataset.select_columns([text_field]).select(range(part.start, stop))
    batches = rows.with_format("arrow").iter(batch_size=1024)  # the saved row order
    num_bytes = part.num_bytes if part.stop is not None else source_bytes(source)
    span = (part.start, stop)
    yield from _texts_of_tables(source, batches, text_field, advance, num_bytes, span, bad)
