"""`moetrain prepare` of text: documents from files and datasets into a token directory.

Three steps. Plan: the inputs become sources (`documents.expand_inputs`) and the sources units of
work (`parallel_tokenize.plan_units`). Tokenize: worker processes tokenize the units into the work
directory ``<out>.partial`` next to the output, which a killed or failed run leaves behind with
its finished units, so that the same command resumes. Assemble: the units' documents, in input
order, are split into train and val by `tokens.split_documents` and written as a token directory,
atomically (`tokens.write_token_dir`); then the work directory is removed. The token directory is
bitwise the same for any number of workers and any interruptions.
"""

from __future__ import annotations

from pathlib import Path

from moetrain.data.documents import NamedDataset, expand_inputs
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
) -> Path:
    """Tokenize text into a token directory at `out_dir` (see `moetrain.data.tokens`).

    `inputs` are files, directories or glob patterns (`documents.expand_inputs`), and datasets
    loaded by `documents.load_named_dataset`. A ``.txt`` file is one document (a book or an
    article keeps its long-range context); JSON lines (plain, ``.gz`` or ``.zst``), Parquet
    files and Hugging Face datasets hold one document per line or row, in their string
    `text_field` (blank lines and empty texts are skipped). Documents are held out for val by
    `split_documents`, in input order. `workers` processes tokenize (default: one per core, as
    the work allows; 1 = in this process), in units of about `unit_bytes` of input. An existing
    token directory at `out_dir` is replaced only with `overwrite` (the runs trained on it would
    no longer resume); other non-empty directories are never replaced.
    """
    out = Path(out_dir)
    check_not_prepared(out, overwrite)
    if not inputs:
        raise ValueError("prepare needs at least one input file")
    if workers is not None and workers < 1:
        raise ValueError(f"workers ({workers}) must be >= 1")
    check_val_fraction(val_fraction)
    sources = expand_inputs(inputs)
    tok = load_tokenizer(tokenizer)
    units = plan_units(sources, unit_bytes)
    with WorkDir(work_dir_of(out), work_settings(tok, text_field)) as work:
        records = tokenize_units(units, work, tok, text_field, workers, progress)
        documents = (ids for u in units for ids in work.documents(u, records[u.key]))
        write_token_dir(out, split_documents(documents, val_fraction), tok)
        work.remove()
    return out
