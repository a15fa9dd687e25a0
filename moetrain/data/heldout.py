"""Held-out sequences that evaluations score: the validation set and the evaluation sets.

A validation set is `count` windows of a token stream (window i: the seq_len + 1 tokens from
token i * seq_len) spread evenly by `heldout_windows`: it depends only on the tokens, seq_len and
`train.eval_sequences`, never on the step, a resume or the layout. `WindowRows` serves them as
(inputs, targets) rows, what `train.evaluate` scores (data/tasks.py makes rows of multiple-choice
items); a target of `IGNORE` is not scored. `open_eval_set` opens a `data.eval_sets` directory
after checking that it speaks the run's vocabulary and is not what the run trains on.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moetrain.config import DataConfig
from moetrain.data.loader import training_dirs, vocabulary
from moetrain.data.tokens import fingerprint, load_split, read_meta

IGNORE = -100  # a target that is not scored (padding, a multiple-choice context)


def heldout_windows(num_windows: int, count: int) -> np.ndarray:
    """`count` window indices spread evenly over [0, num_windows) (all of them when fewer):
    index floor(i * num_windows / count) for i < count."""
    count = min(count, num_windows)
    return np.arange(count, dtype=np.int64) * num_windows // count


class WindowRows:
    """Windows of one or more token arrays (a window never crosses from one to the next) as
    rows: row i is window `windows[i]` of their concatenated window list, every target scored."""

    def __init__(self, arrays: Sequence[np.ndarray], seq_len: int, count: int, what: str):
        self.arrays, self.seq_len = list(arrays), seq_len
        counts = [max(len(a) - 1, 0) // seq_len for a in self.arrays]
        if sum(counts) == 0:
            raise ValueError(
                f"{what} holds {sum(len(a) for a in self.arrays)} tokens, fewer than one window "
                f"of seq_len + 1 = {seq_len + 1} tokens; use a smaller train.seq_len or more data"
            )
        self._starts = np.cumsum([0, *counts])
        self.windows = heldout_windows(int(self._starts[-1]), count)
        self.num_rows = len(self.windows)

    def rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) int64 arrays of shape (len(indices), seq_len)."""
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        for row, window in zip(out, self.windows[indices], strict=True):
            array = int(np.searchsorted(self._starts, window, side="right")) - 1
            start = (int(window) - int(self._starts[array])) * self.seq_len
            row[:] = self.arrays[array][start : start + self.seq_len + 1]
        return out[:, :-1], out[:, 1:]


def open_eval_set(cfg: DataConfig, path: str | Path, vocab_size: int, what: str) -> list:
    """Both splits of the token directory `path`, for a run on `cfg`'s data: a ValueError (about
    `what`, e.g. "data.eval_sets[0] (data/wiki)") when it was prepared with another tokenizer,
    vocabulary or EOS id, or holds the tokens the run trains on."""
    path = Path(path)
    if not (path / "meta.json").is_file():
        raise ValueError(f"{what} is not a token directory (prepare one with moetrain prepare)")
    reference = training_dirs(cfg)
    mine = vocabulary(str(path), read_meta(path))
    theirs = vocabulary(str(reference[0]), read_meta(reference[0]))
    if mine != theirs:
        raise ValueError(
            f"{what} has (tokenizer, vocab_size, eos_id) {mine} but the run's data "
            f"({reference[0]}) has {theirs}; prepare it with the run's tokenizer"
        )
    if fingerprint(path) in {fingerprint(d) for d in reference}:
        raise ValueError(
            f"{what} holds the tokens the run trains on; its val split is scored as val_loss "
            "already: name a directory the run does not train on"
        )
    return [load_split(path, split, vocab_size) for split in ("train", "val")]
