"""`moetrain prepare`: its arguments, and the call of `prepare` (text) or `prepare_pretokenized`
(token files). Parsing and checking the combination of flags only; the work is in
`moetrain.data.prepare_text` and `moetrain.data.pretokenized`. Imports no torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_prepare_parser(sub: Any) -> None:
    p = sub.add_parser(
        "prepare", help="tokenize text, JSON lines, Parquet or HF datasets into a token directory"
    )
    p.add_argument(
        "files",
        nargs="*",
        help="files, directories or glob patterns: .txt (one document each, or see "
        "--split-text), .jsonl/.json (optionally .gz/.zst), .parquet, or a Hugging Face dataset "
        "saved with save_to_disk",
    )
    p.add_argument(
        "--split-text",
        choices=["file", "paragraph", "line"],
        default="file",
        help="how a .txt file is cut into documents: the whole file (default; a single document "
        "is split into train and val by tokens), each paragraph (text between blank lines), or "
        "each line",
    )
    p.add_argument(
        "--on-bad-record",
        choices=["error", "skip"],
        default="error",
        help="a malformed record (bad JSON, no string text field, non-UTF-8 text, a .gz/.zst "
        "file that cannot be decompressed to its end): stop with an error naming its file and "
        "line (default), or skip it (counted, the first few named; meta.json records the count; "
        "a cut compressed file keeps its documents before the damage)",
    )
    p.add_argument(
        "--replace-bad-bytes",
        action="store_true",
        help="read bytes that are not UTF-8 as U+FFFD instead of treating the record as bad",
    )
    p.add_argument(
        "--text-field", default="text", help="JSON field or column holding the text (default text)"
    )
    p.add_argument(
        "--hf-dataset",
        metavar="NAME",
        help="a Hugging Face dataset by name, through datasets.load_dataset (a Hub name, or a "
        "local directory of data files; needs the data extra); read after the files",
    )
    p.add_argument("--hf-config", help="--hf-dataset: its configuration (subset), if it has some")
    p.add_argument("--hf-split", help="--hf-dataset: the split to read (default train)")
    p.add_argument(
        "--workers",
        type=int,
        help="tokenizing processes (default: one per core, at most one per 8 MiB of input; "
        "1 = in this process). An interrupted prepare leaves OUT.partial; the same command "
        "resumes from it",
    )
    p.add_argument(
        "--pretokenized",
        nargs="+",
        metavar="TOKEN_FILES",
        help="index existing token files (.npy or headerless .npy/.bin memory maps; files, "
        "directories or globs) without copying them; needs --dtype, --eos-id, --vocab-size",
    )
    p.add_argument("--dtype", choices=["uint16", "uint32"], help="--pretokenized: token type")
    p.add_argument("--eos-id", type=int, help="--pretokenized: the id ending each document")
    p.add_argument("--vocab-size", type=int, help="--pretokenized: the tokenizer's vocabulary")
    p.add_argument("--out", required=True)
    p.add_argument(
        "--tokenizer",
        help="byte (the default), or a Hugging Face tokenizer.json; with --pretokenized, the "
        "tokenizer the files were made with (optional: recorded so that generate can decode)",
    )
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing token directory at --out (runs trained on it cannot resume)",
    )
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_prepare)


def cmd_prepare(args: argparse.Namespace) -> int:
    from moetrain.data import prepare
    from moetrain.data.inputs import load_named_dataset
    from moetrain.data.tokens import check_not_prepared

    if args.pretokenized:
        return _prepare_pretokenized(args)
    if not args.hf_dataset:
        unused = [f for f in ("hf_config", "hf_split") if getattr(args, f) is not None]
        if unused:
            raise ValueError(f"--{unused[0].replace('_', '-')} needs --hf-dataset NAME")
    if not args.files and not args.hf_dataset:
        raise ValueError(
            "prepare needs input files, --hf-dataset NAME (or --pretokenized TOKEN_FILES)"
        )
    inputs = list(args.files)
    if args.hf_dataset:
        check_not_prepared(Path(args.out), args.overwrite)  # before a download, not after
        inputs.append(load_named_dataset(args.hf_dataset, args.hf_config, args.hf_split or "train"))
    out = prepare(
        inputs,
        args.out,
        tokenizer=args.tokenizer or "byte",
        val_fraction=args.val_fraction,
        progress=not args.quiet,
        overwrite=args.overwrite,
        text_field=args.text_field,
        workers=args.workers,
        split_text=args.split_text,
        on_bad_record=args.on_bad_record,
        replace_bad_bytes=args.replace_bad_bytes,
    )
    print(f"wrote {out}")
    return 0


# prepare's options that only text inputs take, with their defaults
_TEXT_ONLY = {
    "text_field": "text",
    "workers": None,
    "hf_dataset": None,
    "hf_config": None,
    "hf_split": None,
    "split_text": "file",
    "on_bad_record": "error",
    "replace_bad_bytes": False,
}


def _prepare_pretokenized(args: argparse.Namespace) -> int:
    from moetrain.data.pretokenized import prepare_pretokenized

    if args.files:
        raise ValueError(
            f"prepare: give text inputs ({' '.join(args.files)}) or --pretokenized token files, "
            "not both"
        )
    needed = ("dtype", "eos_id", "vocab_size")
    missing = ["--" + n.replace("_", "-") for n in needed if getattr(args, n) is None]
    if missing:
        raise ValueError(f"prepare --pretokenized needs {', '.join(missing)}")
    given = [f"--{f.replace('_', '-')}" for f, v in _TEXT_ONLY.items() if getattr(args, f) != v]
    if given:
        raise ValueError(f"{', '.join(given)} does not apply to --pretokenized")
    out = prepare_pretokenized(
        args.pretokenized,
        args.out,
        dtype=args.dtype,
        eos_id=args.eos_id,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        overwrite=args.overwrite,
        tokenizer=args.tokenizer,
    )
    print(f"wrote {out} (an index of the token files; they are not copied)")
    return 0
