"""What `moetrain prepare` reads: its inputs as sources, in a fixed order, and their parts.

`expand_inputs` turns files, directories (searched recursively for known file types, plain
``.json`` excepted, and saved Hugging Face datasets) and glob patterns into a sorted list of
sources; `load_named_dataset` adds a dataset by name. `split_source` cuts a large source into
`Part`s read on their own (JSON lines at line starts, Parquet at row groups, datasets at rows;
compressed and .txt files stay whole); data/input_readers.py reads them. Compressed and
columnar formats need the `data` extra; a missing package is an error naming it.
"""

from __future__ import annotations

import functools
import glob
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")
SUFFIXES = (".txt", ".parquet", *JSON_SUFFIXES)
_HF_MARKERS = ("dataset_info.json", "state.json")


@dataclass(frozen=True)
class NamedDataset:
    """One split of a Hugging Face dataset loaded by name (`load_named_dataset`), read from the
    Arrow files of its cache, in order."""

    name: str
    config: str | None
    split: str
    files: tuple[Path, ...]

    def __str__(self) -> str:
        config = f", config {self.config}" if self.config else ""
        return f"Hugging Face dataset {self.name} ({self.split} split{config})"


Source = Path | NamedDataset


@dataclass(frozen=True)
class Part:
    """A slice of a source that can be read on its own: bytes [start, stop) of plain JSON lines
    (both line starts), row groups [start, stop) of a Parquet file, or rows [start, stop) of a
    dataset; ``stop=None`` reads to the end. `num_bytes` is its share of the input bytes."""

    start: int = 0
    stop: int | None = None
    num_bytes: int = 0


def suffix_of(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def _walked(path: Path) -> bool:
    """Whether a directory walk takes this file: plain .json files are left to explicit naming,
    since directories are full of metadata (a saved dataset's state.json, configs)."""
    return suffix_of(path) not in (None, ".json")


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


def expand_inputs(inputs: list[str | Path | NamedDataset]) -> list[Source]:
    """Files, saved datasets, directories and glob patterns -> the sources, each once, in order
    (the inputs' order; inside a directory or a pattern, sorted by path). Named datasets
    (`load_named_dataset`) pass through."""
    what = f"input file of a known type ({', '.join(SUFFIXES)})"
    types = f"one of {', '.join(SUFFIXES)} or a Hugging Face dataset directory"
    known = lambda p: is_hf_dataset(p) or (p.is_file() and suffix_of(p) is not None)  # noqa: E731
    sources: list[Source] = []
    for spec in inputs:
        named = isinstance(spec, NamedDataset)
        sources.extend([spec] if named else expand_paths(spec, known, _walk, what, types))
    return list(dict.fromkeys(sources))


def expand_paths(
    spec: str | Path,
    known: Callable[[Path], bool],
    walk: Callable[[Path], list[Path]],
    what: str,
    types: str,
) -> list[Path]:
    """The inputs one spec names: a glob pattern's matches (sorted), a directory's `walk`, or
    the file itself; `known` tells an input of the right type, `what` and `types` name them in
    errors."""
    path = Path(spec)
    if glob.has_magic(str(spec)) and not path.exists():
        found = [p for p in map(Path, sorted(glob.glob(str(spec), recursive=True))) if known(p)]
        if not found:
            raise ValueError(f"the pattern {spec} matches no {what}")
        return found
    if path.is_dir() and not known(path):
        found = walk(path)
        if not found:
            raise ValueError(f"input directory {path} holds no {what}")
        return found
    if not path.exists():
        raise ValueError(f"input file {path} does not exist")
    if not known(path):
        raise ValueError(f"input file {path} has an unsupported type; expected {types}")
    return [path]


def load_named_dataset(name: str, config: str | None = None, split: str = "train") -> NamedDataset:
    """One split of a Hugging Face dataset by name, through `datasets.load_dataset`: a name on
    the Hub (downloaded once into the `datasets` cache), or a local directory of data files."""
    datasets = optional_package("datasets", "datasets", f"the Hugging Face dataset {name}")
    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # network, missing config or split: each its own exception type
        what = f"{name}" + (f" (config {config})" if config else "")
        raise ValueError(
            f"cannot load the Hugging Face dataset {what}, split {split}: {exc}"
        ) from None
    files = tuple(Path(f["filename"]) for f in dataset.cache_files)
    if not files:
        raise ValueError(f"the Hugging Face dataset {name} was loaded in memory, not from files")
    return NamedDataset(name, config, split, files)


def _files_of(source: Source) -> list[Path]:
    if isinstance(source, NamedDataset):
        return list(source.files)
    if source.is_dir():
        return sorted(p for p in source.rglob("*") if p.is_file())
    return [source]


def source_bytes(source: Source) -> int:
    if isinstance(source, Path) and not source.is_dir():
        return source.stat().st_size
    return sum(f.stat().st_size for f in _files_of(source) if f.suffix == ".arrow")


def source_identity(source: Source) -> list[list[Any]]:
    """What names a source's content cheaply: the absolute path, size and modification time of
    each of its files (rewriting a file changes it); it is compared, never read back."""
    stats = [(f.resolve(), f.stat()) for f in _files_of(source)]
    return [[str(path), stat.st_size, stat.st_mtime_ns] for path, stat in stats]


def split_source(source: Source, target_bytes: int) -> list[Part]:
    """The parts of a source, each about `target_bytes` of input (see the module docstring)."""
    if isinstance(source, NamedDataset) or is_hf_dataset(source):
        return _row_parts(len(open_dataset(source)), source_bytes(source), target_bytes)
    size = source.stat().st_size
    if suffix_of(source) == ".parquet":
        return _parquet_parts(source, size, target_bytes)
    if suffix_of(source) in (".jsonl", ".json"):
        return _line_parts(source, size, target_bytes)
    return [Part(0, None, size)]


def _num_parts(num_bytes: int, target_bytes: int) -> int:
    if target_bytes < 1:
        raise ValueError(f"the target bytes of a part ({target_bytes}) must be >= 1")
    return max(1, -(-num_bytes // target_bytes))


def _line_parts(path: Path, size: int, target_bytes: int) -> list[Part]:
    cuts = [0]
    count = _num_parts(size, target_bytes)
    with open(path, "rb") as f:
        for i in range(1, count):
            f.seek(max(size * i // count - 1, cuts[-1]))
            f.readline()  # to the first line start at or after the target
            if cuts[-1] < f.tell() < size:
                cuts.append(f.tell())
    cuts.append(size)
    return [Part(a, b, b - a) for a, b in zip(cuts, cuts[1:], strict=False)]


def _rows_to_parts(boundaries: list[int], rows: list[int], num_bytes: int) -> list[Part]:
    """Parts [boundaries[i], boundaries[i + 1]) whose bytes are shares of `num_bytes` by the
    rows they cover (`rows[b]` rows precede boundary b); the shares add up to `num_bytes`."""
    total = max(rows[boundaries[-1]], 1)
    share = [num_bytes * rows[b] // total for b in boundaries]
    share[-1] = num_bytes
    return [
        Part(a, b, share[i + 1] - share[i])
        for i, (a, b) in enumerate(zip(boundaries, boundaries[1:], strict=False))
    ]


def _row_parts(num_rows: int, num_bytes: int, target_bytes: int) -> list[Part]:
    count = min(_num_parts(num_bytes, target_bytes), max(num_rows, 1))
    boundaries = [num_rows * i // count for i in range(count + 1)]
    return _rows_to_parts(boundaries, list(range(num_rows + 1)), num_bytes)


def _parquet_parts(path: Path, size: int, target_bytes: int) -> list[Part]:
    rows = parquet_group_rows(open_parquet(path))
    per_part = -(-rows[-1] // _num_parts(size, target_bytes))
    num_groups = len(rows) - 1
    boundaries = [0]
    for group in range(1, num_groups):
        if rows[group] - rows[boundaries[-1]] >= per_part:
            boundaries.append(group)
    return _rows_to_parts([*boundaries, num_groups], rows, size)


def optional_package(module: str, package: str, what: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        raise ValueError(
            f"reading {what} needs the optional package {package}: "
            f"pip install 'moetrain[data]' (or pip install {package})"
        ) from None


def open_parquet(path: Path) -> Any:
    optional_package("pyarrow", "pyarrow", f"{path} (Parquet)")
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid (a ValueError) or OSError
        raise ValueError(f"{path} is not a readable Parquet file ({exc})") from None


def parquet_group_rows(parquet: Any) -> list[int]:
    """The number of rows before each row group, and in all of them at the end."""
    rows = [0]
    for group in range(parquet.num_row_groups):
        rows.append(rows[-1] + parquet.metadata.row_group(group).num_rows)
    return rows


def open_dataset(source: Source) -> Any:
    """A saved or named dataset, memory-mapped from its Arrow files."""
    return open_dataset_of(source, json.dumps(source_identity(source)))


@functools.lru_cache(maxsize=4)  # the parts of one dataset, read one after another
def open_dataset_of(source: Source, identity: str) -> Any:
    """`_open_dataset`, cached while the dataset's files are unchanged (`identity`)."""
    datasets = optional_package("datasets", "datasets", f"the Hugging Face dataset {source}")
    if isinstance(source, NamedDataset):
        try:
            parts = [datasets.Dataset.from_file(str(f)) for f in source.files]
        except Exception as exc:
            raise ValueError(f"cannot read the cached files of the {source} ({exc})") from None
        return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    try:
        dataset = datasets.load_from_disk(str(source))
    except Exception as exc:
        raise ValueError(f"{source} is not a loadable saved Hugging Face dataset ({exc})") from None
    if isinstance(dataset, datasets.DatasetDict):
        raise ValueError(
            f"{source} holds a DatasetDict (splits {', '.join(dataset)}); give one split's "
            f"directory, e.g. {source / next(iter(dataset))}"
        )
    return dataset
