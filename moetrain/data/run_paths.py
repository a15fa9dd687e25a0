"""A run's file paths made absolute, so that its config.yaml and checkpoints name the same files
from any working directory (`eval`, `export`, a resume started elsewhere).

Absolute: data.path, the paths of data.sources and data.eval_sets, a data.tokenizer file, and
the files among train.eval_tasks; the byte tokenizer and built-in task names (data/tasks.py) stay
names. Relative paths are read against the working directory of the command that resolves them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from moetrain.config import RunConfig
from moetrain.data.tasks import BUILTIN


def absolute(path: str) -> str:
    return str(Path(path).expanduser().absolute())


def resolve_data_paths(config: RunConfig) -> RunConfig:
    """`config` with every file path it names made absolute (the module docstring lists them)."""
    d, t = config.data, config.train
    data = dataclasses.replace(
        d,
        path=absolute(d.path) if d.path is not None else None,
        sources=tuple(dataclasses.replace(s, path=absolute(s.path)) for s in d.sources),
        tokenizer=absolute(d.tokenizer) if d.tokenizer != "byte" else d.tokenizer,
        eval_sets=tuple(dataclasses.replace(s, path=absolute(s.path)) for s in d.eval_sets),
    )
    tasks = tuple(spec if spec in BUILTIN else absolute(spec) for spec in t.eval_tasks)
    train = dataclasses.replace(t, eval_tasks=tasks)
    return dataclasses.replace(config, data=data, train=train)
