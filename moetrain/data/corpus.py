"""The embedded default corpus: English and Python text that every Python installation carries.

With no data path configured, training uses `pydoc_data.topics` and the source files of a fixed
list of pure-Python standard-library modules (about 8 MB, never downloaded). Invariants:
`embedded_documents()` is deterministic for a given installation (everything sorted; missing,
frozen or built-in modules skipped); the token directory is built once per (builder version,
tokenizer, val_fraction, Python version, source file list) under `cache_dir()`, atomically.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np

from moetrain.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from moetrain.data.tokens import check_val_fraction, split_documents, write_token_dir

BUILDER_VERSION = 1

# Pure-Python modules and packages present from Python 3.11 on (none removed by PEP 594).
MODULES = tuple(
    """
    argparse ast asyncio base64 bdb bisect bz2 cProfile calendar cmd code codeop collections
    colorsys compileall concurrent configparser contextlib contextvars copy copyreg csv ctypes
    curses dataclasses datetime dbm decimal difflib dis doctest email enum filecmp fileinput
    fnmatch fractions ftplib functools getopt getpass gettext glob graphlib gzip hashlib heapq hmac
    html http imaplib importlib inspect ipaddress json keyword linecache locale logging lzma
    mailbox mimetypes modulefinder multiprocessing netrc nturl2path numbers opcode operator
    optparse pathlib pdb pickle pickletools pkgutil platform plistlib poplib pprint profile pstats
    pty py_compile pyclbr pydoc queue quopri random re reprlib rlcompleter sched secrets selectors
    shelve shlex shutil signal smtplib socket socketserver sqlite3 ssl statistics string stringprep
    struct subprocess symtable sysconfig tabnanny tarfile tempfile textwrap threading timeit
    tkinter token tokenize tomllib trace traceback tracemalloc tty turtle types typing unittest
    urllib uuid venv warnings wave weakref webbrowser wsgiref xml xmlrpc zipapp zipfile zoneinfo
    """.split()
)
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


def cache_dir() -> Path:
    """$MOETRAIN_CACHE, else ~/.cache/moetrain."""
    env = os.environ.get("MOETRAIN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "moetrain"


def _source_files() -> list[Path]:
    files: list[Path] = []
    for name in MODULES:
        try:
            spec = importlib.util.find_spec(name)  # a top-level name is found, not imported
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue  # missing, frozen or built in
        origin = Path(spec.origin)
        if not origin.is_file():
            continue
        if spec.submodule_search_locations is None:
            files.append(origin)
            continue
        root = origin.parent
        package = [p for p in root.rglob("*.py") if not _TEST_DIRS & set(p.relative_to(root).parts)]
        files.extend(sorted(package))
    return files


def _help_topics() -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions ship the standard library without it
        return []
    return [topics[key] for key in sorted(topics)]


def embedded_documents() -> list[str]:
    """The help topics (sorted by name), then one document per module source file."""
    docs = _help_topics()
    docs.extend(path.read_text(encoding="utf-8", errors="replace") for path in _source_files())
    return docs


def _corpus_key(tok: ByteTokenizer | HFTokenizer, tokenizer: str, val_fraction: float) -> str:
    tokenizer_hash = (
        hashlib.sha256(tok.path.read_bytes()).hexdigest() if isinstance(tok, HFTokenizer) else ""
    )
    # File names and sizes stand in for the sources: cheap, and they change with the installation.
    sources = [(str(p), p.stat().st_size) for p in _source_files()]
    parts = [BUILDER_VERSION, tokenizer, tokenizer_hash, val_fraction, sys.version, sources]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def embedded_corpus(tokenizer: str = "byte", val_fraction: float = 0.05) -> Path:
    """The token directory of the embedded corpus, built on first use and cached."""
    check_val_fraction(val_fraction)
    tok = load_tokenizer(tokenizer)
    out_dir = cache_dir() / f"corpus-{_corpus_key(tok, tokenizer, val_fraction)}"
    if (out_dir / "meta.json").is_file():
        return out_dir
    docs = (tok.encode_array(text) for text in embedded_documents())
    return write_token_dir(out_dir, split_documents(docs, val_fraction), tok, if_exists="keep")


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats per token of the empirical unigram distribution of `tokens`: the loss of
    a model that knows only token frequencies."""
    tokens = np.asarray(tokens).ravel()
    if tokens.size == 0:
        raise ValueError("unigram_entropy needs at least one token, got an empty array")
    counts = np.bincount(tokens)
    p = counts[counts > 0] / tokens.size
    return float(-(p * np.log(p)).sum())
