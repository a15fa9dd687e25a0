"""A weighted mix of token directories (`data.sources`): which source each sequence comes from.

The run's sequences are numbered globally (g = 0, 1, ...; ranks slice global batches as in
`SequenceLoader`). Sequence g comes from the source with the largest deficit w_s * (g + 1) - n_s
(n_s: sequences source s gave so far; ties: the first). This deterministic schedule keeps every
n_s within one sequence of w_s * g, so the fractions equal the weights over any stretch of the
run. Each source reads its own windows in a permutation seeded by (seed, source index, epoch) and
starts its next epoch on its own. The state is each source's (epoch, windows consumed): plain
ints independent of rank and batch size, so a resume yields bitwise the same batches.
"""

from __future__ import annotations

from numbers import Integral
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moetrain.config import DataConfig
from moetrain.data.loader import check_shard_args, device_batch


def source_labels(cfg: DataConfig) -> list[str]:
    """Names for the sources in metrics: directory names, or the whole paths when two share one."""
    names = [Path(s.path).name or s.path for s in cfg.sources]
    return names if len(set(names)) == len(names) else [s.path for s in cfg.sources]


class MixedLoader:
    """Infinite iterator of (inputs_BS, targets_BS) int64 tensors drawn from weighted sources."""

    def __init__(
        self,
        sources: list[np.ndarray],
        weights: list[float],
        seq_len: int,
        batch_size: int,
        *,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device = "cpu",
    ):
        check_shard_args(seq_len, batch_size, rank, world_size)
        if len(sources) != len(weights) or not sources:
            raise ValueError("a mix needs one weight per source and at least one source")
        total = float(sum(weights))
        self.weights = [float(w) / total for w in weights]
        self.sources = sources
        self.seq_len, self.batch_size, self.seed = int(seq_len), int(batch_size), int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.device = torch.device(device)
        self.num_windows = [max(len(t) - 1, 0) // seq_len for t in sources]
        for i, n in enumerate(self.num_windows):
            if n == 0:
                raise ValueError(
                    f"data.sources[{i}] holds {len(sources[i])} train tokens, not one window of "
                    f"seq_len + 1 = {seq_len + 1}; use a smaller seq_len or more data"
                )
        self._offsets_S1 = np.arange(seq_len + 1)
        self.epochs = [0] * len(sources)
        self.windows = [0] * len(sources)
        self._perms: dict[int, tuple[int, np.ndarray]] = {}

    def counts(self) -> list[int]:
        """Sequences drawn from each source since the start of the run."""
        return [
            e * n + w for e, n, w in zip(self.epochs, self.num_windows, self.windows, strict=True)
        ]

    def passes(self) -> list[int]:
        """Completed passes over each source's windows (its epochs)."""
        return list(self.epochs)

    def tokens_per_source(self) -> list[int]:
        """Target tokens read from each source by all ranks together."""
        return [c * self.seq_len for c in self.counts()]

    def _next_window(self, s: int) -> int:
        epoch = self.epochs[s]
        if s not in self._perms or self._perms[s][0] != epoch:
            rng = np.random.default_rng([self.seed, s, epoch])
            self._perms[s] = (epoch, rng.permutation(self.num_windows[s]))
        window = int(self._perms[s][1][self.windows[s]])
        self.windows[s] += 1
        if self.windows[s] == self.num_windows[s]:
            self.epochs[s], self.windows[s] = epoch + 1, 0
        return window

    def __iter__(self) -> MixedLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Every rank walks the whole global batch so that all agree on the counts.
        counts = self.counts()
        g = sum(counts)
        rows = np.empty((self.batch_size, self.seq_len + 1), dtype=np.int64)
        first = self.rank * self.batch_size
        for i in range(self.world_size * self.batch_size):
            deficits = [w * (g + i + 1) - c for w, c in zip(self.weights, counts, strict=True)]
            s = deficits.index(max(deficits))
            counts[s] += 1
            window = self._next_window(s)
            if first <= i < first + self.batch_size:
                rows[i - first] = self.sources[s][window * self.seq_len + self._offsets_S1]
        return device_batch(rows, self.device)

    def state_dict(self) -> dict[str, Any]:
        return {
            "sources": [
                {"epoch": e, "windows": w} for e, w in zip(self.epochs, self.windows, strict=True)
            ]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        entries = state.get("sources")
        if not isinstance(entries, list) or len(entries) != len(self.sources):
            raise ValueError(
                f"loader state {state!r} must hold one entry per source ({len(self.sources)}); "
                "was the checkpoint trained on another mix?"
            )
        epochs, windows = [], []
        for i, entry in enumerate(entries):
            e, w = entry.get("epoch"), entry.get("windows")
            if not isinstance(e, Integral) or not isinstance(w, Integral) or e < 0:
                raise ValueError(f"loader state of source {i} ({entry!r}) must hold ints >= 0")
            if not 0 <= w < self.num_windows[i]:
                raise ValueError(
                    f"loader state of source {i}: windows ({w}) must be in "
                    f"[0, {self.num_windows[i]}), the windows of this source at this seq_len"
                )
            epochs.append(int(e))
            windows.append(int(w))
        self.epochs, self.windows = epochs, windows
