"""Token directories: the on-disk format of tokenized text, how to write one and how to read it.

A token directory holds ``train.npy`` and ``val.npy`` (flat token ids, uint16 when the
vocabulary fits, else uint32; every document followed by the EOS id), ``meta.json`` (format,
version, tokenizer, vocab_size, eos_id, dtype, per-split token and document counts and SHA-256)
and, for a Hugging Face tokenizer, a copy of its ``tokenizer.json``. Invariants: a directory is
built in a temporary sibling and renamed into place, never left partial; both splits hold a
document; readers memory-map the arrays and check them against meta.json (a `ValueError` naming
the file). A pre-tokenized corpus (data/pretokenized.py) lists the user's files in meta.json
instead; `load_split` reads either kind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike

from moetrain.data.sharded_tokens import open_indexed_split
from moetrain.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

FORMAT = "moetrain-tokens"
VERSION = 1
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def check_val_fraction(val_fraction: float) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction ({val_fraction!r}) must be in (0, 1)")


def split_documents(
    docs: Iterable[ArrayLike], val_fraction: float
) -> Iterator[tuple[str, ArrayLike]]:
    """Label each document "train" or "val", deterministically, without reading ahead: document
    i is held out when floor((i + 1) * f) > floor(i * f) (every 20th for f = 0.05); when that
    holds out nothing the last document goes to val; a single document is split by tokens, its
    last max(1, round(f * length)) tokens val."""
    check_val_fraction(val_fraction)
    pending = None  # the latest train document, held back in case val ends up empty
    num_val = num_train = 0
    for i, ids in enumerate(docs):
        if int((i + 1) * val_fraction) > int(i * val_fraction):
            num_val += 1
            yield "val", ids
            continue
        if pending is not None:
            num_train += 1
            yield "train", pending
        pending = ids
    if pending is None:
        return
    if num_val or num_train:
        yield ("val" if num_val == 0 else "train"), pending
        return
    cut = len(pending) - max(1, round(len(pending) * val_fraction))
    if cut > 0:
        yield "train", pending[:cut]
    yield "val", pending[cut:]


def check_not_prepared(out: Path, overwrite: bool) -> None:
    """Before any work: `out` must be absent, an empty directory, or (with `overwrite`) a token
    directory; anything else is refused now, not after hours of tokenizing."""
    if not overwrite and (out / "meta.json").is_file():
        raise ValueError(
            f"output directory {out} is not empty: it holds a token directory, and runs trained "
            "on it could not resume on other tokens; choose another --out, or pass --overwrite "
            "to replace it"
        )
    _check_destination(out)


def write_token_dir(
    out_dir: str | Path,
    documents: Iterable[tuple[str, ArrayLike]],
    tokenizer: ByteTokenizer | HFTokenizer,
    *,
    if_exists: Literal["replace", "keep"] = "replace",
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write ("train" | "val", token ids) documents as a token directory, atomically; `meta`
    adds fields to its meta.json. An existing token (or empty) directory at `out_dir` is
    replaced, or with ``if_exists="keep"`` kept (a concurrent builder's wins); anything else
    there is an error."""
    out_dir = Path(out_dir)
    if _check_destination(out_dir) and if_exists == "keep":
        return out_dir
    return install_token_dir(
        out_dir,
        lambda tmp: {**_write_splits(tmp, documents, tokenizer), **(meta or {})},
        tokenizer,
        if_exists,
    )


def install_token_dir(
    out_dir: Path,
    write: Callable[[Path], dict[str, Any]],
    tokenizer: ByteTokenizer | HFTokenizer | None,
    if_exists: Literal["replace", "keep"] = "replace",
) -> Path:
    """Build a token directory atomically: `write(tmp)` fills a fresh sibling directory and
    returns its meta; the tokenizer's file and meta.json go beside it; then it is renamed into
    place (`_install`). On any error the partial directory is removed and nothing is left."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{uuid.uuid4().hex}")
    tmp.mkdir()  # not tempfile.mkdtemp: its mode 0700 would end up on the finished directory
    try:
        meta = write(tmp)
        if isinstance(tokenizer, HFTokenizer):
            shutil.copyfile(tokenizer.path, tmp / "tokenizer.json")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        _install(tmp, out_dir, if_exists)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _check_destination(out_dir: Path) -> bool:
    """True when `out_dir` is an existing token directory; an error when it is something else."""
    if not out_dir.exists():
        return False
    if not out_dir.is_dir():
        raise ValueError(f"output {out_dir} exists and is not a directory")
    if (out_dir / "meta.json").is_file():
        read_meta(out_dir)  # raises when it is some other program's directory
        return True
    if any(out_dir.iterdir()):
        raise ValueError(
            f"output directory {out_dir} is not empty and is not a moetrain token directory; "
            "refusing to overwrite it"
        )
    return False


def _write_splits(
    tmp: Path, documents: Iterable[tuple[str, ArrayLike]], tokenizer: ByteTokenizer | HFTokenizer
) -> dict[str, Any]:
    # Tokens stream into raw files first because the .npy header needs the final length.
    dtype = token_dtype(tokenizer.vocab_size).newbyteorder("<")
    eos = np.array([tokenizer.eos_id], dtype=dtype).tobytes()
    num_tokens = dict.fromkeys(SPLITS, 0)
    num_documents = dict.fromkeys(SPLITS, 0)
    digests = {s: hashlib.sha256() for s in SPLITS}
    with contextlib.ExitStack() as stack:
        raw = {s: stack.enter_context(open(tmp / f"{s}.bin", "wb")) for s in SPLITS}
        for split, ids in documents:
            if split not in SPLITS:
                raise ValueError(f"document split {split!r} must be one of {', '.join(SPLITS)}")
            ids = np.asarray(ids)
            if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
                raise ValueError(f"a document must be a 1-D sequence of int ids, got {ids.dtype}")
            if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
                bad = ids.max() if ids.max() >= tokenizer.vocab_size else ids.min()
                raise ValueError(
                    f"token id {bad} is outside the vocabulary of tokenizer {tokenizer.name} "
                    f"[0, {tokenizer.vocab_size})"
                )
            data = ids.astype(dtype).tobytes()
            raw[split].write(data)
            raw[split].write(eos)
            digests[split].update(data)
            digests[split].update(eos)
            num_tokens[split] += ids.size + 1
            num_documents[split] += 1
    for split in SPLITS:
        if num_documents[split] == 0:
            raise ValueError(
                f"the {split} split would be empty ({num_documents['train']} train and "
                f"{num_documents['val']} val documents); give more documents or change val_fraction"
            )
    for split in SPLITS:
        _raw_to_npy(tmp / f"{split}.bin", tmp / f"{split}.npy", dtype, num_tokens[split])
    return {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "dtype": dtype.name,
        "num_tokens": num_tokens,
        "num_documents": num_documents,
        "sha256": {s: d.hexdigest() for s, d in digests.items()},
    }


def _raw_to_npy(raw: Path, npy: Path, dtype: np.dtype, length: int) -> None:
    header = {"descr": dtype.str, "fortran_order": False, "shape": (length,)}
    with open(raw, "rb") as src, open(npy, "wb") as dst:
        np.lib.format.write_array_header_1_0(dst, header)
        shutil.copyfileobj(src, dst, 16 << 20)
        dst.flush()
        os.fsync(dst.fileno())
    raw.unlink()


def _install(tmp: Path, out_dir: Path, if_exists: str) -> None:
    try:
        os.replace(tmp, out_dir)  # succeeds when out_dir is absent or an empty directory
        return
    except OSError:
        if not out_dir.is_dir():
            raise
    if if_exists == "keep":  # another builder finished first: use its directory
        shutil.rmtree(tmp, ignore_errors=True)
        return
    # Directories cannot be swapped in one rename; out_dir is briefly absent, never partial.
    old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex}")
    os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def read_meta(data_dir: str | Path) -> dict[str, Any]:
    data_dir = Path(data_dir)
    if data_dir.is_file():
        raise ValueError(
            f"{data_dir} is a file, not a token directory; make one of it with `moetrain "
            f"prepare {data_dir} --out DIR` and give DIR"
        )
    if not data_dir.is_dir():
        raise ValueError(
            f"token directory {data_dir} does not exist; create it with `moetrain prepare`"
        )
    path = data_dir / "meta.json"
    if not path.is_file():
        raise ValueError(
            f"{path} is missing: {data_dir} is not a moetrain token directory "
            "(create one with `moetrain prepare`)"
        )
    try:
        meta = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    found = (meta.get("format"), meta.get("version")) if isinstance(meta, dict) else None
    if found != (FORMAT, VERSION):
        raise ValueError(f"{path} has (format, version) {found}; expected {(FORMAT, VERSION)}")
    keys = ("tokenizer", "vocab_size", "eos_id", "dtype", "num_tokens", "num_documents")
    missing = [k for k in keys if k not in meta]
    if missing:
        raise ValueError(f"{path} lacks the field(s) {', '.join(missing)}")
    if meta["dtype"] not in ("uint16", "uint32"):
        raise ValueError(f"{path} has dtype {meta['dtype']!r}; expected uint16 or uint32")
    return meta


def load_split(data_dir: str | Path, split: str, vocab_size: int | None = None) -> np.ndarray:
    """Memory-map one split, checked against meta.json (and against `vocab_size` when given)."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} must be one of {', '.join(SPLITS)}")
    meta = read_meta(data_dir)
    if "files" in meta:  # a pre-tokenized corpus: the tokens are in the user's files
        return open_indexed_split(Path(data_dir), meta, split, vocab_size)
    path = Path(data_dir) / f"{split}.npy"
    if not path.is_file():
        raise ValueError(f"{path} is missing; prepare the directory again")
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as exc:  # numpy raises ValueError, OSError or EOFError depending on the damage
        raise ValueError(f"{path} is truncated or corrupt ({exc}); prepare it again") from None
    expected_dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    if tokens.dtype != expected_dtype:
        raise ValueError(
            f"{path} holds {tokens.dtype} values but meta.json says {meta['dtype']}; "
            "the file was not written by moetrain prepare"
        )
    expected_len = meta["num_tokens"].get(split)
    if tokens.ndim != 1 or tokens.shape[0] != expected_len:
        raise ValueError(
            f"{path} has shape {tokens.shape} but meta.json says {expected_len} tokens; "
            "the file is truncated or corrupt"
        )
    if vocab_size is not None and tokens.size:
        top = int(tokens.max())
        if top >= vocab_size:
            raise ValueError(
                f"token id {top} in {path} is >= model.vocab_size ({vocab_size}); its tokenizer "
                f"has {meta['vocab_size']} ids: set model.vocab_size to at least that, or leave "
                "it unset (null) to take it from the tokenizer"
            )
    return tokens


def load_dir_tokenizer(data_dir: str | Path) -> ByteTokenizer | HFTokenizer | None:
    """The tokenizer a token directory was written with (its own copy for Hugging Face ones);
    None for a pre-tokenized corpus, which records none."""
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    if meta["tokenizer"] is None:
        return None
    copy = data_dir / "tokenizer.json"
    if meta["tokenizer"] != "byte" and copy.is_file():
        tokenizer = HFTokenizer(copy, name=meta["tokenizer"], eos_id=meta["eos_id"])
    else:
        tokenizer = load_tokenizer(meta["tokenizer"])
    if (tokenizer.vocab_size, tokenizer.eos_id) != (meta["vocab_size"], meta["eos_id"]):
        raise ValueError(
            f"tokenizer {meta['tokenizer']} has vocab_size {tokenizer.vocab_size} and eos_id "
            f"{tokenizer.eos_id}, but {data_dir / 'meta.json'} records {meta['vocab_size']} and "
            f"{meta['eos_id']}; the tokenizer changed after the data was prepared"
        )
    return tokenizer


_SAMPLE_BYTES = 1 << 16
_SAMPLES = 16


def fingerprint(data_dir: str | Path) -> str:
    """A short hash naming a token directory's content, cheap at any size (every resume takes
    it): a hash of meta.json's per-split SHA-256 and sizes. Directories from before meta.json held
    hashes get a sampled hash (sizes and `_SAMPLES` 64 KiB blocks, first and last included).
    Arrays rewritten behind meta.json's back are caught by `load_split`'s checks, not here."""
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    digest = hashlib.sha256()
    digest.update(json.dumps([meta["dtype"], meta["num_tokens"]], sort_keys=True).encode())
    if "files" in meta:  # pre-tokenized: prepare hashed each file it indexed
        digest.update(json.dumps([f["sha256"] for f in meta["files"]]).encode())
        return digest.hexdigest()[:16]
    recorded = meta.get("sha256")
    if isinstance(recorded, dict) and all(isinstance(recorded.get(s), str) for s in SPLITS):
        digest.update(json.dumps([recorded[s] for s in SPLITS]).encode())
        return digest.hexdigest()[:16]
    for split in SPLITS:
        path = data_dir / f"{split}.npy"
        size = path.stat().st_size
        digest.update(str(size).encode())
        with open(path, "rb") as f:
            step = max(size - _SAMPLE_BYTES, 0) / max(_SAMPLES - 1, 1)
            for i in range(_SAMPLES):
                f.seek(int(i * step))
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:16]
