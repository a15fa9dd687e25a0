"""Text documents from the files a user brings to `moetrain prepare`, in a fixed order.

Inputs are files, directories and glob patterns; `expand_inputs` turns them into a sorted list
of sources (a directory is searched recursively for files of a known type, plain ``.json``
excepted, and for Hugging Face datasets saved with `save_to_disk`, each one source). `read_documents` yields the
text of each document: a ``.txt`` file is one document; JSON lines (``.jsonl``, ``.json``,
optionally ``.gz`` or ``.zst`` compressed) hold one document per line in a string field;
``.parquet`` files and saved Hugging Face datasets hold one per row in a string column. Blank
lines and empty texts are skipped; a source without any document is an error. A malformed record
is a one-line `ValueError` naming the file and its line (or row). The compressed and columnar
formats need optional packages (the `data` extra); a missing one is an error naming the extra.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")
SUFFIXES = (".txt", ".parquet", *JSON_SUFFIXES)
_HF_MARKERS = ("dataset_info.json", "state.json")


def _suffix(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def _walked(path: Path) -> bool:
    """Whether a directory walk takes this file: plain .json files are left to explicit naming,
    since directories are full of metadata (a saved dataset's state.json, configs)."""
    return _suffix(path) not in (None, ".json")


def is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and all((path / m).is_file() for m in _HF_MARKERS)


def _walk(root: Path) -> list[Path]:
    """The sources under a directory, sorted: saved datasets as a whole, and walked files."""
    if (root / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in root.iterdir() if is_hf_dataset(p))
        raise ValueError(
            f"{root} is a saved Hugging Face DatasetDict (splits {', '.join(splits)}); give the "
            f"directory of the split to train on, e.g. {root / (splits or ['train'])[0]}"
        )
    found: list[Path] = []
    for entry in sorted(root.iterdir()):
        if is_hf_dataset(entry):
            found.append(entry)
        elif entry.is_dir():
            found.extend(_walk(entry))
        elif entry.is_file() and _walked(entry):
            found.append(entry)
    return found


def expand_inputs(inputs: list[str | Path]) -> list[Path]:
    """Files, saved datasets, directories and glob patterns -> the sources, each once, in order
    (the inputs' order; inside a directory or a pattern, sorted by path)."""
    sources: list[Path] = []
    for spec in inputs:
        path = Path(spec)
        if glob.has_magic(str(spec)) and not path.exists():
            matches = [Path(p) for p in sorted(glob.glob(str(spec), recursive=True))]
            found = [p for p in matches if is_hf_dataset(p) or (p.is_file() and _suffix(p))]
            if not found:
                raise ValueError(f"the pattern {spec} matches no input file of a known type")
            sources.extend(found)
        elif is_hf_dataset(path):
            sources.append(path)
        elif path.is_dir():
            found = _walk(path)
            if not found:
                raise ValueError(
                    f"input directory {path} holds no file of a known type ({', '.join(SUFFIXES)})"
                )
            sources.extend(found)
        elif path.is_file():
            if _suffix(path) is None:
                raise ValueError(
                    f"input file {path} has an unsupported type; expected one of "
                    f"{', '.join(SUFFIXES)} or a Hugging Face dataset directory"
                )
            sources.append(path)
        else:
            raise ValueError(f"input file {path} does not exist")
    return list(dict.fromkeys(sources))


def source_bytes(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*.arrow"))
    return path.stat().st_size


def read_documents(path: Path, text_field: str, advance: Callable[[int], None]) -> Iterator[str]:
    """The non-empty documents of one source; `advance` is told the input bytes consumed."""
    num_docs = 0
    if is_hf_dataset(path):
        reader = _read_hf_dataset(path, text_field, advance)
    elif _suffix(path) == ".txt":
        reader = _read_txt(path, advance)
    elif _suffix(path) == ".parquet":
        reader = _read_parquet(path, text_field, advance)
    else:
        reader = _read_json_lines(path, text_field, advance)
    for text in reader:
        if text:
            num_docs += 1
            yield text
    if num_docs == 0:
        raise ValueError(f"input {path} holds no documents (no non-empty {text_field!r} text)")


def _read_txt(path: Path, advance: Callable[[int], None]) -> Iterator[str]:
    data = path.read_bytes()
    advance(len(data))
    if not data.strip():
        raise ValueError(f"input file {path} is empty")
    try:
        yield data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"input file {path} is not UTF-8 text: {exc}") from None


def _optional(module: str, package: str, what: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        raise ValueError(
            f"reading {what} needs the optional package {package}: "
            f"pip install 'moetrain[data]' (or pip install {package})"
        ) from None


def _open_stream(path: Path, raw: IO[bytes]) -> tuple[IO[bytes], tuple[type[Exception], ...]]:
    """The decompressed byte stream of `raw` and the exceptions its decompressor raises."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb"), (OSError, EOFError)
    if name.endswith(".zst"):
        zstandard = _optional("zstandard", "zstandard", f"{path} (.zst)")
        reader = zstandard.ZstdDecompressor().stream_reader(raw)
        return io.BufferedReader(reader), (zstandard.ZstdError, OSError, EOFError)
    return raw, ()


def _read_json_lines(path: Path, text_field: str, advance: Callable[[int], None]) -> Iterator[str]:
    with open(path, "rb") as raw:
        stream, damaged = _open_stream(path, raw)
        consumed = line_no = 0
        lines = enumerate(stream, start=1)
        while True:
            try:
                line_no, line = next(lines)
            except StopIteration:
                break
            except damaged as exc:
                raise ValueError(
                    f"{path}:{line_no + 1}: cannot decompress ({exc}); the file is truncated "
                    "or corrupt"
                ) from None
            advance(raw.tell() - consumed)
            consumed = raw.tell()
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({exc})") from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ValueError(
                    f"{path}:{line_no}: expected a JSON object with a string {json.dumps(text_field)} field"
                )
            yield text


def _texts_of_tables(
    where: Path,
    tables: Iterator[Any],
    text_field: str,
    advance: Callable[[int], None],
    total_bytes: int,
    total_rows: int,
) -> Iterator[str]:
    """The strings of column `text_field` of Arrow tables or record batches, row by row; input
    bytes are reported in proportion to the rows read (columnar files have no line positions)."""
    row = reported = 0
    for table in tables:
        for text in table.column(text_field).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise ValueError(
                    f"{where}: row {row}: column {text_field!r} holds {text!r}, not a string"
                )
            yield text
        done = total_bytes * row // max(total_rows, 1)
        advance(done - reported)
        reported = done


def _check_column(where: Path, names: list[str], text_field: str) -> None:
    if text_field not in names:
        raise ValueError(
            f"{where} has no column {text_field!r} (its columns: {', '.join(names)}); "
            "choose one with --text-field"
        )


def _read_parquet(path: Path, text_field: str, advance: Callable[[int], None]) -> Iterator[str]:
    _optional("pyarrow", "pyarrow", f"{path} (Parquet)")
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid (a ValueError) or OSError
        raise ValueError(f"{path} is not a readable Parquet file ({exc})") from None
    _check_column(path, parquet.schema_arrow.names, text_field)
    groups = (
        parquet.read_row_group(i, columns=[text_field]) for i in range(parquet.num_row_groups)
    )
    total = (path.stat().st_size, parquet.metadata.num_rows)
    yield from _texts_of_tables(path, groups, text_field, advance, *total)


def _read_hf_dataset(path: Path, text_field: str, advance: Callable[[int], None]) -> Iterator[str]:
    datasets = _optional("datasets", "datasets", f"the Hugging Face dataset {path}")
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise ValueError(f"{path} is not a loadable saved Hugging Face dataset ({exc})") from None
    if isinstance(dataset, datasets.DatasetDict):
        raise ValueError(
            f"{path} holds a DatasetDict (splits {', '.join(dataset)}); give one split's "
            f"directory, e.g. {path / next(iter(dataset))}"
        )
    _check_column(path, dataset.column_names, text_field)
    columns = dataset.select_columns([text_field])
    batches = columns.with_format("arrow").iter(batch_size=1024)  # the saved row order
    total = (source_bytes(path), len(dataset))
    yield from _texts_of_tables(path, batches, text_field, advance, *total)
