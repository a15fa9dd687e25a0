"""The progress of a `prepare`: input bytes (and their rate), documents, tokens and the MB of
text those bytes hold uncompressed (the documents' UTF-8 bytes; more than the files' bytes for
.gz, .zst or Parquet inputs).

On a terminal a live rich bar; elsewhere one summary line at the end. Counts arrive in batches
from the workers; `finish` takes the exact totals from the units' records. Tokens count as the
token directory holds them (each document's plus its EOS).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


class TokenizeProgress:
    """Used as a context manager around the tokenizing; `done` = (bytes, documents, tokens,
    text bytes) finished before this run (a resume), which are shown but not counted in the
    rate. `why_workers` says where the number of workers came from (the default's limits).
    """

    def __init__(
        self,
        enabled: bool,
        total_bytes: int,
        done: tuple[int, int, int, int],
        workers: int,
        why_workers: str = "",
    ):
        console = Console(stderr=True)
        self.summary = enabled and not console.is_terminal
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TextColumn(
                "{task.fields[text_mb]:,.1f} MB of text, {task.fields[docs]:,} documents, "
                "{task.fields[tokens]:,} tokens"
            ),
            TimeRemainingColumn(),
        )
        self.bar = Progress(*columns, console=console, disable=not enabled or self.summary)
        self.workers = f"{workers} worker{'s' if workers > 1 else ''}"
        self.workers += f" ({why_workers})" if why_workers else ""
        description = f"tokenizing ({self.workers})"
        self.task = self.bar.add_task(
            description, total=total_bytes, completed=done[0], docs=0, tokens=0, text_mb=0.0
        )
        self.done = done
        self.counts = [0, 0, 0]
        self.add(0, *done[1:])
        self.start = time.perf_counter()

    def __enter__(self) -> TokenizeProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.stop()

    def add(self, num_bytes: int, num_docs: int, num_tokens: int, text_bytes: int) -> None:
        docs, tokens, text = self.counts
        self.counts = [docs + num_docs, tokens + num_tokens + num_docs, text + text_bytes]
        docs, tokens, text = self.counts
        self.bar.update(self.task, advance=num_bytes, docs=docs, tokens=tokens, text_mb=text / 1e6)

    def finish(self, total: tuple[int, int, int, int]) -> None:
        """Show the exact totals, and print the summary line when there is no live bar."""
        num_bytes, num_docs, num_tokens = total[0], total[1], total[2] + total[1]
        text_mb = total[3] / 1e6
        self.bar.update(
            self.task, completed=num_bytes, docs=num_docs, tokens=num_tokens, text_mb=text_mb
        )
        if not self.summary:
            return
        seconds = time.perf_counter() - self.start
        rate = (num_bytes - self.done[0]) / 1e6 / max(seconds, 1e-9)
        kept = f" ({self.done[1]:,} documents were done before)" if self.done[1] else ""
        print(
            f"tokenized {num_docs:,} documents, {num_bytes / 1e6:,.1f} MB of files "
            f"({text_mb:,.1f} MB of text), into {num_tokens:,} "
            f"tokens in {seconds:.1f} s: {rate:.2f} MB/s with {self.workers}{kept}",
            file=sys.stderr,
        )
