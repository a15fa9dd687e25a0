"""Data: tokenizers, token directories on disk, the embedded default corpus and batch loaders.

Nothing here imports moetrain beyond `moetrain.config`; every layer above may import it. The
names below are imported on first use, so that a process that only reads and tokenizes text
(`moetrain prepare` and its worker processes) does not import torch, which the loaders need.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "cache_dir": "corpus",
    "embedded_corpus": "corpus",
    "embedded_documents": "corpus",
    "unigram_entropy": "corpus",
    "RandomTokenLoader": "loader",
    "SequenceLoader": "loader",
    "check_same_data": "loader",
    "data_fingerprint": "loader",
    "open_data": "loader",
    "resolve_data_paths": "run_paths",
    "resolve_eos_id": "loader",
    "resolve_vocab_size": "loader",
    "MixedLoader": "mix",
    "source_labels": "mix",
    "prepare": "prepare_text",
    "ByteTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "fingerprint": "tokens",
    "load_dir_tokenizer": "tokens",
    "load_split": "tokens",
    "read_meta": "tokens",
    "split_documents": "tokens",
    "write_token_dir": "tokens",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
