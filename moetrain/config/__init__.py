"""Run configuration: frozen, keyword-only dataclasses, one per section (the model's in
`moetrain.config.architecture`, the run's in `moetrain.config.sections`, re-exported here), loaded
from YAML.

A `RunConfig` is `model` + `moe` + `parallel` + `train` + `data` + `precision`; `layer` puts a
partial mapping (a YAML on a preset) over a base config. Every section validates itself at
construction and `RunConfig` checks the rules that span sections, so an invalid run never starts.
Errors are `ValueError`s that name the field path, the value and what is allowed, e.g.
``moe.top_k (9) must be <= moe.num_experts (8)``. This module does not import torch.
"""

from __future__ import annotations

import dataclasses
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from moetrain.config.architecture import ModelConfig, MoEConfig
from moetrain.config.sections import (
    DataConfig,
    DataSource,
    EvalSet,
    ParallelConfig,
    PrecisionConfig,
    TrainConfig,
)
from moetrain.config.values import build_dataclass, coerce, fail

__all__ = [
    "SECTIONS",
    "SECTION_TYPES",
    "DataConfig",
    "DataSource",
    "EvalSet",
    "ModelConfig",
    "MoEConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "RunConfig",
    "TrainConfig",
    "layer",
    "merge",
    "read_yaml",
]


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A whole run. Cross-section rules are checked here."""

    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)

    def __post_init__(self) -> None:
        ep, num_experts = self.parallel.ep, self.moe.num_experts
        if num_experts % ep:
            fail("parallel.ep", ep, f"must divide moe.num_experts ({num_experts})")
        if self.parallel.dp is not None and self.parallel.dp % ep:
            fail("parallel.ep", ep, f"must divide parallel.dp ({self.parallel.dp})")
        optimizer = self.train.optimizer
        if optimizer in ("sharded", "muon_sharded") and self.train.adamw_kernel == "triton":
            fail(
                "train.adamw_kernel",
                "triton",
                f"applies to the replicated AdamW; train.optimizer ({optimizer}) updates its "
                "flat shards with torch's fused AdamW",
            )
        if optimizer in ("muon", "muon_sharded") and self.parallel.data_parallel == "fsdp":
            fail(
                "train.optimizer",
                optimizer,
                "cannot be combined with parallel.data_parallel (fsdp): Newton-Schulz needs each "
                "weight matrix whole and FSDP2 shards every parameter over the dp ranks; use "
                "parallel.data_parallel=ddp (train.optimizer=muon_sharded shards Muon's state "
                "by whole matrices)",
            )
        for name, width in (("model.d_model", self.model.d_model), ("moe.expert_hidden", self.moe.expert_hidden)):  # fmt: skip
            if width % 8:  # torch._grouped_mm wants 16-byte rows: 8 bf16 or 4 fp32 elements
                fail(
                    name, width, "must be a multiple of 8 (the expert GEMM's 16-byte rows in bf16)"
                )
        if self.parallel.pp > self.model.num_layers:
            fail(
                "parallel.pp",
                self.parallel.pp,
                f"must be <= model.num_layers ({self.model.num_layers})",
            )
        if self.moe.overlap == "two_chunk":
            self._check_overlap()
        eos, vocab = self.data.eos_id, self.model.vocab_size
        if eos is not None and vocab is not None and eos >= vocab:
            fail("data.eos_id", eos, f"must be < model.vocab_size ({vocab})")
        self.grad_accum_steps(self.parallel.dp or 1)  # checks train.global_batch_tokens

    def _check_overlap(self) -> None:
        """moe.overlap=two_chunk runs each MoE block as two chunks of sequences, the MoE layer in
        halves between the chunks' attention; what cannot split or wrap that is an error."""
        t, p, d = self.train, self.parallel, self.data
        for name, value, bad, why in (
            ("train.micro_batch_size", t.micro_batch_size, t.micro_batch_size < 2,
             "must be >= 2: the micro-batch's sequences are split in two"),
            ("parallel.activation_checkpointing", p.activation_checkpointing,
             p.activation_checkpointing == "moe",
             "cannot be moe: the MoE layer runs in halves between the chunks' attention, which "
             "a checkpoint of the layer alone cannot wrap; use full or none"),
            ("parallel.data_parallel", p.data_parallel, p.data_parallel == "fsdp",
             "must be ddp: overlap hides the resident experts' all-to-alls (FSDP's hooks would "
             "run at each chunk's call of the experts)"),
            ("data.document_masking", d.document_masking, d.document_masking,
             "must be false: the documents' block mask is built for the whole micro-batch"),
        ):  # fmt: skip
            if bad:
                fail(name, value, f"{why} (moe.overlap is two_chunk)")

    # ---- derived quantities -------------------------------------------------------------------
    def dp_size(self, world_size: int) -> int:
        """Data-parallel degree for a world size; a clear error when the layout does not fit."""
        pp = self.parallel.pp
        if world_size % pp:
            fail("parallel.pp", pp, f"must divide the world size ({world_size})")
        dp = self.parallel.dp or world_size // pp
        if dp * pp != world_size:
            fail(
                "parallel.dp",
                dp,
                f"times parallel.pp ({pp}) must equal the world size ({world_size})",
            )
        if dp % self.parallel.ep:
            fail("parallel.ep", self.parallel.ep, f"must divide the data-parallel degree ({dp})")
        return dp

    def grad_accum_steps(self, dp: int) -> int:
        micro = self.train.micro_batch_size * self.train.seq_len * dp
        if self.train.global_batch_tokens is None:
            return 1
        if self.train.global_batch_tokens % micro:
            fail(
                "train.global_batch_tokens",
                self.train.global_batch_tokens,
                f"must be a multiple of micro_batch_size * seq_len * dp ({micro})",
            )
        return self.train.global_batch_tokens // micro

    # ---- serialization --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        if not isinstance(data, dict):
            raise ValueError(f"config must be a mapping of sections, got {type(data).__name__}")
        unknown = set(data) - set(SECTIONS) - {"name"}
        if unknown:
            raise ValueError(
                f"unknown config section(s) {sorted(map(str, unknown))}; allowed: name, "
                f"{', '.join(SECTIONS)}"
            )
        data = _migrate(data)
        kwargs: dict[str, Any] = {}
        if "name" in data:
            kwargs["name"] = coerce("name", str, data["name"])
        for section in SECTIONS:
            if section in data:
                kwargs[section] = _build_section(section, data[section])
        return cls(**kwargs)

    def save_yaml(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def load_yaml(cls, path: str | Path) -> RunConfig:
        return cls.from_dict(read_yaml(path))

    def with_overrides(self, overrides: list[str] | tuple[str, ...]) -> RunConfig:
        """Apply `section.field=value` strings; values are parsed as YAML scalars."""
        data = self.to_dict()
        for item in overrides:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ValueError(f"override {item!r} must look like section.field=value")
            parts = key.strip().split(".")
            if parts == ["name"]:
                data["name"] = raw
                continue
            if len(parts) != 2 or parts[0] not in SECTIONS:
                raise ValueError(
                    f"override key {key!r} must be section.field with a section in "
                    f"{', '.join(SECTIONS)}"
                )
            section, name = parts
            if name not in data[section] and key not in REMOVED_FIELDS and key not in MIGRATED:
                raise ValueError(
                    f"unknown field {key!r}; {section} has: {', '.join(data[section])}"
                )
            try:
                data[section][name] = yaml.safe_load(raw) if raw.strip() else None
            except yaml.YAMLError:
                data[section][name] = raw
        return RunConfig.from_dict(data)


# section name -> its dataclass, in config order
SECTION_TYPES = {k: v for k, v in typing.get_type_hints(RunConfig).items() if k != "name"}
SECTIONS = tuple(SECTION_TYPES)

# fields of older configs that `_migrate` reads in today's terms
MIGRATED = ("train.eval_batches",)


def _migrate(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with the fields of older configs replaced by today's, with a warning that says how
    (train.eval_batches counted micro-batches per dp rank; eval_sequences counts sequences)."""
    train = data.get("train")
    if not isinstance(train, dict) or "eval_batches" not in train:
        return data
    train = dict(train)
    batches = train.pop("eval_batches")
    if isinstance(batches, int) and not isinstance(batches, bool) and batches > 0:
        micro = train.get("micro_batch_size", TrainConfig.micro_batch_size)
        train["eval_sequences"] = batches * micro if isinstance(micro, int) else batches
        warnings.warn(
            f"train.eval_batches ({batches}) is replaced by train.eval_sequences: read as "
            f"{train['eval_sequences']} sequences (eval_batches x train.micro_batch_size), "
            "scored the same at every evaluation in every layout; write eval_sequences instead",
            FutureWarning,
            stacklevel=3,
        )
    else:
        fail(
            "train.eval_batches", batches, "must be a positive integer (now: train.eval_sequences)"
        )
    return {**data, "train": train}


def read_yaml(path: str | Path) -> Any:
    """The parsed content of a config file; a missing file or bad YAML is a ValueError."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"config file {path} is not valid YAML: {exc}") from None


def layer(base: RunConfig, data: Any) -> RunConfig:
    """`base` with the fields a config mapping `data` lists replaced (section by section, field by
    field), validated as a whole."""
    if not isinstance(data, dict):
        return RunConfig.from_dict(data)  # its error names the problem
    return RunConfig.from_dict(merge(base.to_dict(), data))


def merge(base: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """`base` with the entries of `data` over it; a section's mapping is merged field by field."""
    merged = dict(base)
    for key, values in data.items():
        both = isinstance(values, dict) and isinstance(merged.get(key), dict)
        merged[key] = {**merged[key], **values} if both else values
    return merged


# Fields that existed once -> why they went. Absent or false is today's behaviour (so the
# config.yaml of an older run still resumes); true is an error that says why.
REMOVED_FIELDS = {
    "precision.fp8_expert_weight_grad": "was removed: the FP8 expert weight gradient was slower "
    "than the bf16 one on the H200 in every measurement (benchmarks/RESULTS.md); delete the line",
}

# (field, choice) that was renamed -> why, naming the new choice: the old one is an error.
RENAMED_CHOICES = {
    ("moe.lb_scope", "global_batch"): "was renamed micro_batch_dp, for what it does: the route "
    "counts are summed over the data-parallel ranks of each micro-batch, not over a step's "
    'micro-batches (docs/design.md, "Which routes the balance loss counts"); write '
    "moe.lb_scope: micro_batch_dp (in a run's config.yaml too: the same behaviour, so it resumes)",
}


# (field, value of older configs) -> the choice it now reads as, silently: the same model, so an
# older run's config.yaml resumes and exports as before.
LEGACY_CHOICES = {("model.qk_norm", True): "full", ("model.qk_norm", False): "none"}


def _build_section(section: str, values: Any) -> Any:
    if isinstance(values, dict):
        values = dict(values)
        for (key, old), choice in LEGACY_CHOICES.items():
            legacy_section, _, name = key.partition(".")
            value = values.get(name)
            if legacy_section == section and type(value) is type(old) and value == old:
                values[name] = choice
        for key, why in REMOVED_FIELDS.items():
            removed_section, _, name = key.partition(".")
            value = values.pop(name, False) if removed_section == section else False
            if value is not False:
                fail(key, value, why)
        for (key, choice), why in RENAMED_CHOICES.items():
            renamed_section, _, name = key.partition(".")
            if renamed_section == section and values.get(name) == choice:
                fail(key, choice, why)
    return build_dataclass(section, SECTION_TYPES[section], values)
