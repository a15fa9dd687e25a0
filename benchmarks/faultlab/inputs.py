"""Hostile inputs: broken token files, configs and model shapes given to a run with a
checkpoint (a ValueError naming the problem, nothing written), and random config dicts from
hypothesis (a RunConfig or a ValueError naming a field or section, never another exception).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moetrain.config import SECTIONS, RunConfig
from moetrain.data import ByteTokenizer, prepare, write_token_dir

from .harness import Outcome, checkpoint_mtimes, error_of, train_tiny


# ---- hostile inputs ------------------------------------------------------------------------------
def _token_dir(path: Path, num_tokens: int = 6000, seed: int = 0) -> Path:
    ids = np.random.default_rng(seed).integers(0, 256, num_tokens)
    return write_token_dir(path, [("train", ids), ("val", ids[:1000])], ByteTokenizer())


def _damage(kind: str, path: Path) -> Path:
    _token_dir(path, num_tokens=300 if kind == "tiny corpus" else 6000)
    train = path / "train.npy"
    if kind == "truncated":
        train.write_bytes(train.read_bytes()[:-100])
    elif kind == "wrong dtype":
        np.save(train, np.load(train).astype(np.int32))
    elif kind == "id beyond vocab":  # 400: fits the file's uint16, not the model's 320 ids
        tokens = np.load(train)
        tokens[7] = 400
        np.save(train, tokens)
    return path


def hostile_inputs(work: Path) -> Outcome:
    """Broken data, configs and checkpoints given to a run that has a checkpoint: each is a
    ValueError naming the problem, raised before anything is loaded or written, and the run's
    checkpoints are unchanged."""
    out = Outcome("broken inputs", "bad token files, configs, model shape")
    run = work / "inputs_run"
    train_tiny(run, 2)
    before = checkpoint_mtimes(run)
    data_cases = {
        "truncated": r"train\.npy is truncated or corrupt",
        "wrong dtype": r"train\.npy holds int32 values but meta\.json says uint16",
        "id beyond vocab": r"token id 400 in .*train\.npy is >= model\.vocab_size \(320\)",
        "tiny corpus": r"fewer than one global batch",
    }
    cases: list[tuple[str, list[str], str]] = [
        (k, [f"data.path={_damage(k, work / k.replace(' ', '_'))}"], v)
        for k, v in data_cases.items()
    ]
    cases += [
        (
            "other model shape",
            ["model.d_model=128"],
            r"model\.d_model cannot change on --resume \(64 in .*, 128 now\)",
        ),
        ("unknown config key", ["train.lr_max=1"], r"unknown field 'train\.lr_max'"),
        ("wrong config type", ["train.steps=many"], r"train\.steps \('many'\) must be an integer"),
    ]
    for name, overrides, pattern in cases:
        out.injected += 1
        message = error_of(ValueError, train_tiny, run, 4, *overrides) or ""
        ok = re.search(pattern, message) is not None and checkpoint_mtimes(run) == before
        out.survived += int(ok)
        out.details[name] = message
    empty = work / "empty.txt"
    empty.write_text("\n")
    out.injected += 1
    with contextlib.suppress(ValueError):
        prepare([empty], work / "empty_tokens", progress=False)
        out.details["empty corpus"] = "accepted"
    out.survived += int("empty corpus" not in out.details and not (work / "empty_tokens").exists())
    return out


# ---- config fuzzing ------------------------------------------------------------------------------
FIELDS = {
    f.name: [g.name for g in dataclasses.fields(f.default_factory)]
    for f in dataclasses.fields(RunConfig)
    if f.name in SECTIONS
}
_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(1, 64),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["auto", "softmax", "cosine", "bf16", "fsdp", "sharded", "1e-3", "x", ""]),
    st.text(max_size=6),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _section(name: str) -> st.SearchStrategy:
    keys = st.one_of(st.sampled_from(FIELDS[name]), st.text(max_size=6), st.integers())
    return st.one_of(st.dictionaries(keys, _values, max_size=6), _values)


config_dicts = st.builds(
    lambda known, extra: {**extra, **known},
    st.fixed_dictionaries({}, optional={"name": _values, **{s: _section(s) for s in SECTIONS}}),
    st.dictionaries(st.one_of(st.text(max_size=6), st.integers()), _values, max_size=3),
)
_NAMED = re.compile(r"\b(name|config|" + "|".join(SECTIONS) + r")\b")


def check_config_dict(data: Any) -> bool:
    """The property: a RunConfig, or a ValueError whose message names a field or section.
    Anything else raises. Returns whether a config was built."""
    try:
        RunConfig.from_dict(data)
        return True
    except ValueError as exc:
        if not _NAMED.search(str(exc)):
            raise AssertionError(f"error names no field or section: {exc}") from None
        return False


def config_fuzz(num_examples: int) -> Outcome:
    built, tried = [0], [0]

    @settings(
        max_examples=num_examples,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(config_dicts)
    def fuzz(data):
        tried[0] += 1
        built[0] += check_config_dict(data)

    failure = ""
    try:
        fuzz()
    except Exception as exc:  # the falsifying example goes in the details
        failure = f"{type(exc).__name__}: {exc}"
    out = Outcome("random config dicts", "hypothesis: random sections, keys, value types")
    out.injected, out.survived = tried[0], tried[0] if not failure else 0
    out.details = {"built": built[0], "failure": failure}
    return out
