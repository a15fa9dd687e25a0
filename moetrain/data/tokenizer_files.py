"""The files a tokenizer travels as, so checkpoints and exports decode without the run's data.

Every checkpoint and Hugging Face export carries `tokenizer.json` and `tokenizer_config.json`
(and `special_tokens_map.json` when the tokenizer had one); trainer.json records
`describe(tokenizer)`. A Hugging Face tokenizer travels as its own files; for the byte tokenizer
`byte_tokenizer_json` writes an equivalent BPE without merges over the ByteLevel symbols (byte b
at id b, end of document at 256), which `transformers.AutoTokenizer` loads and which encodes
exactly to `ByteTokenizer`'s ids. `load_carried` rebuilds the tokenizer from such a directory
(the byte tokenizer without the `tokenizers` package).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moetrain.data.tokenizer import ByteTokenizer, HFTokenizer

EOS_TOKEN = "<|endoftext|>"
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def byte_symbols() -> list[str]:
    """The printable character the ByteLevel pre-tokenizer writes for each byte value: the byte
    itself when it is a visible Latin-1 character, else the next unused code point from 256 up
    (in byte order), so that no symbol is whitespace or a control character."""
    visible = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    unused = iter(range(256, 512))
    return [chr(b) if b in visible else chr(next(unused)) for b in range(256)]


def byte_tokenizer_json() -> dict[str, Any]:
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    eos = ByteTokenizer.eos_id
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": eos,
                "content": EOS_TOKEN,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {symbol: b for b, symbol in enumerate(byte_symbols())},
            "merges": [],
        },
    }


def describe(tokenizer: ByteTokenizer | HFTokenizer) -> dict[str, Any]:
    """What trainer.json records about the run's tokenizer."""
    kind = "byte" if isinstance(tokenizer, ByteTokenizer) else "hf"
    return {
        "type": kind,
        "name": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
    }


def tokenizer_files(
    tokenizer: ByteTokenizer | HFTokenizer, model_max_length: int | None = None
) -> dict[str, bytes]:
    """tokenizer.json and tokenizer_config.json (and the special-tokens map a Hugging Face
    tokenizer came with), by file name. A tokenizer_config.json is written when there is none,
    so that `AutoTokenizer.from_pretrained` finds the tokenizer class and the EOS token."""
    if isinstance(tokenizer, ByteTokenizer):
        files = {"tokenizer.json": _json_bytes(byte_tokenizer_json())}
        eos_token = EOS_TOKEN
    else:
        source = tokenizer.path.parent
        files = {n: (source / n).read_bytes() for n in CONFIG_FILES if (source / n).is_file()}
        files["tokenizer.json"] = tokenizer.path.read_bytes()  # it may have another name
        eos_token = tokenizer.token(tokenizer.eos_id)
    if "tokenizer_config.json" not in files:
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": eos_token,
        }
        if model_max_length is not None:
            config["model_max_length"] = model_max_length
        files["tokenizer_config.json"] = _json_bytes(config)
    return files


def load_carried(directory: str | Path, description: dict[str, Any]) -> ByteTokenizer | HFTokenizer:
    """The tokenizer `describe` recorded, from the files `tokenizer_files` put in `directory`."""
    directory = Path(directory)
    if description.get("type") == "byte":
        return ByteTokenizer()
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{directory} records a tokenizer but lacks its tokenizer.json")
    return HFTokenizer(path, name=description.get("name"), eos_id=description.get("eos_id"))


def _json_bytes(data: Any) -> bytes:
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode()
