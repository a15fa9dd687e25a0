"""What one rank of a run holds at its peak, by the data-parallel family its config names:
DDP with ShardedAdamW (`train.optimizer: sharded`, ZeRO-1: `memory.stage_memory`; the sharded
Muon, `muon_sharded`, alike), DDP with the replicated AdamW (`adamw`: whole master weights and
moments, GradientSync's gradient buffers; the replicated Muon, `muon`, alike), or FSDP2 / HSDP (`parallel.data_parallel: fsdp`: `fsdp.fsdp_memory`, pp 1 and ep 1 only). The
one memory model that `moetrain plan` ranks, `moetrain train --dry-run` prints and
`train.fits` checks at start-up. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses

from moetrain.config import RunConfig
from moetrain.tools.plan.fsdp import fsdp_memory
from moetrain.tools.plan.layout import Layout
from moetrain.tools.plan.memory import (
    Memory,
    RankParams,
    precision_bytes,
    rank_params,
    stage_memory,
    state_bytes_per_element,
    uses_muon,
)


def replicated_optimizer(config: RunConfig, memory: Memory, params: RankParams) -> Memory:
    """`memory` (ShardedAdamW's) with the replicated AdamW's state instead: the whole master
    and moments of the rank's parameters (with Muon, one momentum buffer for its matrices), and
    GradientSync's buffers of all its gradients."""
    b = precision_bytes(config)
    muon = params.dense_muon + params.experts if uses_muon(config) else 0
    optimizer = state_bytes_per_element(b, False) * (params.total - muon)
    optimizer += state_bytes_per_element(b, True) * muon
    return dataclasses.replace(memory, grads=b.grad * params.total, optimizer=optimizer)


def run_memory(
    config: RunConfig,
    layout: Layout,
    stage: int,
    num_micro: int,
    *,
    overhead: int,
    activation_factor: float = 1.0,
) -> Memory:
    """Bytes of a rank of pipeline stage `stage` of the run `config` describes at `layout`; a
    ValueError for what the model does not cover (FSDP2 with pp or ep, or with dense layers)."""
    if config.parallel.data_parallel == "fsdp":
        if layout.pp > 1 or layout.ep > 1:
            raise ValueError(
                f"the planner models parallel.data_parallel fsdp at pp 1 and ep 1, not at pp "
                f"{layout.pp} and ep {layout.ep}"
            )
        return fsdp_memory(
            config,
            layout,
            layout.dp,
            reshard=config.parallel.fsdp_reshard,
            reduce_bytes=precision_bytes(config).grad,
            shard=config.parallel.fsdp_shard_size,
            overhead=overhead,
            activation_factor=activation_factor,
        )
    memory = stage_memory(config, layout, stage, num_micro, overhead, activation_factor)
    if config.train.optimizer in ("sharded", "muon_sharded"):
        return memory
    params = rank_params(config, pp=layout.pp, ep=layout.ep, stage=stage)
    return replicated_optimizer(config, memory, params)
