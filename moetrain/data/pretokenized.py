"""Pre-tokenized corpora: token directories whose tokens stay in the user's own files.

OLMo-core, Dolma-derived and Megatron-style corpora are flat arrays of token ids, uint16 or
uint32, documents separated by a known EOS id, stored as headerless memory maps (``.npy`` or
``.bin`` names; OLMo-core's ``.npy`` files carry no header) or as real ``.npy`` arrays.
`prepare_pretokenized` checks such files once (every id below the stated vocabulary, the EOS id
in it) and writes a token directory holding only ``meta.json`` (and the tokenizer's
``tokenizer.json`` when one is named): the files (absolute path, byte offset of the first token,
token count, SHA-256 of the token bytes, modification time), vocabulary size, EOS id, dtype, and
per-split token and document counts. The tokens are never copied. The files, in
sorted order, form one stream; train is its head and val its tail from a document boundary near
(1 - val_fraction) of the tokens. `open_split` memory-maps the files back: one array when the
split lies in one file, else a `ShardedTokens` view that gathers across files. Invariants: the
directory is written atomically like any token directory; a file whose size changed since
prepare is a `ValueError` at start-up, and so is one whose modification time changed and whose
tokens no longer hash to the recorded SHA-256 (a file rewritten in place; a file only touched or
copied is hashed again at every start, until prepared again); a model vocabulary smaller than the
corpus's is one too.
"""

from __future__ import annotations

import functools
import glob
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from moetrain.data.tokenizer import load_tokenizer
from moetrain.data.tokens import (
    FORMAT,
    VERSION,
    _check_destination,
    check_not_prepared,
    check_val_fraction,
    install_token_dir,
)

SUFFIXES = (".npy", ".bin")
DTYPES = ("uint16", "uint32")
_CHUNK = 1 << 24  # tokens scanned at a time: bounded memory for corpora of any size


class ShardedTokens:
    """A read-only 1-D array of tokens that lie in several arrays end to end, never copied.

    It offers what `SequenceLoader` and the checks use: ``len``, ``ndim``, ``shape``, ``dtype``,
    ``max()``, slices, and gathers with integer index arrays of any shape.
    """

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


def _expand(inputs: list[str | Path]) -> list[Path]:
    files: list[Path] = []
    for spec in inputs:
        path = Path(spec)
        if glob.has_magic(str(spec)) and not path.exists():
            found = [Path(p) for p in sorted(glob.glob(str(spec), recursive=True))]
            found = [p for p in found if p.is_file() and p.suffix in SUFFIXES]
            if not found:
                raise ValueError(f"the pattern {spec} matches no .npy or .bin token file")
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
            if not found:
                raise ValueError(f"input directory {path} holds no .npy or .bin token file")
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise ValueError(
                    f"token file {path} has an unsupported type; expected .npy or .bin"
                )
            found = [path]
        else:
            raise ValueError(f"input file {path} does not exist")
        files.extend(p.resolve() for p in found)
    return list(dict.fromkeys(files))


def _layout(path: Path, dtype: np.dtype) -> tuple[int, int]:
    """(byte offset of the first token, number of tokens) of a real or headerless .npy/.bin."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(6) == b"\x93NUMPY":
            f.seek(0)
            try:
                version = np.lib.format.read_magic(f)
                read_header = (
                    np.lib.format.read_array_header_1_0
                    if version == (1, 0)
                    else np.lib.format.read_array_header_2_0
                )
                shape, _, found = read_header(f)
            except ValueError as exc:
                raise ValueError(f"{path} has a damaged .npy header ({exc})") from None
            if found != dtype or len(shape) != 1:
                raise ValueError(
                    f"{path} holds a {found} array of shape {shape}; expected a 1-D "
                    f"little-endian {dtype.name} array as --dtype says"
                )
            offset = f.tell()
            if size - offset != shape[0] * dtype.itemsize:
                raise ValueError(f"{path} is truncated: its header says {shape[0]} tokens")
            return offset, shape[0]
    if size % dtype.itemsize:
        raise ValueError(
            f"{path} has {size} bytes, not a whole number of {dtype.name} tokens; check --dtype"
        )
    return 0, size // dtype.itemsize


def _map(path: Path, dtype: np.dtype, offset: int, num_tokens: int) -> np.ndarray:
    if num_tokens == 0:
        return np.empty(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(num_tokens,))


def _scan(path: Path, tokens: np.ndarray, vocab_size: int, eos_id: int) -> tuple[int, str]:
    """(number of EOS tokens, SHA-256 of the token bytes); an id >= vocab_size is an error."""
    digest = hashlib.sha256()
    num_eos = 0
    for start in range(0, len(tokens), _CHUNK):
        chunk = np.asarray(tokens[start : start + _CHUNK])
        top = int(chunk.max())
        if top >= vocab_size:
            at = start + int(np.argmax(chunk >= vocab_size))
            raise ValueError(
                f"{path}: token {at} is id {top}, outside the vocabulary [0, {vocab_size}) "
                "that --vocab-size states; check --vocab-size and --dtype"
            )
        num_eos += int(np.count_nonzero(chunk == eos_id))
        digest.update(chunk.tobytes())
    return num_eos, digest.hexdigest()


def _eos_after(stream: ShardedTokens, start: int, eos_id: int) -> int | None:
    for lo in range(start, len(stream), _CHUNK):
        hits = np.flatnonzero(stream[lo : lo + _CHUNK] == eos_id)
        if hits.size:
            return lo + int(hits[0])
    return None


def _eos_before(stream: ShardedTokens, stop: int, eos_id: int) -> int | None:
    for hi in range(stop, 0, -_CHUNK):
        hits = np.flatnonzero(stream[max(hi - _CHUNK, 0) : hi] == eos_id)
        if hits.size:
            return max(hi - _CHUNK, 0) + int(hits[-1])
    return None


def _val_start(stream: ShardedTokens, val_fraction: float, eos_id: int) -> int:
    """The first token of val: just after the EOS at or after (1 - val_fraction) of the stream,
    else after the last EOS before it; the split is an error when either side would be empty."""
    target = max(int(len(stream) * (1 - val_fraction)) - 1, 0)
    for eos in (_eos_after(stream, target, eos_id), _eos_before(stream, target, eos_id)):
        if eos is not None and eos + 1 < len(stream):
            return eos + 1
    raise ValueError(
        f"cannot hold out a validation split: the {len(stream)} tokens have no EOS (id "
        f"{eos_id}) before their last document; check --eos-id, or give more documents"
    )


def prepare_pretokenized(
    inputs: list[str | Path],
    out_dir: str | Path,
    *,
    dtype: str,
    eos_id: int,
    vocab_size: int,
    val_fraction: float = 0.05,
    overwrite: bool = False,
    tokenizer: str | None = None,
) -> Path:
    """Index existing token files as a token directory at `out_dir`, without copying them.

    `tokenizer` (optional: "byte" or a Hugging Face tokenizer.json) is the one the files were
    made with; it must have this vocabulary size and EOS id, and it is recorded (and copied) so
    that checkpoints carry it and `moetrain generate` can decode. Without it the corpus trains
    and evaluates, but nothing can turn ids back into text.
    """
    out = Path(out_dir)
    check_not_prepared(out, overwrite)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype ({dtype!r}) must be one of {', '.join(DTYPES)}")
    if vocab_size <= 0 or vocab_size > np.iinfo(dtype).max + 1:
        raise ValueError(f"--vocab-size ({vocab_size}) must be in [1, {np.iinfo(dtype).max + 1}]")
    if not 0 <= eos_id < vocab_size:
        raise ValueError(f"--eos-id ({eos_id}) must be in [0, --vocab-size ({vocab_size}))")
    check_val_fraction(val_fraction)
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    if tok is not None and (tok.vocab_size, tok.eos_id) != (vocab_size, eos_id):
        raise ValueError(
            f"tokenizer {tokenizer} has vocab_size {tok.vocab_size} and eos_id {tok.eos_id}, "
            f"but --vocab-size {vocab_size} and --eos-id {eos_id} were given; they must agree"
        )
    if not inputs:
        raise ValueError("prepare --pretokenized needs at least one token file")
    token_dtype = np.dtype(dtype).newbyteorder("<")
    files, parts, num_eos = [], [], 0
    for path in _expand(inputs):
        mtime_ns = path.stat().st_mtime_ns  # before reading: a write during the scan shows later
        offset, num_tokens = _layout(path, token_dtype)
        tokens = _map(path, token_dtype, offset, num_tokens)
        file_eos, sha = _scan(path, tokens, vocab_size, eos_id)
        num_eos += file_eos
        entry = {"path": str(path), "offset": offset, "num_tokens": num_tokens, "sha256": sha}
        files.append({**entry, "mtime_ns": mtime_ns})
        parts.append(tokens)
    stream = ShardedTokens(parts)
    val_start = _val_start(stream, val_fraction, eos_id)
    val_eos = sum(
        int(np.count_nonzero(stream[lo : min(lo + _CHUNK, len(stream))] == eos_id))
        for lo in range(val_start, len(stream), _CHUNK)
    )
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": tok.name if tok is not None else None,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "dtype": token_dtype.name,
        "num_tokens": {"train": val_start, "val": len(stream) - val_start},
        "num_documents": {"train": num_eos - val_eos, "val": val_eos},
        "files": files,
    }
    _check_destination(out)
    return install_token_dir(out, lambda tmp: meta, tok)


def is_pretokenized(meta: dict[str, Any]) -> bool:
    return "files" in meta


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
        yield _map(path, dtype, record["offset"], n)[begin:end]


@functools.lru_cache(maxsize=256)
def _content_sha256(path: str, offset: int, end: int, mtime_ns: int) -> str:  # noqa: ARG001
    """SHA-256 of bytes [offset, end) of a file (its tokens), once per modification time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        for chunk in iter(lambda: f.read(min(1 << 24, end - f.tell())), b""):
            digest.update(chunk)
    return digest.hexdigest()


def open_split(
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
