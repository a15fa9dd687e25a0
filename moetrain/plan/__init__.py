"""`moetrain plan`: choose a parallel layout for a model and a cluster before launching it.

For every valid layout (pp, dp, ep, micro-batch, activation checkpointing) the planner estimates,
per GPU, memory at the peak, the bytes sent per step over NVLink and over the network, and the
step time of a roofline model. It is arithmetic on the config: nothing is built and torch is not
imported, so plans for trillion-parameter models take milliseconds. One concept per module, each
depending only on those before it: `links` (collective times over NVLink and the network),
`layout` (GPUs, cluster, layouts, rank placement, enumeration), `memory` (bytes per GPU), `timing`
(one stage's time and traffic), `search` (step estimates and ranking), `calibration` (measured
rates that replace the datasheet's), `compare` (the N-GPU projection's arithmetic around one
rank's measured compute), `cli` (the command). docs/plan.md states the model and its assumptions.
"""

from moetrain.plan.cli import add_plan_parser, load_config, run_plan
from moetrain.plan.layout import (
    CHECKPOINTING,
    GIB,
    GPU,
    GPUS,
    INTERLEAVED_CHUNKS,
    SCHEDULES,
    Cluster,
    Layout,
    candidate_layouts,
    default_global_batch_tokens,
    local_experts,
    microbatch_tokens,
    num_microbatches,
    rank_coordinates,
    stage_layer_ranges,
    stage_layers,
    validate_layout,
)
from moetrain.plan.memory import (
    LOSS_CHUNK_TOKENS,
    SHARD_ALIGN,
    ExpertRows,
    LayerParams,
    Memory,
    PrecisionBytes,
    RankParams,
    block_activation_bytes,
    expert_rows,
    in_flight_microbatches,
    layer_params,
    optimizer_shards,
    precision_bytes,
    rank_params,
    resolved_dispatcher,
    shard_numel,
    stage_activation_bytes,
    stage_memory,
)
from moetrain.plan.search import Estimate, estimate, plan
from moetrain.plan.timing import (
    ELEMENTWISE_PASSES,
    StageEstimate,
    Traffic,
    bubble_microbatches,
    members_per_node,
    stage_estimate,
)

__all__ = [
    "CHECKPOINTING",
    "ELEMENTWISE_PASSES",
    "GIB",
    "GPU",
    "GPUS",
    "INTERLEAVED_CHUNKS",
    "LOSS_CHUNK_TOKENS",
    "SCHEDULES",
    "SHARD_ALIGN",
    "Cluster",
    "Estimate",
    "ExpertRows",
    "LayerParams",
    "Layout",
    "Memory",
    "PrecisionBytes",
    "RankParams",
    "StageEstimate",
    "Traffic",
    "add_plan_parser",
    "block_activation_bytes",
    "bubble_microbatches",
    "candidate_layouts",
    "default_global_batch_tokens",
    "estimate",
    "expert_rows",
    "in_flight_microbatches",
    "layer_params",
    "load_config",
    "local_experts",
    "members_per_node",
    "microbatch_tokens",
    "num_microbatches",
    "optimizer_shards",
    "plan",
    "precision_bytes",
    "rank_coordinates",
    "rank_params",
    "resolved_dispatcher",
    "run_plan",
    "shard_numel",
    "stage_activation_bytes",
    "stage_estimate",
    "stage_layer_ranges",
    "stage_layers",
    "stage_memory",
    "validate_layout",
]
