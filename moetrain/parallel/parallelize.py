"""The parallelization recipe: ordered transforms of a built model, each in place and keeping
parameter names (checkpoints and parameter groups see the same names under every layout).

    1. pipeline split            pp > 1: keep only this rank's stages (the schedule is built on
                                 the materialized model: pipeline.Pipeline)
    2. expert parallelism        shard experts over ep, install the dispatcher (apply_ep)
    3. precision                 install the precision plan: each module's GEMMs, the LM head's
                                 products, the dispatchers' payload (parallel/precision.py)
    4. two-chunk overlap         moe.overlap two_chunk: each MoE block's forward on two chunks,
                                 its all-to-alls under the other chunk's compute
                                 (overlap.apply_two_chunk)
    5. activation checkpointing  recompute blocks ("full") or MoE layers ("moe") in backward
    6. torch.compile             each block on its own
    7. FSDP2                     parallel.data_parallel == "fsdp" (ddp: the optimizer's
                                 GradientSync instead), reducing in the plan's reduce dtype

The split comes first, so later steps touch only this rank's layers; EP changes parameter shapes
and the dispatchers later steps wrap; the precision plan goes into the dispatchers EP installed
and before any compile traces a module; the overlap replaces block forwards that checkpointing
then wraps; checkpointing goes inside the compiled region; FSDP owns the final parameters
(torchtitan's order). The trainer resolves the precision plan once, before it builds the model
(`resolve_precision`), and casts the parameters to the plan's dtype. With fsdp, initialize before
`parallelize` for the single-process weights of a seed.
"""

from __future__ import annotations

import contextlib
import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from moetrain.config import RunConfig
from moetrain.model.transformer import Transformer
from moetrain.moe.layer import MoELayer
from moetrain.moe.recompute import ForwardTape, recomputing, recording
from moetrain.parallel.comm import all_reduce_counts, traceable
from moetrain.parallel.data import apply_fsdp
from moetrain.parallel.expert import apply_ep
from moetrain.parallel.mesh import ParallelDims
from moetrain.parallel.overlap import apply_two_chunk
from moetrain.parallel.pipeline import pipeline_layout, split_model
from moetrain.parallel.precision import (
    PrecisionPlan,
    apply_precision,
    default_param_dtype,
    plan_precision,
)


def parallelize(
    model: Transformer,
    config: RunConfig,
    dims: ParallelDims,
    precision: PrecisionPlan | None = None,
) -> Transformer:
    """The recipe (module docstring). `precision`: the plan the trainer resolved at start-up;
    None plans `config.precision` here, for `dims.device` (the parameters' dtype is the
    caller's to check and cast: `resolve_param_dtype`)."""
    if precision is None:
        precision = plan_precision(config, dims.device, default_param_dtype(config, dims.device))
    compile_blocks = config.parallel.compiles(dims.device.type)
    if dims.pp > 1:
        if compile_blocks and config.parallel.pp_schedule == "zero_bubble":
            raise ValueError(
                "parallel.pp_schedule (zero_bubble) cannot run compiled blocks: torch's "
                "zero-bubble schedules split each backward into input and weight passes, which "
                "a compiled region does not support; set parallel.compile=false"
            )
        split_model(model, pipeline_layout(config, dims.dp), dims.pp_rank)
    apply_ep(model, dims, config)
    apply_precision(model, precision)
    apply_two_chunk(model, config, dims)
    apply_dp_load_balance(model, config, dims)
    apply_activation_checkpointing(model, config.parallel.activation_checkpointing)
    if compile_blocks:
        apply_compile(model)
    if config.parallel.data_parallel == "fsdp":
        apply_fsdp(model, dims, config, precision.reduce_dtype)
    return model


def apply_dp_load_balance(model: Transformer, config: RunConfig, dims: ParallelDims) -> None:
    """moe.lb_scope "micro_batch_dp": the balance loss's fractions f_e use the micro-batch's route
    counts summed over the stage's data-parallel ranks (one small all-reduce per layer and
    micro-batch)."""
    if config.moe.lb_scope != "micro_batch_dp" or dims.dp_group is None:
        return
    traced = traceable(dims.dp_group, dims.device)
    reducer = functools.partial(all_reduce_counts, group=dims.dp_group, traced=traced)
    for layer in model.modules():
        if isinstance(layer, MoELayer):
            layer.count_reducer = reducer


def _recompute_contexts() -> tuple[contextlib.AbstractContextManager, ...]:
    # One tape per checkpointed call: the forward records its random-routing draws on it, the
    # recompute replays them; it runs under `recomputing()`, so statistics count routes once.
    tape = ForwardTape()
    return recording(tape), recomputing(tape)


def _checkpoint_forward(module: nn.Module) -> None:
    """Replace the instance's forward with a non-reentrant checkpoint of it (names unchanged)."""
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed_forward(*args, **kwargs):
        return checkpoint(
            forward, *args, use_reentrant=False, context_fn=_recompute_contexts, **kwargs
        )

    module.forward = checkpointed_forward


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """ "full": recompute each block; "moe": recompute each MoE layer (router, dispatch, experts
    and combine, collectives included: they run again in backward); "none": nothing."""
    if mode == "none":
        return
    for block in model.blocks.values():
        if mode == "full":
            _checkpoint_forward(block)
        elif isinstance(block.ffn, MoELayer):
            _checkpoint_forward(block.ffn)


def apply_compile(model: Transformer) -> None:
    """Compile each block on its own (small regions; the exact-split dispatcher's graph breaks
    stay inside the MoE layer), and the final norm (eager, its fp32 formula is ten kernels)."""
    for block in model.blocks.values():
        block.compile()
    if model.norm is not None:
        model.norm.compile()
