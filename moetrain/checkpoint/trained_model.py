"""A trained model and its tokenizer from a checkpoint directory, for evaluation, generation and
export. A checkpoint directory is self-contained: its `config.yaml` rebuilds the model (in one
process), DCP loads the weights (saved under any layout) and its tokenizer files encode and
decode.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moetrain.checkpoint import manager
from moetrain.config import RunConfig
from moetrain.data import ByteTokenizer, HFTokenizer, load_tokenizer
from moetrain.data.tokenizer_files import load_carried
from moetrain.data.tokens import load_dir_tokenizer
from moetrain.model.transformer import Transformer, build_model


def load_model(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[Transformer, RunConfig]:
    path = manager.resolve(path)
    config = RunConfig.load_yaml(path / "config.yaml")
    config = config.with_overrides(["parallel.ep=1", "parallel.pp=1", "parallel.dp=null"])
    model = build_model(config, device=device, init=False)
    manager.load(path, {"model": model.state_dict()})
    model.eval()
    return model, config


def checkpoint_tokenizer(path: str | Path, config: RunConfig) -> ByteTokenizer | HFTokenizer:
    """The tokenizer a checkpoint directory carries (data/tokenizer_files.py). Checkpoints from
    before tokenizers travelled: the token directory's, which must then still be reachable; a
    guess would decode to garbage."""
    path = Path(path)
    trainer_state = json.loads((path / manager.TRAINER_STATE).read_text())
    if "tokenizer" in trainer_state:
        return load_carried(path, trainer_state["tokenizer"])
    # a mix's sources share one tokenizer (checked when the run started)
    data_path = config.data.sources[0].path if config.data.sources else config.data.path
    if data_path is None:
        return load_tokenizer(config.data.tokenizer)
    if not Path(data_path).is_dir():
        raise ValueError(
            f"checkpoint {path} does not carry its tokenizer (it predates that), and its "
            f"data directory ({data_path}) is not a directory from {Path.cwd()}: run from the "
            "directory it was trained in, or pass the tokenizer explicitly"
        )
    tokenizer = load_dir_tokenizer(data_path)
    if tokenizer is None:
        raise ValueError(
            f"checkpoint {path} was trained on the pre-tokenized corpus {data_path}, "
            "which names no tokenizer, so its ids cannot be decoded; prepare the corpus with "
            "`moetrain prepare --pretokenized ... --tokenizer tokenizer.json` to record one"
        )
    return tokenizer
