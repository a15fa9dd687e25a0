"""The data loaders a run trains and evaluates on: random token ids (`data.random_tokens`), one
token directory (`data.path`), or a weighted mix of sources (`data.sources`), each cut into this
data-parallel rank's share.
"""

from __future__ import annotations

import numpy as np
import torch

from moetrain.config import RunConfig
from moetrain.data import MixedLoader, RandomTokenLoader, SequenceLoader, open_data
from moetrain.parallel.mesh import ParallelDims


def build_loaders(cfg: RunConfig, d: ParallelDims, device: torch.device):
    """(this dp rank's train loader, the val tokens (a list for a mix), tokenizer or None):
    random ids, one token directory, or a weighted mix of sources."""
    t = cfg.train
    if cfg.data.random_tokens:
        train = RandomTokenLoader(
            cfg.model.vocab_size,
            t.seq_len,
            t.micro_batch_size,
            seed=t.seed,
            rank=d.dp_rank,
            device=device,
        )
        rng = np.random.default_rng([t.seed, 1])
        return train, rng.integers(0, cfg.model.vocab_size, t.eval_sequences * t.seq_len + 1), None
    train_tokens, val_tokens, tokenizer = open_data(cfg.data, cfg.model.vocab_size)
    common = dict(rank=d.dp_rank, world_size=d.dp, device=device)
    shape = (t.seq_len, t.micro_batch_size)
    if cfg.data.sources:
        weights = [s.weight for s in cfg.data.sources]
        return (
            MixedLoader(train_tokens, weights, *shape, seed=t.seed, **common),
            val_tokens,
            tokenizer,
        )
    return SequenceLoader(train_tokens, *shape, seed=t.seed, **common), val_tokens, tokenizer
