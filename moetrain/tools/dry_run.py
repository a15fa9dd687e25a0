"""Dry run of `moetrain train`: one rank's share of the model, built on the meta device.

For a layout (dp, ep, pp) and a global rank (placed as moetrain.tools.plan does), `build_rank_model`
builds the Transformer on meta and keeps what that rank would hold: its stage's layers, the
embedding on the first stage, the final norm and LM head on the last, and its num_experts / ep
experts of each MoE layer. Nothing is allocated, at any size. `dry_run` lists the parameters with
their bytes next to the planner's memory estimate for the run's data-parallel family
(`plan.run_memory`: the peak `moetrain plan` ranks a config at); the two parameter totals must
agree. With train.optimizer muon or muon_sharded each row says which optimizer updates it, the
optimizer state counts one momentum buffer for Muon's matrices (two moments for AdamW's), and
the report gives the Newton-Schulz FLOPs of one step on this rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass

import torch
from torch import nn

from moetrain.config import RunConfig
from moetrain.model.transformer import Transformer
from moetrain.moe.experts import GroupedExperts
from moetrain.optim.muon_params import matrix_layout
from moetrain.optim.param_groups import param_kind
from moetrain.tools.plan import (
    GIB,
    ExpertRows,
    Layout,
    Memory,
    default_global_batch_tokens,
    expert_rows,
    local_experts,
    microbatch_tokens,
    num_microbatches,
    precision_bytes,
    rank_coordinates,
    rank_muon_flops,
    rank_params,
    stage_layer_ranges,
    validate_layout,
)
from moetrain.tools.plan.cli import wide_console
from moetrain.tools.plan.layout import OVERHEAD_GIB
from moetrain.tools.plan.run_memory import run_memory
from moetrain.train.model_build import resolve_param_dtype


def param_dtype(config: RunConfig) -> torch.dtype:
    """The dtype parameters have on the target GPUs (auto means bf16 there): the planner's."""
    return {2: torch.bfloat16, 4: torch.float32}[precision_bytes(config).param]


def on_device(config: RunConfig, device_type: str) -> RunConfig:
    """`config` with precision.param_dtype as the trainer resolves it on `device_type`
    (`train.model_build.resolve_param_dtype`: auto is bf16 on CUDA, fp32 elsewhere), so that the dry
    run and the memory check describe the parameters a run there has."""
    dtype = resolve_param_dtype(config, torch.device(device_type))
    precision = dataclasses.replace(
        config.precision, param_dtype="bf16" if dtype == torch.bfloat16 else "fp32"
    )
    return dataclasses.replace(config, precision=precision)


def layout_from_config(config: RunConfig, world_size: int) -> Layout:
    p = config.parallel
    return Layout(
        pp=p.pp,
        dp=config.dp_size(world_size),
        ep=p.ep,
        micro_batch_size=config.train.micro_batch_size,
        activation_checkpointing=p.activation_checkpointing,
        schedule=p.pp_schedule,
    )


def keep_local_experts(experts: GroupedExperts, ids: range) -> None:
    """What `parallel.expert.apply_ep` does to the weights, without its process groups and
    dispatchers: keep the layer's experts `ids` (consecutive global ids)."""
    for name in ("w_up_eD2F", "w_down_eFD"):
        full = getattr(experts, name).detach()
        setattr(experts, name, nn.Parameter(full[ids.start : ids.stop]))
    experts.num_experts, experts.expert_offset = len(ids), ids.start


def build_rank_model(config: RunConfig, layout: Layout, rank: int) -> Transformer:
    """The modules and parameters `rank` holds, on the meta device, in the target dtype."""
    stage, _, _ = rank_coordinates(layout, rank)
    layers = stage_layer_ranges(config.model.num_layers, layout.pp)[stage]
    first, last = stage == 0, stage == layout.pp - 1
    with torch.device("meta"):
        model = Transformer(config)
        model.blocks = nn.ModuleDict({str(i): model.blocks[str(i)] for i in layers})
        if not first:
            model.embed = None
        if not last:
            model.norm, model.lm_head = None, None
        elif model.lm_head is None and not first:  # tied: the last stage keeps a copy as head
            model.lm_head = nn.Linear(config.model.d_model, config.model.vocab_size, bias=False)
    if layout.ep > 1:
        ids = local_experts(config.moe.num_experts, layout, rank)
        for layer in model.moe_layers():
            keep_local_experts(layer.experts, ids)
    return model.to(param_dtype(config))


@dataclass(frozen=True)
class ParamRow:
    name: str  # block indices collapsed: blocks.[0-12].attn.q_proj.weight
    shape: tuple[int, ...]
    dtype: str
    count: int  # how many tensors the row stands for
    bytes: int  # all of them
    kind: str  # dense, router or expert
    updated_by: str  # the optimizer of its parameters: adamw, or muon (train.optimizer muon*)


@dataclass(frozen=True)
class DryRunReport:
    config_name: str
    layout: Layout
    rank: int
    stage: int
    dp_rank: int
    ep_rank: int
    layers: range
    experts: range  # global ids of this rank's experts in each MoE layer
    rows: list[ParamRow]
    num_params: int
    param_bytes: int
    num_microbatches: int
    memory: Memory | None  # the planner's estimate for this rank (None: a layout it does not model)
    family: str  # how the rank holds its state: ZeRO-1, the replicated AdamW, FSDP2 or HSDP
    expert_rows: ExpertRows  # the rank's expert buffer per MoE layer and micro-batch
    muon_flops: int  # Newton-Schulz FLOPs of one optimizer step on this rank (0 without Muon)


def _collapse(model: nn.Module, muon: bool) -> list[ParamRow]:
    groups: dict[tuple[str, tuple[int, ...], str], list] = {}
    for name, p in model.named_parameters():
        match = re.match(r"blocks\.(\d+)\.(.*)", name)
        key_name = f"blocks.*.{match.group(2)}" if match else name
        entry = groups.setdefault((key_name, tuple(p.shape), str(p.dtype)), [])
        entry.append((int(match.group(1)) if match else None, p.numel() * p.element_size(), name))
    rows = []
    for (name, shape, dtype), items in groups.items():
        indices = [i for i, _, _ in items if i is not None]
        if indices:
            span = f"{min(indices)}" if len(indices) == 1 else f"{min(indices)}-{max(indices)}"
            name = name.replace("*", f"[{span}]")
        rows.append(
            ParamRow(
                name=name,
                shape=shape,
                dtype=dtype.removeprefix("torch."),
                count=len(items),
                bytes=sum(b for _, b, _ in items),
                kind=param_kind(items[0][2]),
                updated_by="muon" if muon and matrix_layout(items[0][2], len(shape)) else "adamw",
            )
        )
    return rows


def dry_run(
    config: RunConfig,
    layout: Layout,
    rank: int,
    global_batch_tokens: int | None = None,
    overhead_gib: float = OVERHEAD_GIB,
) -> DryRunReport:
    """Build `rank`'s model on meta and report its parameters and estimated memory."""
    tokens = global_batch_tokens or default_global_batch_tokens(config, layout.world_size)
    validate_layout(config, layout, layout.world_size, tokens)
    stage, dp_rank, ep_rank = rank_coordinates(layout, rank)
    model = build_rank_model(config, layout, rank)
    num_params = sum(p.numel() for p in model.parameters())
    expected = rank_params(config, pp=layout.pp, ep=layout.ep, stage=stage)
    assert num_params == expected.total, (num_params, expected)
    num_micro = num_microbatches(config, layout, tokens)
    try:
        memory = run_memory(config, layout, stage, num_micro, overhead=int(overhead_gib * GIB))
    except ValueError:
        memory = None
    return DryRunReport(
        config_name=config.name,
        layout=layout,
        rank=rank,
        stage=stage,
        dp_rank=dp_rank,
        ep_rank=ep_rank,
        layers=stage_layer_ranges(config.model.num_layers, layout.pp)[stage],
        experts=local_experts(config.moe.num_experts, layout, rank),
        rows=_collapse(model, config.train.optimizer in ("muon", "muon_sharded")),
        num_params=num_params,
        param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        num_microbatches=num_micro,
        memory=memory,
        family=family(config, layout),
        expert_rows=expert_rows(config, layout.ep, microbatch_tokens(config, layout)),
        muon_flops=rank_muon_flops(config, layout, stage),
    )


def family(config: RunConfig, layout: Layout) -> str:
    """How a rank of `config` holds its parameters, gradients and optimizer state."""
    p = config.parallel
    if p.data_parallel == "fsdp":
        shard = p.fsdp_shard_size or layout.dp
        kind = f"HSDP, shards of {shard}" if shard < layout.dp else f"FSDP2 over {shard} ranks"
        return f"{kind}, reshard {p.fsdp_reshard}"
    optimizer = config.train.optimizer
    if optimizer == "sharded":
        return "DDP, ShardedAdamW (ZeRO-1: optimizer state sharded)"
    if optimizer == "muon_sharded":
        return "DDP, sharded Muon (ZeRO-1: each matrix's state on one rank, AdamW's sharded)"
    if optimizer == "muon":
        return "DDP, replicated Muon and AdamW (whole optimizer state on each rank)"
    return "DDP, replicated AdamW (whole optimizer state on each rank)"


def print_dry_run(report: DryRunReport, device_type: str = "cuda") -> None:
    from rich.table import Table

    lay, layers = report.layout, report.layers
    console = wide_console()
    console.print(
        f"[bold]dry run[/bold] {report.config_name} on {device_type}: rank {report.rank} of "
        f"{lay.world_size} "
        f"(pp {lay.pp}, dp {lay.dp}, ep {lay.ep}): stage {report.stage}, layers "
        f"{layers.start}-{layers.stop - 1}, dp rank {report.dp_rank}, ep rank {report.ep_rank}, "
        f"experts {report.experts.start}-{report.experts.stop - 1} of each MoE layer"
    )
    table = Table()
    for col in ("parameter", "shape", "dtype", "tensors", "MiB", "kind", "optimizer"):
        table.add_column(col, justify="right" if col in ("tensors", "MiB") else "left")
    for row in report.rows:
        table.add_row(
            row.name,
            "x".join(map(str, row.shape)),
            row.dtype,
            str(row.count),
            f"{row.bytes / 2**20:,.1f}",
            row.kind,
            row.updated_by,
        )
    console.print(table)
    console.print(
        f"{report.num_params:,} parameters ({report.param_bytes / GIB:,.2f} GiB) before any "
        f"sharding; {report.family}."
    )
    mem = report.memory
    if mem is None:
        console.print("The planner does not model this layout's memory. Nothing was allocated.")
    else:
        console.print(
            f"Estimated peak {mem.peak / GIB:,.2f} GiB = parameters {mem.params / GIB:,.2f} + "
            f"gradients {mem.grads / GIB:,.2f} + optimizer state {mem.optimizer / GIB:,.2f} + "
            f"activations {mem.activations / GIB:,.2f} ({report.num_microbatches} micro-batches "
            f"of {lay.micro_batch_size}, checkpointing {lay.activation_checkpointing}) + "
            f"transient {mem.transient / GIB:,.2f} + overhead {mem.overhead / GIB:,.2f}. Nothing "
            "was allocated."
        )
    console.print(f"Expert buffers on this rank: {report.expert_rows.describe()}.")
    if report.muon_flops:
        console.print(
            f"Muon: {report.muon_flops / 1e12:,.2f} TFLOP of Newton-Schulz products per optimizer "
            "step on this rank; its matrices hold one fp32 momentum buffer each in the optimizer "
            "shards, AdamW's parameters two moments."
        )


def run_dry_run(config: RunConfig, args: argparse.Namespace) -> int:
    """`moetrain train --dry-run`: world size from --world-size, else parallel.dp x parallel.pp;
    the parameters as a run on --device has them (default: cuda when this machine has one, else
    cpu; a dry run may name a device this machine lacks, to plan a run elsewhere)."""
    device_type = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")).type
    config = on_device(config, device_type)
    world_size = args.world_size or (config.parallel.dp or 1) * config.parallel.pp
    report = dry_run(config, layout_from_config(config, world_size), args.rank)
    print_dry_run(report, device_type)
    return 0
