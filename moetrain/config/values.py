"""Typed config values: a YAML value checked against a dataclass field's type hint, and a
dataclass built from a mapping of its fields, with errors that name the field path, the value
and what is allowed (``moe.top_k ('8') must be an integer``). Used by `moetrain.config`; it
knows no config section. This module does not import torch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any, Literal


def fail(path: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{path} ({value!r}) {allowed}")


def positive(section: str, obj: Any, *names: str) -> None:
    """Each named field of `obj` is None or > 0."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and value <= 0:
            fail(f"{section}.{name}", value, "must be > 0")


def non_negative(section: str, obj: Any, *names: str) -> None:
    """Each named field of `obj` is >= 0."""
    for name in names:
        value = getattr(obj, name)
        if value < 0:
            fail(f"{section}.{name}", value, "must be >= 0")


@functools.cache
def _literal_fields(cls: type) -> dict[str, tuple[Any, ...]]:
    hints = typing.get_type_hints(cls)
    return {k: typing.get_args(h) for k, h in hints.items() if typing.get_origin(h) is Literal}


def check_choices(section: str, obj: Any) -> None:
    """Every `Literal` field of the dataclass `obj` holds one of its choices."""
    for name, choices in _literal_fields(type(obj)).items():
        value = getattr(obj, name)
        if value not in choices:
            fail(f"{section}.{name}", value, f"must be one of {', '.join(choices)}")


def build_dataclass(section: str, cls: type, values: Any) -> Any:
    """`cls` from a mapping of its fields (each coerced to its hint), or `values` if it is one."""
    if isinstance(values, cls):
        return values
    if not isinstance(values, dict):
        raise ValueError(f"{section} must be a mapping of fields, got {type(values).__name__}")
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    unknown = set(values) - names
    if unknown:
        listed = ", ".join(f"{section}.{k}" for k in sorted(map(str, unknown)))
        raise ValueError(f"unknown field(s) {listed}; {section} has: {', '.join(sorted(names))}")
    missing = [f.name for f in fields if f.name not in values and f.default is dataclasses.MISSING]
    if missing:
        fail(section, values, f"lacks the field(s) {', '.join(missing)}")
    hints = typing.get_type_hints(cls)
    return cls(**{k: coerce(f"{section}.{k}", hints[k], v) for k, v in values.items()})


def coerce(path: str, hint: Any, value: Any) -> Any:
    """Check a YAML value against a field's type hint; only int and numeric strings become float."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(path, option, value)
            except ValueError:
                pass
        fail(path, value, f"must be of type {type_name(hint)}")
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            fail(path, value, f"must be one of {', '.join(map(str, choices))}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            fail(path, value, "must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(path, value, "must be an integer")
        return value
    if hint is float:
        if isinstance(value, str):  # PyYAML reads `1e-3` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            fail(path, value, "must be a number")
        try:
            value = float(value)
        except OverflowError:  # an int beyond the float range
            fail(path, value, "must be a finite number")
        if not math.isfinite(value):
            fail(path, value, "must be a finite number")
        return value
    if hint is str:
        if not isinstance(value, str):
            fail(path, value, "must be a string")
        return value
    if origin is tuple and typing.get_args(hint)[1:] == (Ellipsis,):  # a list in YAML
        if not isinstance(value, list | tuple):
            fail(path, value, "must be a list")
        item = typing.get_args(hint)[0]
        return tuple(coerce(f"{path}[{i}]", item, v) for i, v in enumerate(value))
    if dataclasses.is_dataclass(hint):  # a mapping in YAML
        return build_dataclass(path, hint, value)
    raise AssertionError(f"unsupported config type {hint} for {path}")


def type_name(hint: Any) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    names = [getattr(a, "__name__", str(a)) for a in args]
    return " or ".join(names) + (" or null" if len(args) < len(typing.get_args(hint)) else "")
