"""Tokenizers: text to token ids and back.

Two implementations share one small duck-typed interface (`name`, `vocab_size`, `eos_id`,
`encode`, `encode_array`, `decode`): `ByteTokenizer` (the UTF-8 bytes of the text; always
available) and `HFTokenizer` (a Hugging Face `tokenizer.json`; needs the optional `tokenizers`
package, imported only when one is built). Invariants: `encode` never adds special tokens (the
token writer separates documents with `eos_id` itself), every id lies in [0, vocab_size), and
`eos_id` is an id of the vocabulary. `load_tokenizer(spec)` turns the config string (``"byte"``
or a path) into a tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from moetrain.config.files import tokenizer_file

# Token names tried, in order, when the tokenizer does not say which token ends a sequence.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[EOS]")


def _as_int64(ids: Iterable[int]) -> np.ndarray:
    if hasattr(ids, "cpu"):  # a torch tensor, possibly on a GPU; this module does not import torch
        ids = ids.cpu()
    return np.asarray(ids, dtype=np.int64).ravel()


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text; id 256 ends a document."""

    name = "byte"
    eos_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """`encode` as a uint8 array, without a Python int per byte (the fast path for corpora)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        ids = _as_int64(ids)
        data = ids[(ids >= 0) & (ids < 256)].astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a tokenizer.json file.

    The end-of-sequence token is, in order: `eos_id` if given; the ``eos_token`` of a
    tokenizer_config.json next to the file; the first of `EOS_CANDIDATES` in the vocabulary.
    """

    def __init__(self, path: str | Path, *, name: str | None = None, eos_id: int | None = None):
        path = Path(path)
        if not path.is_file():
            raise ValueError(
                f"tokenizer file {path} does not exist; expected 'byte' or the path of a "
                "Hugging Face tokenizer.json"
            )
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError(
                f"tokenizer {path} needs the optional `tokenizers` package: install tokenizers "
                "(pip install tokenizers) or use tokenizer 'byte'"
            ) from None
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises its own exception type
            raise ValueError(f"tokenizer file {path} could not be loaded: {exc}") from None
        self.path = path
        self.name = name if name is not None else str(path)
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        if not vocab:
            raise ValueError(f"tokenizer file {path} has an empty vocabulary")
        # Ids need not be dense, so the size is the largest id + 1, not len(vocab).
        self.vocab_size = max(vocab.values()) + 1
        self.eos_id = self._find_eos() if eos_id is None else int(eos_id)
        if not 0 <= self.eos_id < self.vocab_size:
            raise ValueError(
                f"eos id {self.eos_id} of tokenizer {path} is outside its vocabulary "
                f"[0, {self.vocab_size})"
            )

    def _find_eos(self) -> int:
        names = list(EOS_CANDIDATES)
        config = self.path.with_name("tokenizer_config.json")
        if config.is_file():
            try:
                token = json.loads(config.read_text()).get("eos_token")
            except (ValueError, AttributeError):
                token = None
            if isinstance(token, dict):
                token = token.get("content")
            if isinstance(token, str):
                names.insert(0, token)
        for token in names:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return token_id
        raise ValueError(
            f"tokenizer {self.path} has no end-of-sequence token: none of {', '.join(names)} is "
            "in its vocabulary (add one, or set eos_token in a tokenizer_config.json next to it)"
        )

    def token(self, token_id: int) -> str | None:
        """The string of a token id (None for an id without one)."""
        return self._tokenizer.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(_as_int64(ids).tolist(), skip_special_tokens=True)


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """``"byte"``, a tokenizer.json path, or a directory that holds a tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(tokenizer_file(spec), name=spec)
