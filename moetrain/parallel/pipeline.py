"""Pipeline parallelism: this rank's stages of the model, run by a torch.distributed.pipelining
schedule (gpipe, 1f1b, interleaved_1f1b, zero_bubble), with expert and data parallelism inside
every stage. docs/design.md ("Pipeline stages are the model minus what they do not own") gives
the split, the loss and gradient scaling, and what is not combined.

Contract: kept modules keep their global names (optimizer states and checkpoints reshard across
pipeline layouts); `forward_backward` returns the same loss on every stage (summed over pp);
`gather_moe_stats` gives every rank every layer's routing statistics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from moetrain.config import RunConfig
from moetrain.model.stages import INTERLEAVED_CHUNKS, stage_layer_ranges
from moetrain.model.transformer import Transformer
from moetrain.moe.layer import MoELayer
from moetrain.parallel.mesh import ParallelDims

Batch = tuple[torch.Tensor, torch.Tensor]

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": INTERLEAVED_CHUNKS, "zero_bubble": 1}
# Schedules that run several forwards before the first backward need a micro-batch per stage.
NEEDS_MICROBATCH_PER_RANK = ("1f1b", "interleaved_1f1b", "zero_bubble")


@dataclass(frozen=True)
class PipelineLayout:
    """The validated split: which layers each stage holds and how a step is micro-batched."""

    pp: int
    schedule: str
    stages_per_rank: int
    layers: tuple[range, ...]  # layer range of each stage, in global stage order
    accum_steps: int  # loader micro-batches per step (and per data-parallel rank)
    num_microbatches: int  # pipeline micro-batches per step
    microbatch_size: int  # sequences per pipeline micro-batch

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        return list(range(pp_rank, self.num_stages, self.pp))


def pipeline_layout(config: RunConfig, dp: int) -> PipelineLayout:
    """The split and micro-batching for `config` at data-parallel degree `dp`, or a ValueError
    naming the config fields (each rule's why is in its message)."""
    p, m = config.parallel, config.model
    v = STAGES_PER_RANK[p.pp_schedule]
    num_stages = p.pp * v
    if num_stages > m.num_layers:
        raise ValueError(
            f"parallel.pp ({p.pp}) x {v} stage(s) per rank (parallel.pp_schedule "
            f"{p.pp_schedule}) = {num_stages} pipeline stages must be <= model.num_layers "
            f"({m.num_layers}): every stage needs at least one layer"
        )
    accum = config.grad_accum_steps(dp)
    sequences = accum * config.train.micro_batch_size
    num_micro = p.pp_microbatches or accum
    if sequences % num_micro:
        raise ValueError(
            f"parallel.pp_microbatches ({num_micro}) must divide the sequences of a step per "
            f"data-parallel rank: {accum} accumulation step(s) x train.micro_batch_size "
            f"({config.train.micro_batch_size}) = {sequences}"
        )
    if p.pp_schedule in NEEDS_MICROBATCH_PER_RANK and num_micro < p.pp:
        default = "" if p.pp_microbatches else ", the accumulation steps"
        raise ValueError(
            f"parallel.pp_microbatches ({num_micro}{default}) must be >= parallel.pp "
            f"({p.pp}) for parallel.pp_schedule {p.pp_schedule}; "
            "raise train.global_batch_tokens or parallel.pp_microbatches, or use gpipe"
        )
    rounds = max(1, num_micro // p.pp)
    if p.pp_schedule in ("interleaved_1f1b", "zero_bubble") and num_micro % rounds:
        raise ValueError(
            f"parallel.pp_microbatches ({num_micro}) must be a multiple of "
            f"parallel.pp_microbatches // parallel.pp ({rounds}) for parallel.pp_schedule "
            f"{p.pp_schedule} (torch runs that many rounds of micro-batches)"
        )
    if p.pp > 1 and m.tie_embeddings:
        raise ValueError(
            "model.tie_embeddings (True) is not supported with parallel.pp > 1: the first and "
            "last stages would need a shared embedding kept in sync; untie it"
        )
    if p.pp_schedule == "zero_bubble" and p.activation_checkpointing != "none":
        # torch's non-reentrant checkpoint would re-enter our recompute context, which fails.
        raise ValueError(
            f"parallel.activation_checkpointing ({p.activation_checkpointing}) cannot be "
            "combined with parallel.pp_schedule zero_bubble, whose separate weight-gradient "
            "pass would recompute every checkpointed region twice; use none, or another schedule"
        )
    if p.pp > 1 and p.data_parallel == "fsdp":
        raise ValueError(
            "parallel.data_parallel (fsdp) is not supported with parallel.pp > 1; use ddp "
            "(optionally with train.optimizer sharded)"
        )
    return PipelineLayout(
        pp=p.pp,
        schedule=p.pp_schedule,
        stages_per_rank=v,
        layers=tuple(stage_layer_ranges(m.num_layers, num_stages)),
        accum_steps=accum,
        num_microbatches=num_micro,
        microbatch_size=sequences // num_micro,
    )


def split_model(model: Transformer, layout: PipelineLayout, pp_rank: int) -> None:
    """Delete, in place, every module none of this rank's stages owns (do it on the meta model,
    before anything is allocated). Kept blocks keep their global keys."""
    stages = layout.stages_of_rank(pp_rank)
    keep = {str(i) for s in stages for i in layout.layers[s]}
    for key in [k for k in model.blocks if k not in keep]:
        del model.blocks[key]
    if 0 not in stages:
        model.embed = None
    if layout.num_stages - 1 not in stages:
        model.norm, model.lm_head = None, None


class StageModule(nn.Module):
    """One stage of a split Transformer, made of the model's own module objects (no copies).
    It holds the LM head on the last stage although the loss, not `forward`, uses it: the
    zero-bubble weight pass differentiates exactly `stage.submod.parameters()`."""

    def __init__(self, model: Transformer, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = model.embed if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[str(i)] for i in layers})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.config = model.config

    forward = Transformer.forward  # the same math: embed if held -> blocks -> norm if held
    _documents = Transformer._documents


class _Stage(PipelineStage):
    """A PipelineStage whose backward passes but the step's last run under `no_sync`. torch's
    zero-bubble weight pass writes `.grad` itself, bypassing the post-accumulate-grad hooks that
    add each micro-batch into the fp32 buffers (micro-batches would sum in bf16): after each
    weight pass the stage runs those hooks, as AccumulateGrad would have."""

    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        quiet = self.no_sync is not None and not last_backward
        with self.no_sync() if quiet else contextlib.nullcontext():
            result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            if backward_type == "weight":
                for param in self.submod.parameters():
                    hooks = param._post_accumulate_grad_hooks
                    if param.grad is not None and hooks:
                        for hook in list(hooks.values()):
                            hook(param)
        return result


class Pipeline:
    """This rank's stages of a split, parallelized and materialized model, and the schedule that
    runs them. Build after the model's weights exist (and before the optimizer, as usual)."""

    def __init__(self, model: Transformer, config: RunConfig, dims: ParallelDims) -> None:
        self.model, self.config, self.dims = model, config, dims
        self.layout = layout = pipeline_layout(config, dims.dp)
        stage_ids = layout.stages_of_rank(dims.pp_rank)
        self.has_first, self.has_last = 0 in stage_ids, layout.num_stages - 1 in stage_ids
        dtype = next(model.parameters()).dtype
        shape = (layout.microbatch_size, config.train.seq_len)
        tokens = torch.empty(shape, dtype=torch.long, device="meta")
        hidden = torch.empty(
            (*shape, config.model.d_model), dtype=dtype, device="meta", requires_grad=True
        )
        self.stages = [
            _Stage(
                StageModule(model, layout.layers[s], s == 0, s == layout.num_stages - 1),
                s,
                layout.num_stages,
                dims.device,
                input_args=tokens if s == 0 else hidden,
                output_args=hidden,
                group=dims.pp_group,
            )
            for s in stage_ids
        ]
        schedule_cls = SCHEDULES[layout.schedule]
        multi = schedule_cls in (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)
        self.schedule = schedule_cls(
            self.stages if multi else self.stages[0],
            layout.num_microbatches,
            loss_fn=self._loss,
            scale_grads=False,
        )
        self._score_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        m = config.model  # a MoE layer's position among the model's MoE layers
        moe_layers = [i for i in range(m.num_layers) if not m.is_dense(i)]
        self._moe_positions = [
            moe_layers.index(int(key))
            for key, block in model.blocks.items()
            if isinstance(block.ffn, MoELayer)
        ]

    def _loss(self, h_BSD: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        if self._score_fn is not None:  # forward only (`score`)
            return self._score_fn(h_BSD, targets_BS)
        return self.model.loss(h_BSD, targets_BS) / self.layout.num_microbatches

    def _next_batch(self, batches: Iterator[Batch]) -> Batch:
        """The step's accumulation micro-batches, stacked (schedules split them themselves)."""
        micro = [next(batches) for _ in range(self.layout.accum_steps)]
        return torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])

    def _run(self, batches: Iterator[Batch], train: bool) -> list[torch.Tensor]:
        inputs_BS, targets_BS = self._next_batch(batches)
        args = (inputs_BS,) if self.has_first else ()
        # document masking: every stage derives the documents from the token ids, which every
        # rank has read (schedules hand keyword arguments to every stage, split per micro-batch)
        kwargs = {"input_ids": inputs_BS} if self.config.data.document_masking else {}
        target = targets_BS if self.has_last else None
        losses: list[torch.Tensor] = []
        run = self.schedule.step if train else self.schedule.eval
        run(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        return losses  # empty except on the last stage

    def forward_backward(
        self,
        batches: Iterator[Batch],
        no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
    ) -> torch.Tensor:
        """One step's forward and backward over this rank's stages. Returns the mean loss of
        the step's batch (this data-parallel rank's share) on every rank, as a device tensor."""
        for stage in self.stages:
            stage.no_sync = no_sync
        for layer in self.model.moe_layers():
            layer.aux_grad_scale = 1.0 / self.layout.num_microbatches
        losses = self._run(batches, train=True)
        if not losses:  # not the last stage: it contributes zero to the sum over pp
            return self._sum_over_stages(torch.zeros((), device=self.dims.device))
        return self._sum_over_stages(torch.stack([loss.detach() for loss in losses]).sum())

    @torch.no_grad()
    def score(
        self,
        batches: Iterator[Batch],
        num_steps: int,
        score_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> list[torch.Tensor]:
        """Forward only, `num_steps` steps of `accum_steps` loader micro-batches each: the last
        stage's `score_fn(h_BSD, targets)` of every pipeline micro-batch (targets as the loader
        gave them, split with the inputs); an empty list on other ranks."""
        was_training = self.model.training
        self.model.eval()
        self._score_fn = score_fn
        try:
            return [s for _ in range(num_steps) for s in self._run(batches, train=False)]
        finally:
            self._score_fn = None
            self.model.train(was_training)

    def _sum_over_stages(self, value: torch.Tensor) -> torch.Tensor:
        value = value.float()
        if self.dims.pp_group is not None:
            dist.all_reduce(value, group=self.dims.pp_group)
        return value

    @torch.no_grad()
    def gather_moe_stats(self, stats: list[dict[str, torch.Tensor]]) -> list[dict[str, Any]]:
        """Routing statistics of this rank's MoE layers (`MoELayer.read_stats()` and
        "max_mean_peak", in `model.moe_layers()` order, "dropped" optional) -> those of every
        MoE layer of the model, in model order, on every rank: one all-reduce over pp (each
        layer lives on one stage)."""
        num_experts = self.config.moe.num_experts
        num_moe = self.config.model.num_layers - self.config.model.num_dense
        scalars = ("lb_loss", "z_loss", "entropy", "max_mean_peak", "dropped")
        width = num_experts + len(scalars) + 1  # the last column flags "dropped" present
        rows = torch.zeros(num_moe, width, dtype=torch.float64, device=self.dims.device)
        for position, layer in zip(self._moe_positions, stats, strict=True):
            rows[position, :num_experts] = layer["tokens_per_expert"]
            for i, key in enumerate(scalars):
                if key in layer:
                    rows[position, num_experts + i] = layer[key]
            rows[position, -1] = float("dropped" in layer)
        if self.dims.pp_group is not None:
            dist.all_reduce(rows, group=self.dims.pp_group)
        has_dropped = bool(rows[:, -1].any())  # the log reads these values on the host anyway
        gathered = []
        for row in rows:
            layer = {"tokens_per_expert": row[:num_experts].to(torch.int64)}
            for i, key in enumerate(scalars):
                if key != "dropped":
                    layer[key] = row[num_experts + i]
                elif has_dropped:
                    layer[key] = row[num_experts + i].to(torch.int64)
            gathered.append(layer)
        return gathered
