"""Resident experts against FSDP2 on N GPUs of one kind: the rows of `moetrain plan`'s ranking
(plan/ranking.py) and of `moetrain bench --project`'s sweep (docs/plan.md, "Resident experts or
FSDP2?"). A row is a layout variant (`Variant`) at one layout: tokens per micro-batch per rank
and activation checkpointing, at a fixed global batch. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from moetrain.config import RunConfig
from moetrain.model.flops import flops_per_token
from moetrain.tools.plan.fsdp import fsdp_memory, fsdp_transfers
from moetrain.tools.plan.layout import GIB, Cluster, Layout, candidate_layouts
from moetrain.tools.plan.memory import ExpertRows, Memory, precision_bytes, rank_params
from moetrain.tools.plan.overlap import Pair, paired_s
from moetrain.tools.plan.rank_compute import (
    FSDP,
    RESIDENT,
    Compute,
    Setting,
    Variant,
    dispatcher_s,
    fsdp_shard,
    measured_compute,
    resident_config,
    roofline_compute,
)
from moetrain.tools.plan.run_memory import replicated_optimizer
from moetrain.tools.plan.search import Estimate, estimate
from moetrain.tools.plan.timing import bubble_microbatches, stage_estimate

BACKWARD_SHARE = 2 / 3  # of forward + backward


@dataclass(frozen=True)
class Row:
    variant: str
    gpu: str
    gpus: int
    pp: int
    dp: int
    ep: int
    tokens: int  # per micro-batch and rank
    checkpointing: str
    microbatches: int
    compute: Compute  # of one micro-batch, on the row's GPU
    comm: dict[str, float]  # seconds a step, by transfer
    bubble_s: float
    step_s: float
    peak_bytes: float
    memory_limit: float
    flops_per_token: int

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.memory_limit

    @property
    def compute_s(self) -> float:
        return self.microbatches * self.compute.forward_backward + self.compute.optimizer

    @property
    def exposed_s(self) -> float:
        return self.step_s - self.compute_s - self.bubble_s

    @property
    def tokens_per_s(self) -> float:
        """Per GPU: a stage's dp ranks each take m micro-batches a step."""
        return self.tokens * self.microbatches * self.dp / self.gpus / self.step_s

    @property
    def tflops(self) -> float:
        return self.tokens_per_s * self.flops_per_token / 1e12

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {
            "fits": self.fits,
            "tokens_per_s_per_gpu": self.tokens_per_s,
            "tflops_per_gpu": self.tflops,
            "peak_gib": self.peak_bytes / GIB,
            "exposed_comm_s": self.exposed_s,
        }


# ---- rows ---------------------------------------------------------------------------------------
def _mixed(a: float, pa: Pair, b: float, pb: Pair) -> Pair:
    """One pair for two transfers under one window, weighted by their seconds."""
    if a + b == 0:
        return pa
    return Pair((a * pa.sigma + b * pb.sigma) / (a + b), (a * pa.eta + b * pb.eta) / (a + b))


def busiest_rank_load(rows: ExpertRows, load: float, ep: int) -> tuple[float, float]:
    """(expert products, all-to-alls) of the busiest rank, which gets `load` x T K routed rows,
    over the estimate's: the exact-split dispatcher computes and receives them all; NoSync's
    fixed blocks travel whole and cap the rows a rank computes at their size."""
    if ep == 1:
        return 1.0, 1.0
    if rows.dispatcher == "no_sync":
        return min(load, rows.rows / rows.routes), 1.0
    return load, load


def resident_row(
    config: RunConfig, variant: Variant, setting: Setting, layout: Layout, est: Estimate
) -> Row:
    """A resident row from the planner's estimate of `layout` (on the row's cluster, with the
    row's config: `resident_config`)."""
    cluster, pairs = setting.cluster, setting.overlap.pairs
    stage = max(est.stages, key=lambda s: s.microbatch_s)
    expert_load, a2a_load = busiest_rank_load(est.expert_rows, setting.expert_load, layout.ep)
    if setting.measured:
        compute = measured_compute(config, setting, variant, layout)
    else:
        roof = roofline_compute(stage, expert_load)
        tokens = layout.micro_batch_size * config.train.seq_len
        index, sync = dispatcher_s(config, setting, variant, layout, tokens)
        compute = dataclasses.replace(roof, memory=roof.memory + index, idle=sync)
    a2a = stage.microbatch_all_to_all_s * a2a_load
    sends = stage.microbatch_comm_s - stage.microbatch_all_to_all_s
    fb = compute.forward_backward
    busy = paired_s(fb, a2a, pairs["a2a"]) if variant.two_chunk else fb + a2a
    microbatch = busy + sends
    b = precision_bytes(config)
    params = rank_params(config, pp=layout.pp, ep=layout.ep, stage=stage.stage)
    links, groups = (
        cluster.links,
        ((params.dense, layout.dp, 1), (params.experts, layout.expert_dp, layout.ep)),
    )
    if variant.sharded_optimizer:
        reduce = sum(links.reduce_scatter_s(n * b.grad, g, s) for n, g, s in groups)
        gather = sum(links.all_gather_s(n * b.param, g, s) for n, g, s in groups)
    else:
        reduce, gather = sum(links.all_reduce_s(n * b.grad, g, s) for n, g, s in groups), 0.0
    window = BACKWARD_SHARE * fb
    reduce_exposed = paired_s(window, reduce, pairs["fsdp_reduce_scatter"]) - window
    m = est.num_microbatches
    bubble = bubble_microbatches(layout) * microbatch
    _, memory = resident_memory(config, variant, est)
    return Row(
        variant=variant.name,
        gpu=cluster.gpu.name,
        gpus=cluster.num_gpus,
        pp=layout.pp,
        dp=layout.dp,
        ep=layout.ep,
        tokens=layout.micro_batch_size * config.train.seq_len,
        checkpointing=layout.activation_checkpointing,
        microbatches=m,
        compute=compute,
        comm={
            "all-to-alls": m * a2a,
            "pipeline sends": m * sends,
            "gradient reduction": reduce,
            "parameter all-gather": gather,
        },
        bubble_s=bubble,
        step_s=m * microbatch + bubble + reduce_exposed + gather + compute.optimizer,
        peak_bytes=memory.peak,
        memory_limit=cluster.memory_bytes,
        flops_per_token=flops_per_token(config),
    )


def resident_memory(config: RunConfig, variant: Variant, est: Estimate) -> tuple[int, Memory]:
    """(stage, bytes) of the stage at the peak: ShardedAdamW's buffers (the planner's), or the
    replicated AdamW's whole master and moments with GradientSync's buffers (accumulate mode:
    `precision.grad_dtype`), as `run_memory` counts them for the row's config."""
    if variant.sharded_optimizer:
        return est.peak_stage.stage, est.peak_stage.memory
    stages = [(s.stage, replicated_optimizer(config, s.memory, s.params)) for s in est.stages]
    return max(stages, key=lambda sm: sm[1].peak)


def layout_memory(
    config: RunConfig, variant: Variant, layout: Layout, cluster: Cluster, expert_load: float
) -> Memory:
    """What a rank of `variant` holds at `layout` (one micro-batch a step), by the rows' memory
    models (bench's multirank memory check)."""
    if variant.fsdp:
        reduce_bytes = fsdp_reduce_bytes(config, variant)
        return fsdp_memory(
            config,
            layout,
            layout.dp,
            reshard=variant.reshard,
            reduce_bytes=reduce_bytes,
            overhead=int(cluster.overhead_gib * GIB),
            activation_factor=cluster.activation_factor,
        )
    setting = Setting(cluster=cluster, expert_load=expert_load)
    cfg = resident_config(config, variant, setting, layout.ep)
    tokens = layout.micro_batch_size * config.train.seq_len * layout.dp
    return resident_memory(config, variant, estimate(cfg, cluster, layout, tokens))[1]


def fsdp_reduce_bytes(config: RunConfig, variant: Variant) -> int:
    """Bytes of a reduced gradient element: fp32, or for bf16 the parameters' dtype (FSDP2's
    reduce dtype is then the parameters')."""
    return 4 if variant.reduce == "fp32" else precision_bytes(config).param


def fsdp_row(config: RunConfig, variant: Variant, setting: Setting, layout: Layout) -> Row:
    """An FSDP2 / HSDP row at `layout` (pp 1, dp = N, ep 1): plan/fsdp.py's transfers and
    memory around the rank's compute."""
    cluster, pairs = setting.cluster, setting.overlap.pairs
    gpus = cluster.num_gpus
    shard = fsdp_shard(variant, cluster)
    m = setting.global_batch_tokens // (layout.micro_batch_size * config.train.seq_len * gpus)
    if setting.measured:
        compute = measured_compute(config, setting, variant, layout)
    else:  # the planner's update covers 1 / N of the parameters, HSDP's 1 / shard
        roof = roofline_compute(stage_estimate(config, cluster, layout, 0, m), 1.0)
        compute = dataclasses.replace(roof, optimizer=roof.optimizer * gpus / shard)
    reduce_bytes = fsdp_reduce_bytes(config, variant)
    kw = {"reshard": variant.reshard, "reduce_bytes": reduce_bytes, "shard": shard}
    transfers = fsdp_transfers(config, cluster.links, gpus, **kw)
    fb = compute.forward_backward
    forward, backward = (1 - BACKWARD_SHARE) * fb, BACKWARD_SHARE * fb
    step, gathers, reductions = compute.optimizer, 0.0, 0.0
    kinds = sorted({0, min(1, m - 1), m - 1})
    for i in kinds:
        count = m - 2 if (i == 1 and m > 2) else 1
        root, fwd, bwd, red, last = transfers.of_microbatch(i, m)
        pair = _mixed(bwd, pairs["fsdp_gather"], red, pairs["fsdp_reduce_scatter"])
        t = (
            root
            + paired_s(forward, fwd, pairs["fsdp_gather"])
            + paired_s(backward, bwd + red, pair)
        )
        step += count * (t + last)
        gathers += count * (root + fwd + bwd)
        reductions += count * (red + last)
    memory = fsdp_memory(
        config,
        layout,
        gpus,
        overhead=int(cluster.overhead_gib * GIB),
        activation_factor=cluster.activation_factor,
        **kw,
    )
    return Row(
        variant=variant.name,
        gpu=cluster.gpu.name,
        gpus=gpus,
        pp=1,
        dp=gpus,
        ep=1,
        tokens=layout.micro_batch_size * config.train.seq_len,
        checkpointing=layout.activation_checkpointing,
        microbatches=m,
        compute=compute,
        comm={"all-gathers": gathers, "gradient reductions": reductions},
        bubble_s=0.0,
        step_s=step,
        peak_bytes=memory.peak,
        memory_limit=cluster.memory_bytes,
        flops_per_token=flops_per_token(config),
    )


# ---- the sweep ----------------------------------------------------------------------------------
def sweep(
    config: RunConfig,
    setting: Setting,
    variants: tuple[Variant, ...] = (*RESIDENT, *FSDP),
    *,
    pp: int | None = None,
    ep: int | None = None,
) -> list[Row]:
    """Every variant at every (tokens, checkpointing) point; resident rows at the fastest
    (fitting, else smallest) planner layout of the point, `pp` and `ep` pinned when given
    (measured compute pins pp 1, ep N: the layout measured)."""
    gpus = setting.cluster.num_gpus
    rows = []
    for tokens in setting.microbatch_tokens:
        if tokens % config.train.seq_len:
            continue
        mb = tokens // config.train.seq_len
        for ckpt in setting.checkpointing:
            for variant in variants:
                if variant.fsdp:
                    if variant.hsdp and gpus <= setting.cluster.gpus_per_node:
                        continue
                    if setting.global_batch_tokens % (tokens * gpus):
                        continue
                    layout = Layout(
                        pp=1, dp=gpus, ep=1, micro_batch_size=mb, activation_checkpointing=ckpt
                    )
                    rows.append(fsdp_row(config, variant, setting, layout))
                    continue
                point = _best_resident(config, variant, setting, mb, ckpt, pp, ep)
                if point is not None:
                    rows.append(point)
    return rows


_estimate = functools.lru_cache(maxsize=1024)(estimate)  # variants share a layout's estimate


def _best_resident(config, variant, setting, mb, ckpt, pp, ep) -> Row | None:
    cluster, tokens = setting.cluster, setting.global_batch_tokens
    probe = resident_config(config, variant, setting, 2)
    try:
        layouts = candidate_layouts(
            probe, cluster.num_gpus, tokens, pp=pp, ep=ep, micro_batch_size=mb, checkpointing=ckpt
        )
    except ValueError:
        return None
    rows = []
    for layout in (lay for lay in layouts if lay.ep > 1):  # experts spread over ranks
        cfg = resident_config(config, variant, setting, layout.ep)
        est = _estimate(cfg, cluster, layout, tokens)
        rows.append(resident_row(config, variant, setting, layout, est))
    return min(rows, key=_rank, default=None)


def _rank(row: Row) -> tuple[bool, float]:
    """Fitting rows first, the fastest first; rows that do not fit, the smallest first."""
    return (not row.fits, row.step_s if row.fits else row.peak_bytes)


def best(rows: list[Row]) -> dict[str, Row]:
    """Each variant's fastest fitting row, else (none fits) its smallest."""
    out: dict[str, Row] = {}
    for row in rows:
        if row.variant not in out or _rank(row) < _rank(out[row.variant]):
            out[row.variant] = row
    return out
