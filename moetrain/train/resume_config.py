"""The config a resumed run trains with: the run's own, plus the changes that are safe to make.

A checkpoint's state means something only under its architecture (every tensor's shape and
meaning, the optimizer state's layout) and its data (the loader's position counts windows of
these tokens at this seq_len, micro-batch size and seed; evaluations score fixed sequences). Each
field declares at its definition (`moetrain.config.sections`, through `moetrain.config.fields`)
whether a resume may change it: a change of a `frozen` field is an error naming it, unless the
field allows that change (`data.sources`: the same weights, the directories moved;
`data.tokenizer`: a file of the same content, since the recorded content hash catches other
data); a change of a `resumable` field is printed (length, schedule, cadences, optimizer
hyperparameters, the parallel layout, kernels and precision, `data.path`), unless the field
refuses it (`moe.bias_update_rate` to or from 0: the bias exists only while it is positive).
`resume_run_config` builds the config a resume trains with. This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from moetrain.config import SECTION_TYPES, RunConfig
from moetrain.config.fields import rules_of


def is_frozen(key: str) -> bool:
    """Whether the field `key` ("section.field") is declared frozen: a resume may not change it
    (except a change the field allows)."""
    section, _, name = key.partition(".")
    return section in SECTION_TYPES and rules_of(SECTION_TYPES[section], name).frozen


def differences(old: RunConfig, new: RunConfig) -> list[tuple[str, Any, Any]]:
    """(section.field, old value, new value) for every field that differs, in config order."""
    a, b = old.to_dict(), new.to_dict()
    out = []
    for section, values in a.items():
        if not isinstance(values, dict):
            if values != b[section]:
                out.append((section, values, b[section]))
            continue
        for name, value in values.items():
            if value != b[section][name]:
                out.append((f"{section}.{name}", value, b[section][name]))
    return out


def check_resumable(saved: RunConfig, new: RunConfig, source: str) -> list[str]:
    """Raise a ValueError naming the first frozen field that differs between the config a run
    was saved with (`source` says where it lives) and `new`; return the other differences as
    printable lines ("train.steps: 50 -> 100")."""
    changes = differences(saved, new)
    for key, old, value in changes:
        section, _, name = key.partition(".")
        if not name:
            continue  # the run's name
        rules = rules_of(type(getattr(saved, section)), name)
        if rules.check is not None:
            rules.check(key, old, value, source)
        if rules.frozen and not (rules.allow is not None and rules.allow(old, value)):
            raise ValueError(
                f"{key} cannot change on --resume ({old!r} in {source}, {value!r} now): the "
                "checkpoint's weights, optimizer state or data position depend on it; start a "
                "new run (another --run-dir, or --init-from the checkpoint for its weights)"
            )
    return [f"{key}: {old!r} -> {value!r}" for key, old, value in changes]


def resume_run_config(
    run_dir: Path,
    requested: RunConfig | None,
    overrides: list[str],
    requested_from: str = "",
    resolve_paths: Callable[[RunConfig], RunConfig] = lambda config: config,
) -> RunConfig:
    """The config `--resume` trains with: the run's own config.yaml in `run_dir` with the --set
    `overrides`, checked by `check_resumable`. A --preset or YAML given again (`requested_from`
    names it, `requested` is what it builds with the same overrides) must equal it, or it would
    change fields silently; its paths compare by the files they name (`resolve_paths` makes
    both sides' absolute: data/run_paths.py). The overrides are validated against the run's
    config alone (`requested` may be None when nothing is given again). Without a config.yaml
    (a first start under a requeue-safe --resume) the requested config."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        assert requested is not None, "a first start needs the requested config"
        return requested
    saved = RunConfig.load_yaml(path)
    config = saved.with_overrides(overrides)
    diverging = (
        differences(resolve_paths(config), resolve_paths(requested)) if requested_from else []
    )
    if diverging:
        shown = "; ".join(
            f"{key} ({value!r} there, {old!r} in the run)" for key, old, value in diverging[:4]
        )
        more = f" and {len(diverging) - 4} more" if len(diverging) > 4 else ""
        raise ValueError(
            f"--resume continues the run's own config ({path}), but {requested_from} differs "
            f"from it: {shown}{more}. Drop {requested_from} to resume as the run was configured, "
            "or change a field with --set"
        )
    check_resumable(saved, config, str(path))
    return config
