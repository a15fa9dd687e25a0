"""`moetrain prepare` of text: documents from files and datasets into a token directory.

Three steps. Plan: the inputs become sources (`inputs.expand_inputs`) and the sources units of
work (`parallel_tokenize.plan_units`). Tokenize: worker processes tokenize the units into the work
directory ``<out>.partial`` next to the output, which a killed or failed run leaves behind with
its finished units, so that the same command resumes. Assemble: the units' documents, in input
order, are split into train and val by `tokens.split_documents` and written as a token directory,
atomically (`tokens.write_token_dir`); then the work directory is removed. The token directory is
bitwise the same for any number of workers and any interruptions. A prepare of the same output
killed while it installed the directory left a ``.<out>.tmp-*`` sibling: the next one, holding
the work directory's lock, removes it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from moetrain.data.input_readers import ReadOptions
from moetrain.data.inputs import NamedDataset, expand_inputs
from moetrain.data.parallel_tokenize import (
    UNIT_BYTES,
    WorkDir,
    plan_units,
    tokenize_units,
    work_dir_of,
    work_settings,
)
from moetrain.data.tokenizer import load_tokenizer
from moetrain.data.tokens import (
    check_not_prepared,
    check_val_fraction,
    split_documents,
    write_token_dir,
)


def prepare(
    inputs: list[str | Path | NamedDataset],
    out_dir: str | Path,
    tokenizer: str = "byte",
    val_fraction: float = 0.05,
    progress: bool = True,
    overwrite: bool = False,
    text_field: str = "text",
    *,
    workers: int | None = None,
    unit_bytes: int = UNIT_BYTES,
    split_text: str = "file",
    on_bad_record: str = "error",
    replace_bad_bytes: bool = False,
) -> Path:
    """Tokenize text into a token directory at `out_dir` (see `moetrain.data.tokens`).

    `inputs` are files, directories or glob patterns (`inputs.expand_inputs`), and datasets
    loaded by `inputs.load_named_dataset`. A ``.txt`` file is one document (a book or an article
    keeps its long-range context), or one per paragraph or line (`split_text`); JSON lines
    (plain, ``.gz`` or ``.zst``), Parquet files and Hugging Face datasets hold one document per
    line or row, in their string `text_field` (blank lines, empty texts and empty text files
    are skipped). `on_bad_record` ("error" or "skip") and `replace_bad_bytes` say what a bad
    record and non-UTF-8 bytes do (`input_readers`); meta.json records how many records were
    skipped. Documents are held out for val by `split_documents`, in input order. `workers`
    processes tokenize (default: one per core, as the work allows; 1 = in this process), in
    units of about `unit_bytes` of input. An existing token directory at `out_dir` is replaced
    only with `overwrite` (the runs trained on it would no longer resume); other non-empty
    directories are never replaced.
    """
    out = Path(out_dir)
    check_not_prepared(out, overwrite)
    if not inputs:
        raise ValueError("prepare needs at least one input file")
    if workers is not None and workers < 1:
        raise ValueError(f"workers ({workers}) must be >= 1")
    check_val_fraction(val_fraction)
    options = ReadOptions(
        text_field=text_field,
        split_text=split_text,
        on_bad_record=on_bad_record,
        replace_bad_bytes=replace_bad_bytes,
    )
    sources = expand_inputs(inputs)
    tok = load_tokenizer(tokenizer)
    units = plan_units(sources, unit_bytes)
    with WorkDir(work_dir_of(out), work_settings(tok, options)) as work:
        _remove_leftovers(out)
        records = tokenize_units(units, work, tok, options, workers, progress)
        documents = (ids for u in units for ids in work.documents(u, records[u.key]))
        meta = {
            "val_fraction": val_fraction,
            "split_text": split_text,
            "skipped_records": sum(r.get("skipped", 0) for r in records.values()),
        }
        write_token_dir(out, split_documents(documents, val_fraction), tok, meta=meta)
        work.remove()
    return out


def _remove_leftovers(out: Path) -> None:
    """Remove what a prepare of `out` killed while installing left beside it (the caller holds
    the work directory's lock, so no other prepare of `out` is installing now)."""
    for leftover in sorted(out.parent.glob(f".{out.name}.tmp-*")):
        size = sum(f.stat().st_size for f in leftover.rglob("*") if f.is_file())
        shutil.rmtree(leftover, ignore_errors=True)
        print(
            f"prepare: removed {leftover} ({size / 1e6:,.1f} MB), left by a prepare of {out} "
            "that was killed while installing it",
            file=sys.stderr,
        )
