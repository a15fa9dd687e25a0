"""Whole-step estimates and the search: `estimate` combines the stages of one layout into a step
time (the slowest stage paces the pipeline, plus the schedule's bubble, the gradient sync and the
optimizer); `plan` estimates every candidate layout and ranks them, those that fit first, then the
fastest first.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from moetrain.config import RunConfig
from moetrain.model.flops import flops_per_token
from moetrain.tools.plan.layout import (
    GIB,
    Cluster,
    Layout,
    candidate_layouts,
    default_global_batch_tokens,
    microbatch_tokens,
    num_microbatches,
    validate_layout,
)
from moetrain.tools.plan.memory import ExpertRows, expert_rows
from moetrain.tools.plan.timing import StageEstimate, bubble_microbatches, stage_estimate


@dataclass(frozen=True)
class Estimate:
    """One layout's step: the slowest stage's parts summed over micro-batches, and the peak."""

    layout: Layout
    num_microbatches: int
    stages: list[StageEstimate]
    step_s: float
    matmul_s: float  # the slowest stage's, summed over micro-batches
    elementwise_s: float
    comm_s: float
    bubble_s: float
    grad_sync_s: float
    optimizer_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float  # model FLOPs (flops.py), recomputation not counted
    mfu: float  # against the datasheet dense BF16 peak
    memory_limit: int
    expert_rows: ExpertRows  # one rank's expert buffer per MoE layer and micro-batch

    @functools.cached_property
    def peak_stage(self) -> StageEstimate:
        return max(self.stages, key=lambda s: s.memory.peak)

    @property
    def peak_memory(self) -> int:
        return self.peak_stage.memory.peak

    @property
    def fits(self) -> bool:
        return self.peak_memory <= self.memory_limit

    def to_dict(self) -> dict[str, Any]:
        peak = self.peak_stage
        busiest = max(self.stages, key=lambda s: s.traffic.total)
        return {
            "layout": dataclasses.asdict(self.layout),
            "num_microbatches": self.num_microbatches,
            "step_s": self.step_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "fits": self.fits,
            "peak_memory_gib": self.peak_memory / GIB,
            "dispatcher": self.expert_rows.dispatcher,
            "expert_rows_per_layer": self.expert_rows.rows,
            "routes_per_layer": self.expert_rows.routes,
            "time_s": {
                "matmul": self.matmul_s,
                "elementwise": self.elementwise_s,
                "all_to_all_and_pipeline": self.comm_s,
                "bubble": self.bubble_s,
                "grad_sync": self.grad_sync_s,
                "optimizer": self.optimizer_s,
            },
            "peak_stage": peak.stage,
            "memory_bytes": dataclasses.asdict(peak.memory) | {"peak": peak.memory.peak},
            "params_per_gpu": {"dense": peak.params.dense, "experts": peak.params.experts},
            "busiest_stage": busiest.stage,
            "traffic_bytes_per_step": dataclasses.asdict(busiest.traffic),
        }


def estimate(
    config: RunConfig, cluster: Cluster, layout: Layout, global_batch_tokens: int
) -> Estimate:
    """Memory, traffic and step time of one layout (validated first): the step of docs/plan.md's
    time model, nothing overlapped."""
    validate_layout(config, layout, cluster.num_gpus, global_batch_tokens)
    num_micro = num_microbatches(config, layout, global_batch_tokens)
    stages = [stage_estimate(config, cluster, layout, s, num_micro) for s in range(layout.pp)]
    critical = max(stages, key=lambda st: st.microbatch_s)
    bubble = bubble_microbatches(layout) * critical.microbatch_s
    grad_sync = max(st.grad_sync_s for st in stages)
    optimizer = max(st.optimizer_s for st in stages)
    step = num_micro * critical.microbatch_s + bubble + grad_sync + optimizer
    tokens_per_gpu = global_batch_tokens / step / cluster.num_gpus
    tflops = flops_per_token(config) * tokens_per_gpu / 1e12
    return Estimate(
        layout=layout,
        num_microbatches=num_micro,
        stages=stages,
        step_s=step,
        matmul_s=num_micro * critical.microbatch_matmul_s,
        elementwise_s=num_micro * critical.microbatch_elementwise_s,
        comm_s=num_micro * critical.microbatch_comm_s,
        bubble_s=bubble,
        grad_sync_s=grad_sync,
        optimizer_s=optimizer,
        tokens_per_s_per_gpu=tokens_per_gpu,
        tflops_per_gpu=tflops,
        mfu=tflops / cluster.gpu.bf16_tflops,
        memory_limit=cluster.memory_bytes,
        expert_rows=expert_rows(config, layout.ep, microbatch_tokens(config, layout)),
    )


def plan(
    config: RunConfig,
    cluster: Cluster,
    global_batch_tokens: int | None = None,
    **pins: Any,
) -> list[Estimate]:
    """Estimates of every candidate layout: fitting ones first, fastest first."""
    tokens = global_batch_tokens or default_global_batch_tokens(config, cluster.num_gpus)
    layouts = candidate_layouts(config, cluster.num_gpus, tokens, **pins)
    estimates = [estimate(config, cluster, layout, tokens) for layout in layouts]
    return sorted(estimates, key=lambda e: (not e.fits, e.step_s, e.peak_memory))
