"""The config a resumed run trains with: the run's own, plus the changes that are safe to make.

A checkpoint's state means something only under its architecture (every tensor's shape and
meaning, the optimizer state's layout) and its data (the loader's position counts windows of
these tokens at this seq_len, micro-batch size and seed; evaluations score fixed sequences). A
resume that changes a `FROZEN` field is an error naming it; anything else may change and is
printed (length, schedule, cadences, optimizer hyperparameters, the parallel layout, kernels and
precision). Also allowed: `data.path` and the paths of `data.sources` (same number, order and
weights), `data.val_fraction`, and a `data.tokenizer` file of the same content, since the
recorded content hash catches other data; `moe.bias_update_rate` but not to or from 0 (the bias
exists only while it is positive). `resume_run_config` builds the config a resume trains with.
This module does not import torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moetrain.config import RunConfig
from moetrain.data.tokenizer import same_files, tokenizer_file

# section -> fields a resume must not change; "*" is every field of the section except those
# listed in ALLOWED
FROZEN: dict[str, tuple[str, ...]] = {
    "model": ("*",),
    "moe": (
        "num_experts",
        "top_k",
        "expert_hidden",
        "score_func",
        "renormalize",
        "routing",
        "num_shared_experts",
    ),
    # eval_sequences and data (eval_sets included) fix the sequences every evaluation scores
    "train": ("seed", "seq_len", "micro_batch_size", "optimizer", "eval_sequences"),
    "data": ("*",),
    "precision": ("param_dtype", "master_weights"),
}
ALLOWED = {"model.attention_backend", "data.path", "data.val_fraction"}


def is_frozen(key: str) -> bool:
    section, _, name = key.partition(".")
    fields = FROZEN.get(section, ())
    return key not in ALLOWED and ("*" in fields or name in fields)


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
        if key == "data.sources" and _weights(old) == _weights(value):
            continue  # moved directories: the content hash still catches other data
        if key == "data.tokenizer" and _same_tokenizer(old, value):
            continue  # the same tokenizer.json under another (e.g. now absolute) path
        if key == "moe.bias_update_rate" and (old > 0) != (value > 0):
            raise ValueError(
                f"moe.bias_update_rate cannot change between 0 and > 0 on --resume ({old!r} in "
                f"{source}, {value!r} now): the router's learned expert bias exists only while "
                "the rate is > 0, so it would be dropped (or start again from zero); keep a "
                "positive rate (a small one all but freezes the bias), or start a new run"
            )
        if is_frozen(key):
            raise ValueError(
                f"{key} cannot change on --resume ({old!r} in {source}, {value!r} now): the "
                "checkpoint's weights, optimizer state or data position depend on it; start a "
                "new run (another --run-dir, or --init-from the checkpoint for its weights)"
            )
    return [f"{key}: {old!r} -> {value!r}" for key, old, value in changes]


def _weights(sources: list[dict[str, Any]]) -> list[float]:
    return [s["weight"] for s in sources]


def _same_tokenizer(a: str, b: str) -> bool:
    return "byte" not in (a, b) and same_files(tokenizer_file(a), tokenizer_file(b))


def resume_run_config(
    run_dir: Path, requested: RunConfig, overrides: list[str], requested_from: str = ""
) -> RunConfig:
    """The config `--resume` trains with: the run's own config.yaml in `run_dir` with the --set
    `overrides`, checked by `check_resumable`. A --preset or YAML given again (`requested_from`
    names it, `requested` is what it builds with the same overrides) must equal it, or it would
    change fields silently. Without a config.yaml (a first start under a requeue-safe --resume)
    the requested config."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return requested
    saved = RunConfig.load_yaml(path)
    config = saved.with_overrides(overrides)
    diverging = differences(config, requested) if requested_from else []
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
