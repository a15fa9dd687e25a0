"""Files a config names, compared by what they hold: a tokenizer named by its tokenizer.json or
by the directory that holds one, and whether two paths hold the same bytes (a resume may name a
run's tokenizer by another path). No torch, no tokenizer library.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def tokenizer_file(spec: str | Path) -> Path:
    """The tokenizer.json a path names: the file itself, or the one in the directory."""
    path = Path(spec)
    return path / "tokenizer.json" if path.is_dir() else path


def same_files(*files: Path) -> bool:
    """Whether the files all exist and hold the same bytes (a tokenizer named by two paths)."""
    if not all(f.is_file() for f in files):
        return False
    return len({hashlib.sha256(f.read_bytes()).digest() for f in files}) == 1
