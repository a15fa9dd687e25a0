"""The rules of a config field beyond its type, declared at the field: may a resume change it,
and which of its values can each export format represent.

`moetrain.config.architecture` and `moetrain.config.sections` build every field with `frozen(default, ...)` or
`resumable(default, ...)` (in place of a plain default), which answer the first question; the
keywords answer the second:

    d_model: int = frozen(1024, olmoe=ANY, qwen3_moe=ANY, mixtral=ANY)   # any width
    qk_norm: ... = frozen("full", olmoe=Only("full"), qwen3_moe=Only("per_head"), ...)
    lr: float = resumable(3e-4, in_model=False)         # no exported model depends on it

A field of the model names each format of `FORMATS` with the values that format can hold: `ANY`,
`Only(values)`, or `Needs(predicate on the section, what it needs)`; `in_model=False` says that
no export depends on the value. A frozen field's change on resume is refused unless its
`allow(old, new)` holds; a resumable field's `check(key, old, new, source)`, if it has one, may
refuse a change by raising (values as in config.yaml). A field declared neither way is frozen and
exports its default value only, in every format, so a forgotten declaration refuses rather than
passes silently; `missing_declarations` (tested for every section) lists such fields.
`moetrain.train.resume_config` and `moetrain.tools.convert` read the rules through `rules_of` and
`unexportable`; this module knows no section. It does not import torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

# The formats `moetrain export` writes (moetrain.tools.convert); each model field declares each one.
FORMATS = ("olmoe", "qwen3_moe", "mixtral")


class ExportRule(Protocol):
    def refusal(self, value: Any, section: Any) -> str | None:
        """None when the format holds `value` (of a field of the config section `section`), else
        what the format would need."""


class _Any:
    def refusal(self, value: Any, section: Any) -> str | None:
        return None

    def __repr__(self) -> str:
        return "ANY"


ANY = _Any()  # every value is represented


class Only:
    """Only these values are represented."""

    def __init__(self, *values: Any) -> None:
        self.values = values

    def refusal(self, value: Any, section: Any) -> str | None:
        if value in self.values:
            return None
        return f"only {' or '.join(map(repr, self.values))} is expressible"

    def __repr__(self) -> str:
        return f"Only{self.values!r}"


@dataclass(frozen=True)
class Needs:
    """The value is represented where `holds(section)` is true; `what` says what that needs."""

    holds: Callable[[Any], bool]
    what: str

    def refusal(self, value: Any, section: Any) -> str | None:
        return None if self.holds(section) else self.what


@dataclass(frozen=True)
class FieldRules:
    """A field's declared rules. `exports` maps a format to its rule (a format not named holds
    only the default value); None: no export depends on the field."""

    frozen: bool
    allow: Callable[[Any, Any], bool] | None = None
    check: Callable[[str, Any, Any, str], None] | None = None
    exports: Mapping[str, ExportRule] | None = dataclasses.field(default_factory=dict)


_RULES = "moetrain.rules"  # the key of a field's FieldRules in its dataclass metadata
_UNDECLARED = FieldRules(frozen=True)


def frozen(
    default: Any,
    *,
    allow: Callable[[Any, Any], bool] | None = None,
    in_model: bool = True,
    **formats: ExportRule,
) -> Any:
    """A field that a resume may not change, except where `allow(old, new)` holds; `formats`
    (or `in_model=False`) declare its export (module docstring)."""
    return _field(default, FieldRules(True, allow=allow, exports=_exports(in_model, formats)))


def resumable(
    default: Any,
    *,
    check: Callable[[str, Any, Any, str], None] | None = None,
    in_model: bool = True,
    **formats: ExportRule,
) -> Any:
    """A field that a resume may change (the change is printed); `check(key, old, new, source)`
    raises a ValueError for a change it refuses. `formats` (or `in_model=False`) declare its
    export (module docstring)."""
    return _field(default, FieldRules(False, check=check, exports=_exports(in_model, formats)))


def _field(default: Any, rules: FieldRules) -> Any:
    return dataclasses.field(default=default, metadata={_RULES: rules})


def _exports(in_model: bool, formats: dict[str, ExportRule]) -> dict[str, ExportRule] | None:
    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise TypeError(f"unknown export format(s) {sorted(unknown)}; known: {FORMATS}")
    if not in_model and formats:
        raise TypeError("a field with in_model=False declares no export format")
    return dict(formats) if in_model else None


def rules_of(section_type: type, name: str) -> FieldRules:
    """The rules declared at field `name` of a section dataclass; for a field that declares none:
    frozen, and only the default value exported."""
    fields = {f.name: f for f in dataclasses.fields(section_type)}
    return fields[name].metadata.get(_RULES, _UNDECLARED)


def missing_declarations(section_type: type) -> list[str]:
    """The fields of a section dataclass that do not declare their rules: built without
    `frozen`/`resumable`, or a model field that does not name every format of `FORMATS`."""
    missing = []
    for f in dataclasses.fields(section_type):
        rules = f.metadata.get(_RULES)
        if rules is None:
            missing.append(f"{f.name} (no frozen/resumable)")
        elif rules.exports is not None and set(rules.exports) != set(FORMATS):
            lacking = ", ".join(x for x in FORMATS if x not in rules.exports)
            missing.append(f"{f.name} (no export rule for {lacking})")
    return missing


def unexportable(config: Any, format_name: str) -> list[str]:
    """'section.field (value): what is expressible' for each field of the config's sections (the
    dataclass fields of `config` that are dataclasses) whose value `format_name` cannot represent,
    in config order."""
    assert format_name in FORMATS, format_name
    problems = []
    for section_field in dataclasses.fields(config):
        section = getattr(config, section_field.name)
        if not dataclasses.is_dataclass(section):
            continue
        for f in dataclasses.fields(section):
            exports = f.metadata.get(_RULES, _UNDECLARED).exports
            if exports is None:
                continue
            value = getattr(section, f.name)
            why = exports.get(format_name, Only(f.default)).refusal(value, section)
            if why is not None:
                problems.append(f"{section_field.name}.{f.name} ({value!r}): {why}")
    return problems
