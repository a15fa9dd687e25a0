"""`moetrain prepare` of text: documents from files and datasets into a token directory.

Plan: inputs become sources (`inputs.expand_inputs`), sources units (`plan_units`). Tokenize:
workers fill the work directory ``<out>.partial``, which a killed run leaves behind so the same
command resumes. Assemble: the units' documents, in input order, are split by
`tokens.split_documents` and written atomically as a token directory; the work directory is
removed. The result is bitwise the same for any number of workers and interruptions. A
``.<out>.tmp-*`` sibling left by a kill during install is removed by the next prepare.
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
    """Tokenize text into a token directory at `out_dir` (data/tokens.py).

    `inputs`: files, directories, glob patterns and named datasets, read as data/inputs.py and
    data/input_readers.py say (`split_text`, `text_field`, `on_bad_record`, `replace_bad_bytes`;
    meta.json records how many records were skipped). `workers` processes (default
    `default_workers`; 1 = in this process) tokenize units of about `unit_bytes`. An existing
    token directory is replaced only with `overwrite`; other non-empty directories never.
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
        if sum(r["num_documents"] for r in records.values()) == 0:
            work.remove()  # nothing to resume from: no advice to resume it
            skipped = sum(r.get("skipped", 0) for r in records.values())
            raise ValueError(
                f"the input holds no documents ({len(units)} units read, {skipped} bad records "
                "skipped): nothing to prepare; check the paths, --text-field and --split-text"
            )
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
