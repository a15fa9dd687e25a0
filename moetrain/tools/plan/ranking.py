"""`moetrain plan`'s one ranking: every layout family at one global batch, each row a config that
`moetrain train` accepts (docs/plan.md, "The ranking").

Families: DDP with all experts on each GPU (ep 1) or resident on their GPUs (ep > 1), both with
ShardedAdamW (ZeRO-1) or the replicated AdamW and with pipeline stages, at ep > 1 also with
`moe.overlap: two_chunk` or the FP8 dispatch payload; FSDP2 (each `parallel.fsdp_reshard`, fp32
or bf16 reductions) and HSDP beyond a node, at pp 1 and ep 1. A row's time and memory are
compare.py's (`resident_row`, `fsdp_row`) on the planned config's own dispatcher; its config is
the planned one with the row's settings (`row_settings`), built and validated as `train` builds
it, and its memory is what `run_memory` (and so `train --dry-run`) gives that config. Nothing
here imports torch.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from moetrain.config import RunConfig
from moetrain.moe.capacity import keeps_every_route
from moetrain.tools.plan.compare import Row, fsdp_row, resident_memory, resident_row
from moetrain.tools.plan.layout import Layout, candidate_layouts, microbatch_tokens
from moetrain.tools.plan.memory import ExpertRows, expert_rows, resolved_dispatcher
from moetrain.tools.plan.rank_compute import (
    FSDP,
    GLOBAL_BATCH_TOKENS,
    RESIDENT,
    Setting,
    Variant,
    fsdp_shard,
    with_dispatch,
)
from moetrain.tools.plan.search import estimate

# the busiest rank's routed rows over the mean under learned routing at ep 8: a recorded router
# (demo, steps 201-300 of 300; benchmarks/RESULTS.md, `benchmarks/routing_table.py`)
LEARNED_EXPERT_LOAD = 1.26
ALWAYS_SET = ("parallel.pp", "parallel.ep", "train.micro_batch_size", "train.global_batch_tokens")


def global_batch(config: RunConfig, tokens: int | None) -> tuple[int, str]:
    """(tokens a step, where the number comes from): --global-batch-tokens, the config's
    train.global_batch_tokens, else GLOBAL_BATCH_TOKENS."""
    if tokens:
        return tokens, "--global-batch-tokens"
    if config.train.global_batch_tokens:
        return config.train.global_batch_tokens, "the config's train.global_batch_tokens"
    return GLOBAL_BATCH_TOKENS, "the planner's default; the config sets none"


def default_expert_load(config: RunConfig) -> float:
    """1 for `moe.routing: random` (uniform experts), else LEARNED_EXPERT_LOAD."""
    return 1.0 if config.moe.routing == "random" else LEARNED_EXPERT_LOAD


@dataclass(frozen=True)
class Ranked:
    """One row of the ranking: the modelled step (`row`) of a variant at a layout, the config
    `train` runs for it and the `--set` items that make that config from the planned one."""

    row: Row
    variant: Variant
    layout: Layout
    config: RunConfig
    overrides: tuple[str, ...]
    peak_stage: int  # the pipeline stage whose ranks hold the most
    expert_rows: ExpertRows

    @property
    def family(self) -> str:
        if self.variant.fsdp:
            return "HSDP" if self.variant.hsdp else "FSDP2"
        return "resident experts" if self.layout.ep > 1 else "all experts on each GPU"

    @property
    def optimizer(self) -> str:
        if self.variant.fsdp:
            return "FSDP2 shards"
        return "ZeRO-1" if self.variant.sharded_optimizer else "AdamW, replicated"

    def describe(self) -> str:
        """The family, its degrees and options: "resident experts, ep 8, pp 2, two_chunk"."""
        v, lay = self.variant, self.layout
        parts = [self.family]
        if v.fsdp:
            if v.hsdp:
                parts.append(f"shards of {self.config.parallel.fsdp_shard_size}")
            if v.reshard != "forward":
                parts.append(f"reshard {v.reshard}")
            if v.reduce != "fp32":
                parts.append(f"{v.reduce} reduce")
            return ", ".join(parts)
        if lay.ep > 1:
            parts.append(f"ep {lay.ep}")
        if lay.pp > 1:
            parts.append(f"pp {lay.pp}" + ("" if lay.schedule == "1f1b" else f" {lay.schedule}"))
        parts += ["two_chunk"] * v.two_chunk + ["fp8 dispatch"] * (v.dispatch == "fp8")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return self.row.to_dict() | {
            "family": self.family,
            "describe": self.describe(),
            "optimizer": self.optimizer,
            "micro_batch_size": self.layout.micro_batch_size,
            "schedule": self.layout.schedule,
            "dispatcher": self.expert_rows.dispatcher,
            "expert_rows_per_layer": self.expert_rows.rows,
            "routes_per_layer": self.expert_rows.routes,
            "peak_stage": self.peak_stage,
            "overrides": list(self.overrides),
        }


@dataclass(frozen=True)
class Ranking:
    """Every row, fitting ones first and the fastest first; what was left out, and why."""

    rows: list[Ranked]
    setting: Setting
    not_ranked: tuple[str, ...]

    def best_of(self, family: str) -> Ranked | None:
        return next((r for r in self.rows if r.family == family), None)


# ---- a row's config ---------------------------------------------------------------------------
def row_settings(variant: Variant, layout: Layout, tokens: int, shard: int) -> dict[str, Any]:
    """The fields a row sets ("section.field": value); the planned config keeps the rest."""
    out: dict[str, Any] = {
        "parallel.pp": layout.pp,
        "parallel.ep": layout.ep,
        "parallel.pp_schedule": layout.schedule,
        "parallel.activation_checkpointing": layout.activation_checkpointing,
        "train.micro_batch_size": layout.micro_batch_size,
        "train.global_batch_tokens": tokens,
        "moe.overlap": "two_chunk" if variant.two_chunk else "none",
    }
    if variant.fsdp:
        return out | {
            "parallel.data_parallel": "fsdp",
            "parallel.fsdp_reshard": variant.reshard,
            "parallel.fsdp_shard_size": shard if variant.hsdp else None,
            "precision.grad_dtype": variant.reduce,
            "train.optimizer": "adamw",  # FSDP2 shards the state itself
        }
    return out | {
        "parallel.data_parallel": "ddp",
        "precision.dispatch": variant.dispatch,
        "train.optimizer": "sharded" if variant.sharded_optimizer else "adamw",
    }


def apply_settings(config: RunConfig, settings: dict[str, Any]) -> RunConfig:
    """`config` with `settings`, every section and the whole validated (a ValueError names the
    field), with `parallel.dp` left to the world size."""
    sections: dict[str, dict[str, Any]] = {"parallel": {"dp": None}}
    for key, value in settings.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    changed = {s: dataclasses.replace(getattr(config, s), **f) for s, f in sections.items()}
    return dataclasses.replace(config, **changed)


def set_items(config: RunConfig, settings: dict[str, Any]) -> tuple[str, ...]:
    """The `--set` items that turn `config` into `apply_settings(config, settings)`: the layout's
    degrees and batch always, every other setting where it changes the config."""
    items = [f"parallel.dp={config.parallel.dp}"] * (config.parallel.dp is not None)
    for key, value in settings.items():
        section, name = key.split(".")
        if key in ALWAYS_SET or getattr(getattr(config, section), name) != value:
            items.append(f"{key}={_yaml(value)}")
    return tuple(items)


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


# ---- the ranking ------------------------------------------------------------------------------
def rank(config: RunConfig, setting: Setting, **pins: Any) -> Ranking:
    """Every family's rows at `setting`'s global batch; `pins` (pp, dp, ep, micro_batch_size,
    checkpointing, schedule) fix a layout field, and a pin that fits nothing is the ValueError of
    `layout.candidate_layouts`."""
    cluster, tokens = setting.cluster, setting.global_batch_tokens
    layouts = candidate_layouts(config, cluster.num_gpus, tokens, **pins)
    notes: dict[str, None] = {}
    rows = [r for lay in layouts for r in _ddp_rows(config, setting, lay, notes)]
    flat = [lay for lay in layouts if lay.pp == lay.ep == 1]
    if not flat:
        notes[
            "FSDP2 and HSDP: not ranked: the planner models them at pp 1 and ep 1, and no such "
            "layout is left (a pin, or a global batch that does not split over every GPU)"
        ] = None
    rows += _fsdp_rows(config, setting, flat, notes)
    rows.sort(key=_order)
    return Ranking(rows=rows, setting=setting, not_ranked=tuple(notes))


def _order(r: Ranked) -> tuple:
    """Fitting rows first, the fastest first; the others the smallest first; then the fewest
    changes to the planned config."""
    return (not r.row.fits, r.row.step_s if r.row.fits else r.row.peak_bytes, len(r.overrides))


_estimate = functools.lru_cache(maxsize=4096)(estimate)


def _ddp_rows(config, setting, layout, notes) -> list[Ranked]:
    dispatcher = resolved_dispatcher(config, layout.ep)
    if dispatcher == "local" and layout.ep > 1:
        notes["ep > 1: not ranked: moe.dispatcher local cannot move tokens between ranks"] = None
        return []
    out = []
    for variant in RESIDENT:
        if layout.ep == 1 and (variant.two_chunk or variant.dispatch == "fp8"):
            continue  # nothing is exchanged to hide or to shrink
        if variant.two_chunk and not _two_chunk_ranked(config, setting, dispatcher, notes):
            continue
        settings = row_settings(variant, layout, setting.global_batch_tokens, 1)
        try:
            run = apply_settings(config, settings)  # e.g. two_chunk needs 2 sequences
        except ValueError:
            continue
        timed = with_dispatch(config, variant.dispatch, None, None)
        est = _estimate(timed, setting.cluster, layout, setting.global_batch_tokens)
        row = resident_row(config, variant, setting, layout, est)
        stage, _ = resident_memory(config, variant, est)
        overrides = set_items(config, settings)
        out.append(Ranked(row, variant, layout, run, overrides, stage, est.expert_rows))
    return out


def _two_chunk_ranked(config, setting, dispatcher, notes) -> bool:
    """Whether two_chunk rows are worth ranking and `train` accepts them (otherwise a note)."""
    cf = config.moe.capacity_factor
    if dispatcher == "no_sync" and not keeps_every_route(
        cf, config.moe.top_k, config.moe.num_experts
    ):
        notes[
            f"moe.overlap two_chunk: not ranked: the no_sync dispatcher at moe.capacity_factor "
            f"{cf:g} drops routes, which two_chunk refuses (dropless: moe.capacity_factor null)"
        ] = None
        return False
    if setting.overlap.pairs["a2a"].eta <= 0:
        notes[
            "moe.overlap two_chunk: not ranked: the overlap pairs hide no all-to-all "
            "(--overlap; --details names the file)"
        ] = None
        return False
    return True


def _fsdp_rows(config, setting, layouts, notes) -> list[Ranked]:
    cluster = setting.cluster
    if not layouts:
        return []
    if cluster.num_gpus == 1:
        notes["FSDP2: not ranked on one GPU (FSDP2 is not applied at dp 1)"] = None
        return []
    out = []
    for variant in FSDP:
        shard = fsdp_shard(variant, cluster)
        if variant.hsdp and (cluster.num_gpus <= shard or cluster.num_gpus % shard):
            continue  # HSDP: whole nodes, more than one
        for layout in layouts:
            settings = row_settings(variant, layout, setting.global_batch_tokens, shard)
            try:
                run = apply_settings(config, settings)
            except ValueError:
                continue
            try:
                row = fsdp_row(config, variant, setting, layout)
            except ValueError as exc:  # e.g. dense layers, which the FSDP2 model does not count
                notes[f"FSDP2 and HSDP: not ranked: {exc}"] = None
                return out
            rows = expert_rows(config, 1, microbatch_tokens(config, layout))
            overrides = set_items(config, settings)
            out.append(Ranked(row, variant, layout, run, overrides, 0, rows))
    return out
