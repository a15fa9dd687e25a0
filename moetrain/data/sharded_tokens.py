"""The token files a pre-tokenized directory indexes (`moetrain.data.pretokenized`), read back in
place: memory-mapped, never copied.

`open_indexed_split` maps one split's slice of the files meta.json lists: one array, or a
`ShardedTokens` view across files. A `ValueError`: a file whose size changed since prepare, or
whose modification time changed and whose tokens no longer hash to the recorded SHA-256 (a file
only touched is hashed at every start); a model vocabulary smaller than the corpus's.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np


class ShardedTokens:
    """A read-only 1-D array of tokens lying in several arrays end to end, never copied: ``len``,
    ``ndim``, ``shape``, ``dtype``, ``max()``, slices and integer-array gathers of any shape."""

    ndim = 1

    def __init__(self, parts: list[np.ndarray]):
        assert parts and all(p.ndim == 1 for p in parts) and len({p.dtype for p in parts}) == 1
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in parts])
        self.dtype = parts[0].dtype
        self.shape = (int(self.starts[-1]),)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def size(self) -> int:
        return self.shape[0]

    def max(self) -> Any:
        return max(p.max() for p in self.parts if len(p))

    def __getitem__(self, index: Any) -> np.ndarray:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            assert step == 1, "ShardedTokens slices are contiguous"
            pieces = []
            for part, first in zip(self.parts, self.starts[:-1], strict=True):
                lo, hi = max(start - first, 0), min(stop - first, len(part))
                if lo < hi:
                    pieces.append(np.asarray(part[lo:hi]))
            return np.concatenate(pieces) if pieces else np.empty(0, self.dtype)
        positions = np.asarray(index)
        assert np.issubdtype(positions.dtype, np.integer), "index with an int array or a slice"
        if positions.size and (positions.min() < 0 or positions.max() >= len(self)):
            raise IndexError(f"token index out of range [0, {len(self)})")
        which = np.searchsorted(self.starts, positions, side="right") - 1
        out = np.empty(positions.shape, dtype=self.dtype)
        for part in np.unique(which):
            mask = which == part
            out[mask] = self.parts[part][positions[mask] - self.starts[part]]
        return out


def map_tokens(path: Path, dtype: np.dtype, offset: int, num_tokens: int) -> np.ndarray:
    if num_tokens == 0:
        return np.empty(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(num_tokens,))


def _split_parts(meta: dict[str, Any], data_dir: Path, split: str) -> Iterator[np.ndarray]:
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    lo = 0 if split == "train" else meta["num_tokens"]["train"]
    hi = lo + meta["num_tokens"][split]
    first = 0
    for record in meta["files"]:
        path, n = Path(record["path"]), record["num_tokens"]
        begin, end = max(lo - first, 0), min(hi - first, n)
        first += n
        if begin >= end:
            continue
        expected = record["offset"] + n * dtype.itemsize
        stat = path.stat() if path.is_file() else None
        found = None
        if stat is None or stat.st_size != expected:
            found = "is missing" if stat is None else f"has {stat.st_size} bytes, not {expected}"
        elif record.get("mtime_ns", stat.st_mtime_ns) != stat.st_mtime_ns:  # rewritten in place?
            digest = _content_sha256(str(path), record["offset"], expected, stat.st_mtime_ns)
            if digest != record["sha256"]:
                found = "holds other tokens (its SHA-256 differs)"
        if found is not None:
            raise ValueError(
                f"token file {path} of {data_dir} {found}: it changed since `moetrain prepare "
                "--pretokenized` indexed it; restore it or prepare the directory again"
            )
        yield map_tokens(path, dtype, record["offset"], n)[begin:end]


@functools.lru_cache(maxsize=256)
def _content_sha256(path: str, offset: int, end: int, mtime_ns: int) -> str:  # noqa: ARG001
    """SHA-256 of bytes [offset, end) of a file (its tokens), once per modification time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        for chunk in iter(lambda: f.read(min(1 << 24, end - f.tell())), b""):
            digest.update(chunk)
    return digest.hexdigest()


def open_indexed_split(
    data_dir: Path, meta: dict[str, Any], split: str, vocab_size: int | None
) -> np.ndarray | ShardedTokens:
    """One split's tokens, memory-mapped from the indexed files. Every id was checked to be
    below the corpus's vocabulary at prepare time, so a model vocabulary at least that large is
    the whole check (no scan of the corpus at every start)."""
    if vocab_size is not None and vocab_size < meta["vocab_size"]:
        raise ValueError(
            f"model.vocab_size ({vocab_size}) is smaller than the vocabulary of the "
            f"pre-tokenized corpus {data_dir} ({meta['vocab_size']}, from its meta.json); set "
            "model.vocab_size to at least that, or leave it unset (null) to take it from the data"
        )
    parts = list(_split_parts(meta, data_dir, split))
    return parts[0] if len(parts) == 1 else ShardedTokens(parts)
