"""Pre-tokenized corpora: token directories whose tokens stay in the user's own files.

OLMo-core, Dolma-derived and Megatron-style corpora are flat uint16 or uint32 token arrays,
documents separated by an EOS id, as headerless memory maps (``.npy`` or ``.bin``) or real
``.npy`` arrays. `prepare_pretokenized` checks the files once (every id below the vocabulary; on
a sample, that dtype and EOS id look right, else an error naming the likely fix) and atomically
writes a token directory holding only ``meta.json`` (and a named tokenizer's file): each file's
absolute path, first token's byte offset, token count, SHA-256 and modification time, and the
usual vocabulary and split fields. The tokens are never copied: the sorted files form one
stream, train its head and val its tail from a document boundary near (1 - val_fraction).
data/sharded_tokens.py maps them back.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from moetrain.data.inputs import expand_paths
from moetrain.data.sharded_tokens import ShardedTokens, map_tokens
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
_SAMPLE = 1 << 20  # tokens of each file whose dtype and document lengths are judged
_MIN_MEAN_DOCUMENT = 4  # tokens: real corpora's documents are hundreds long on average


def _expand(inputs: list[str | Path]) -> list[Path]:
    known = lambda p: p.is_file() and p.suffix in SUFFIXES  # noqa: E731
    walk = lambda d: sorted(filter(known, d.rglob("*")))  # noqa: E731
    found = [
        expand_paths(s, known, walk, ".npy or .bin token file", ".npy or .bin") for s in inputs
    ]
    return list(dict.fromkeys(p.resolve() for paths in found for p in paths))


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


def _check_plausible(path: Path, tokens: np.ndarray, vocab_size: int, eos_id: int) -> None:
    """On the first `_SAMPLE` tokens: a clear error when the ids look like another dtype's or
    the EOS id gives documents of implausible lengths (the usual sign of a wrong --dtype or
    --eos-id, which the vocabulary check alone lets through)."""
    sample = np.asarray(tokens[:_SAMPLE])
    if sample.size < 16:
        return
    if sample.dtype == np.uint16 and sample.size % 2 == 0:
        # little-endian uint32 ids below 65536 read as uint16: every second value is 0
        if not np.count_nonzero(sample[1::2]) and np.count_nonzero(sample[0::2]):
            raise ValueError(
                f"{path}: every second uint16 value is 0, as when uint32 ids are read as "
                "uint16; the file is likely --dtype uint32"
            )
    if sample.dtype == np.uint32 and sample.max() >= vocab_size:
        if sample.view(np.uint16).max() < vocab_size:
            raise ValueError(
                f"{path}: read as uint32 its ids exceed --vocab-size ({vocab_size}), read as "
                "uint16 they do not; the file is likely --dtype uint16"
            )
    num_eos = int(np.count_nonzero(sample == eos_id))
    where = f"the first {sample.size:,} tokens of {path}"
    if num_eos == 0 and sample.size == _SAMPLE:
        raise ValueError(
            f"the EOS id ({eos_id}) never occurs in {where}; documents that long are unlikely: "
            "check --eos-id (and --dtype)"
        )
    if num_eos and sample.size / num_eos < _MIN_MEAN_DOCUMENT:
        raise ValueError(
            f"the EOS id ({eos_id}) ends a document every {sample.size / num_eos:.1f} tokens "
            f"in {where}: documents that short are implausible; check --eos-id and --dtype"
        )


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
    `tokenizer` (optional: "byte" or a tokenizer.json) is the one the files were made with, of
    this vocabulary size and EOS id; it is recorded so checkpoints carry it (without one, nothing
    can decode the ids)."""
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
        tokens = map_tokens(path, token_dtype, offset, num_tokens)
        _check_plausible(path, tokens, vocab_size, eos_id)
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
        "val_fraction": val_fraction,
    }
    _check_destination(out)
    return install_token_dir(out, lambda tmp: meta, tok)
