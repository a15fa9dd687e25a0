"""The parallelization recipe: one ordered list of transforms applied to a built model.

    1. expert parallelism      shard experts over ep, install the EP dispatcher (apply_ep)
    2. activation checkpointing  recompute blocks ("full") or MoE layers ("moe") in backward
    3. torch.compile            each block on its own (nn.Module.compile, in place)
    4. data parallelism         FSDP2 when parallel.data_parallel == "fsdp"; for "ddp" the trainer
                                wraps its backward with data.GradientSync instead

Ordering: EP first, because it changes parameter shapes and the layers' dispatchers that the
later steps wrap; checkpointing before compile, so the compiled region includes the checkpoint;
FSDP last, because it takes ownership of the final parameters (in the order torchtitan uses).
Every transform works in place and keeps parameter names (no wrapper modules), so checkpoints
and parameter groups see the same names under every layout. Works on the meta device (before
`to_empty` + `init_weights`) and on a materialized model. One caveat for FSDP: `init_weights` on
a sharded meta model initializes DTensor shards, which does not reproduce the single-process
weights; to keep "same seed, same global weights", initialize before `parallelize` with fsdp.
"""

from __future__ import annotations

import contextlib
import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from moetrain.config import RunConfig
from moetrain.model.transformer import Transformer
from moetrain.moe.layer import MoELayer
from moetrain.moe.recompute import recomputing
from moetrain.parallel.data import apply_fsdp
from moetrain.parallel.expert import apply_ep
from moetrain.parallel.mesh import ParallelDims


def parallelize(model: Transformer, config: RunConfig, dims: ParallelDims) -> Transformer:
    apply_ep(model, dims, config)
    apply_activation_checkpointing(model, config.parallel.activation_checkpointing)
    compile_blocks = config.parallel.compile
    if compile_blocks is None:  # on CPU compile time dwarfs the gain for the models one runs there
        compile_blocks = dims.device.type == "cuda"
    if compile_blocks:
        apply_compile(model)
    if config.parallel.data_parallel == "fsdp":
        apply_fsdp(model, dims)
    return model


def _recompute_contexts() -> tuple[contextlib.AbstractContextManager, ...]:
    # The recompute runs under `recomputing()`, so dispatcher statistics count each route once.
    return contextlib.nullcontext(), recomputing()


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
    """Compile each block on its own: small regions, and the graph breaks at the dispatcher's
    collectives (comm.py hides them from dynamo) stay inside the MoE layer."""
    for block in model.blocks.values():
        block.compile()
