"""Data: tokenizers, token directories on disk, the embedded default corpus and batch loaders.

Nothing here imports moetrain beyond `moetrain.config`; every layer above may import it.
"""

from moetrain.data.corpus import cache_dir, embedded_corpus, embedded_documents, unigram_entropy
from moetrain.data.loader import (
    RandomTokenLoader,
    SequenceLoader,
    check_same_data,
    data_fingerprint,
    open_data,
    resolve_eos_id,
    resolve_vocab_size,
)
from moetrain.data.mix import MixedLoader, source_labels
from moetrain.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from moetrain.data.tokens import (
    fingerprint,
    load_dir_tokenizer,
    load_split,
    prepare,
    read_meta,
    split_documents,
    write_token_dir,
)

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "MixedLoader",
    "RandomTokenLoader",
    "SequenceLoader",
    "Tokenizer",
    "cache_dir",
    "check_same_data",
    "data_fingerprint",
    "embedded_corpus",
    "embedded_documents",
    "fingerprint",
    "load_dir_tokenizer",
    "load_split",
    "load_tokenizer",
    "open_data",
    "prepare",
    "read_meta",
    "resolve_eos_id",
    "resolve_vocab_size",
    "source_labels",
    "split_documents",
    "unigram_entropy",
    "write_token_dir",
]
