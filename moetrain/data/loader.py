"""Batches of fixed-length token sequences for training and evaluation, resumable and rank-aware.

`SequenceLoader` cuts a flat token stream into windows of seq_len + 1 tokens (window i starts at
token i * seq_len: every token but the first is a target once per epoch). Epoch e visits the
windows in a permutation seeded by (seed, e); a global batch is world_size * batch_size
consecutive windows of it, rank r taking the r-th slice, so the ranks together read what one
process would. An epoch's trailing partial global batch is dropped. The state is plain ints
independent of the rank, and a resume yields bitwise the same batches. Also here: opening a
`DataConfig`'s tokens, tying a resume to its data, and config fields taken from the tokenizer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from numbers import Integral
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moetrain.config import DataConfig, RunConfig
from moetrain.config.files import same_files, tokenizer_file
from moetrain.data.corpus import embedded_corpus
from moetrain.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
)
from moetrain.data.tokens import fingerprint, load_dir_tokenizer, load_split, read_meta

EMBEDDED_VAL_FRACTION = 0.05  # data.val_fraction None: the embedded corpus's held-out share


def embedded_val_fraction(cfg: DataConfig) -> float:
    """The share of the embedded corpus's documents held out for val (`split_documents`):
    data.val_fraction, else EMBEDDED_VAL_FRACTION."""
    return cfg.val_fraction or EMBEDDED_VAL_FRACTION


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, Integral) or value <= 0:
            raise ValueError(f"{name} ({value!r}) must be a positive integer")


def check_shard_args(seq_len: int, batch_size: int, rank: int, world_size: int) -> None:
    """The arguments a loader of rank `rank` among `world_size` shares with its peers."""
    _check_positive(seq_len=seq_len, batch_size=batch_size, world_size=world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank ({rank}) must be in [0, world_size ({world_size}))")


def _split_pair(batch_BS1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return batch_BS1[:, :-1].contiguous(), batch_BS1[:, 1:].contiguous()


def device_batch(rows_BS1: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of token rows, on `device`. On CUDA the rows go through pinned memory so
    the copy to the GPU can run asynchronously; the caching host allocator keeps the buffer alive
    until that copy has finished."""
    on_cuda = device.type == "cuda"
    host_BS1 = torch.empty(rows_BS1.shape, dtype=torch.int64, pin_memory=on_cuda)
    host_BS1.numpy()[...] = rows_BS1
    return _split_pair(host_BS1.to(device, non_blocking=on_cuda))


class SequenceLoader:
    """Infinite iterator of (inputs_BS, targets_BS) int64 tensors on `device`."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        batch_size: int,
        *,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device = "cpu",
    ):
        check_shard_args(seq_len, batch_size, rank, world_size)
        if not isinstance(seed, Integral) or seed < 0:
            raise ValueError(f"seed ({seed!r}) must be a non-negative integer")
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D array, got shape {tokens.shape}")
        self.tokens = tokens
        self.seq_len, self.batch_size, self.seed = int(seq_len), int(batch_size), int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.device = torch.device(device)
        self.num_windows = max(len(tokens) - 1, 0) // seq_len
        global_batch = world_size * batch_size
        if self.num_windows < global_batch:
            raise ValueError(
                f"the data holds {len(tokens)} tokens, i.e. {self.num_windows} windows of "
                f"seq_len + 1 = {seq_len + 1} tokens, fewer than one global batch of world_size x "
                f"batch_size = {world_size} x {batch_size} = {global_batch} windows; use a smaller "
                "seq_len or batch size, or more data"
            )
        self._offsets_S1 = np.arange(seq_len + 1)
        self.epoch = 0
        self.index = 0
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    @property
    def batches_per_epoch(self) -> int:
        return self.num_windows // (self.world_size * self.batch_size)

    def passes(self) -> list[int]:
        """Completed passes over the tokens (epochs), as a list like a mix's (one per source)."""
        return [self.epoch]

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._perm = rng.permutation(self.num_windows)
            self._perm_epoch = self.epoch
        return self._perm

    def __iter__(self) -> SequenceLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        first = (self.index * self.world_size + self.rank) * self.batch_size
        windows_B = self._permutation()[first : first + self.batch_size]
        self.index += 1
        if self.index == self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        positions_BS1 = windows_B[:, None] * self.seq_len + self._offsets_S1
        return device_batch(self.tokens[positions_BS1], self.device)

    def state_dict(self) -> dict[str, int]:
        """Position as (epoch, windows consumed in the epoch): independent of how the windows
        were grouped into batches, so a run can resume under another world size or batch size
        as long as the new global batch divides the windows already consumed."""
        global_batch = self.world_size * self.batch_size
        return {"epoch": int(self.epoch), "windows": int(self.index) * global_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch, windows = state.get("epoch"), state.get("windows")
        if not isinstance(epoch, Integral) or not isinstance(windows, Integral) or epoch < 0:
            raise ValueError(f"loader state {state!r} must hold ints 'epoch' >= 0 and 'windows'")
        global_batch = self.world_size * self.batch_size
        if not 0 <= windows <= self.num_windows:
            raise ValueError(
                f"loader state windows ({windows}) must be in [0, {self.num_windows}], "
                "the windows of this data at this seq_len"
            )
        if windows % global_batch:
            raise ValueError(
                f"cannot resume: the checkpoint consumed {windows} windows of this epoch, not a "
                f"multiple of this run's global batch of {global_batch} sequences "
                f"(world size {self.world_size} x batch {self.batch_size})"
            )
        index = windows // global_batch
        if index >= self.batches_per_epoch:  # the epoch just ended (or its tail was dropped)
            epoch, index = epoch + 1, 0
        self.epoch, self.index = int(epoch), int(index)


class RandomTokenLoader:
    """Uniform random token ids generated on `device` (benchmarks). Batch n is drawn from a
    generator seeded by (seed, rank, n): a resume reproduces the stream at no cost."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        batch_size: int,
        *,
        seed: int,
        rank: int = 0,
        device: str | torch.device = "cpu",
    ):
        _check_positive(vocab_size=vocab_size, seq_len=seq_len, batch_size=batch_size)
        if not all(isinstance(v, Integral) and v >= 0 for v in (seed, rank)):
            raise ValueError(f"seed ({seed!r}) and rank ({rank!r}) must be non-negative integers")
        self.vocab_size, self.seq_len = int(vocab_size), int(seq_len)
        self.batch_size, self.seed, self.rank = int(batch_size), int(seed), int(rank)
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.batches = 0

    def __iter__(self) -> RandomTokenLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        entropy = [self.seed, self.rank, self.batches]
        batch_seed = np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0]
        self.generator.manual_seed(int(batch_seed) >> 1)  # 63 bits: manual_seed takes an int64
        self.batches += 1
        shape = (self.batch_size, self.seq_len + 1)
        batch_BS1 = torch.randint(
            0, self.vocab_size, shape, generator=self.generator, device=self.device
        )
        return _split_pair(batch_BS1)

    def passes(self) -> list[int]:
        """Random ids have no epochs."""
        return []

    def state_dict(self) -> dict[str, int]:
        return {"batches": int(self.batches)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        batches = state.get("batches")
        if not isinstance(batches, Integral) or batches < 0:
            raise ValueError(f"loader state {state!r} must hold an int 'batches' >= 0")
        self.batches = int(batches)


def open_data(
    cfg: DataConfig, vocab_size: int
) -> tuple[Any, Any, ByteTokenizer | HFTokenizer | None]:
    """(train tokens, val tokens, tokenizer) for a run; every id is checked to be < vocab_size.

    `cfg.path` None: the embedded corpus, tokenized with `cfg.tokenizer`. A prepared directory
    brings its own tokenizer: `cfg.tokenizer` may stay "byte" or name the same one; anything else
    is an error. A pre-tokenized corpus has none (None). With `cfg.sources`: lists, one array per
    source. `cfg.random_tokens` is the caller's business (a `RandomTokenLoader`).
    """
    if cfg.sources:
        check_same_vocabulary(cfg)
        opened = [_open_dir(cfg, Path(s.path), vocab_size) for s in cfg.sources]
        return [o[0] for o in opened], [o[1] for o in opened], opened[0][2]
    if cfg.path is None:
        data_dir = embedded_corpus(cfg.tokenizer, embedded_val_fraction(cfg))
        built = dataclasses.replace(cfg, tokenizer="byte", val_fraction=None)  # built with both
        return _open_dir(built, data_dir, vocab_size)
    return _open_dir(cfg, Path(cfg.path), vocab_size)


def _open_dir(
    cfg: DataConfig, data_dir: Path, vocab_size: int
) -> tuple[np.ndarray, np.ndarray, ByteTokenizer | HFTokenizer | None]:
    meta = read_meta(data_dir)
    recorded = meta["tokenizer"]
    if cfg.tokenizer != "byte" and not _same_tokenizer(cfg.tokenizer, data_dir, recorded):
        raise ValueError(
            f"data.tokenizer ({cfg.tokenizer!r}) differs from the tokenizer {data_dir} was "
            f"prepared with ({recorded!r}); leave data.tokenizer at its default to use the "
            "directory's tokenizer, or prepare the data again with this one"
        )
    made = meta.get("val_fraction", EMBEDDED_VAL_FRACTION)  # older directories record none
    if cfg.val_fraction is not None and cfg.val_fraction != made:
        raise ValueError(
            f"data.val_fraction ({cfg.val_fraction}) is not the split of {data_dir}, which "
            f"`moetrain prepare` made (val_fraction {meta.get('val_fraction', 'not recorded')}); "
            "leave data.val_fraction null to use it, or prepare the data again with "
            "--val-fraction"
        )
    tokenizer = load_dir_tokenizer(data_dir)
    train = load_split(data_dir, "train", vocab_size)
    val = load_split(data_dir, "val", vocab_size)
    return train, val, tokenizer


def check_same_vocabulary(cfg: DataConfig) -> dict[str, Any]:
    """The first source's meta.json; a ValueError when another source was tokenized differently
    (its token ids would mean other things to the same model)."""
    metas = [read_meta(s.path) for s in cfg.sources]
    keys = ("tokenizer", "vocab_size", "eos_id")
    identities = [vocabulary(s.path, meta) for s, meta in zip(cfg.sources, metas, strict=True)]
    for i, meta in enumerate(metas[1:], start=1):
        if identities[i] != identities[0]:
            raise ValueError(
                f"data.sources[{i}] ({cfg.sources[i].path}) has (tokenizer, vocab_size, eos_id) "
                f"{tuple(meta[k] for k in keys)} but data.sources[0] ({cfg.sources[0].path}) has "
                f"{tuple(metas[0][k] for k in keys)}; every source of a mix must be prepared "
                "with the same tokenizer"
            )
    return metas[0]


def vocabulary(data_dir: str, meta: dict[str, Any]) -> tuple[Any, ...]:
    """What makes token ids mean the same: a Hugging Face tokenizer by its file's content (the
    copy in the directory; the same file may have been named by different paths), others by
    name; and the vocabulary size and EOS id."""
    copy = Path(data_dir) / "tokenizer.json"
    if meta["tokenizer"] not in ("byte", None) and copy.is_file():
        tokenizer = hashlib.sha256(copy.read_bytes()).hexdigest()
    else:
        tokenizer = meta["tokenizer"]
    return tokenizer, meta["vocab_size"], meta["eos_id"]


def padded_vocab_size(tokenizer_size: int) -> int:
    """The model.vocab_size a tokenizer of `tokenizer_size` ids gives when it is left unset: the
    size rounded up to a multiple of 64 (where the embedding and output GEMMs run fast)."""
    return -(-tokenizer_size // 64) * 64


def resolve_vocab_size(config: RunConfig, *, given: bool = True) -> RunConfig:
    """`config` with model.vocab_size set: the run's tokenizer's `padded_vocab_size` when it is
    unset, or when it is a preset's default that the user did not set (`given` False) and the
    data brings its own vocabulary (a token directory, a mix, a tokenizer file); else kept, as a
    preset's is on the byte-level embedded corpus and on random tokens."""
    d = config.data
    own_vocabulary = bool(d.sources) or d.path is not None or d.tokenizer != "byte"
    if config.model.vocab_size is not None and (given or d.random_tokens or not own_vocabulary):
        return config
    if config.data.random_tokens:
        raise ValueError("model.vocab_size must be set when data.random_tokens is true")
    if config.data.sources:
        size = check_same_vocabulary(config.data)["vocab_size"]
    elif config.data.path is not None:
        size = read_meta(config.data.path)["vocab_size"]
    else:
        size = load_tokenizer(config.data.tokenizer).vocab_size
    vocab = padded_vocab_size(size)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=vocab))


def resolve_eos_id(config: RunConfig) -> RunConfig:
    """`config` with data.eos_id set when data.document_masking is on: the EOS id of the token
    directory or directories (meta.json), or of data.tokenizer for the embedded corpus. A given
    data.eos_id must be that id (random tokens take it as given). Off: `config` unchanged."""
    d = config.data
    if not d.document_masking or d.random_tokens:
        return config
    if d.sources:
        where, eos = "data.sources", check_same_vocabulary(d).get("eos_id")
    elif d.path is not None:
        where, eos = f"data.path ({d.path})", read_meta(d.path).get("eos_id")
    else:
        where, eos = f"data.tokenizer ({d.tokenizer})", load_tokenizer(d.tokenizer).eos_id
    if eos is None:
        raise ValueError(
            f"data.document_masking (True): {where} records no EOS id, so its documents cannot "
            "be told apart; prepare the data again with a tokenizer that has one"
        )
    if d.eos_id is not None and d.eos_id != eos:
        raise ValueError(
            f"data.eos_id ({d.eos_id}) differs from the EOS id of {where} ({eos}); leave "
            "data.eos_id null to use the data's"
        )
    return dataclasses.replace(config, data=dataclasses.replace(d, eos_id=int(eos)))


def data_fingerprint(cfg: DataConfig) -> str | None:
    """The content hash of the run's tokens (`tokens.fingerprint`; for a mix, a hash of its
    sources' in order); None for random tokens."""
    if cfg.random_tokens:
        return None
    parts = [fingerprint(d) for d in training_dirs(cfg)]
    if not cfg.sources:
        return parts[0]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def training_dirs(cfg: DataConfig) -> list[Path]:
    """The token directories a run trains on (the embedded corpus's cache directory for none)."""
    if cfg.sources:
        return [Path(s.path) for s in cfg.sources]
    if cfg.path is not None:
        return [Path(cfg.path)]
    return [embedded_corpus(cfg.tokenizer, embedded_val_fraction(cfg))]


def check_same_data(cfg: DataConfig, recorded: str | None, checkpoint: str | Path) -> None:
    """A ValueError when the tokens differ from those `checkpoint` was trained on (its recorded
    fingerprint). Checkpoints from before fingerprints were recorded (None) pass."""
    if recorded is None:
        return
    current = data_fingerprint(cfg)
    if current != recorded:
        if cfg.sources:
            where = f"data.sources ({', '.join(s.path for s in cfg.sources)})"
        elif cfg.path is not None:
            where = f"data.path ({cfg.path})"
        else:
            where = "the embedded corpus"
        raise ValueError(
            f"the data changed since checkpoint {checkpoint} was saved: {where} has content "
            f"hash {current}, the checkpoint was trained on {recorded}; restore the original "
            "data (re-running `moetrain prepare` on the same inputs gives it back), or start a "
            "new run on the new data (--overwrite or another --run-dir)"
        )


def _same_tokenizer(spec: str, data_dir: Path, recorded: str | None) -> bool:
    """Whether the tokenizer `spec` names is the one `data_dir` was prepared with: by name, or
    by the content of its tokenizer.json (the directory's copy of it, else the recorded file),
    wherever either file lies."""
    if spec == recorded:
        return True
    if recorded in ("byte", None):  # None: a pre-tokenized corpus, which names no tokenizer
        return False
    copy = data_dir / "tokenizer.json"
    return same_files(tokenizer_file(spec), copy if copy.is_file() else tokenizer_file(recorded))
