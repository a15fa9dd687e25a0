"""`moetrain plan`: choose a parallel layout for a model and a cluster before launching it.

For every layout family (DDP with all experts on each GPU or resident experts, FSDP2, HSDP) at
every valid layout (pp, dp, ep, micro-batch, activation checkpointing) the planner estimates per
GPU the peak memory and a step time, and ranks them in one table at one global batch, each row a
config `moetrain train` accepts. It is arithmetic on the config: nothing is built and torch is not
imported. Modules, each depending only on those before it: `links`, `layout`, `memory`,
`timing`, `search`, `calibration`, `fsdp`, `run_memory`, `compare` (with `rank_compute`,
`overlap`, `compare_report`), `ranking`, `answer`, `cli`.
docs/plan.md states the model and its assumptions. Re-exported here: the Python API of
docs/plan.md and what `moetrain.tools.dry_run` uses.
"""

from moetrain.tools.plan.cli import add_plan_parser, run_plan
from moetrain.tools.plan.layout import (
    CHECKPOINTING,
    GIB,
    GPUS,
    Cluster,
    Layout,
    default_global_batch_tokens,
    local_experts,
    microbatch_tokens,
    num_microbatches,
    rank_coordinates,
    stage_layer_ranges,
    validate_layout,
)
from moetrain.tools.plan.memory import (
    SHARD_ALIGN,
    ExpertRows,
    Memory,
    block_activation_bytes,
    expert_rows,
    layer_params,
    precision_bytes,
    rank_params,
    resolved_dispatcher,
    stage_activation_bytes,
    stage_memory,
)
from moetrain.tools.plan.search import Estimate, estimate, plan
from moetrain.tools.plan.timing import rank_muon_flops

__all__ = [
    "CHECKPOINTING",
    "GIB",
    "GPUS",
    "SHARD_ALIGN",
    "Cluster",
    "Estimate",
    "ExpertRows",
    "Layout",
    "Memory",
    "add_plan_parser",
    "block_activation_bytes",
    "default_global_batch_tokens",
    "estimate",
    "expert_rows",
    "layer_params",
    "local_experts",
    "microbatch_tokens",
    "num_microbatches",
    "plan",
    "rank_muon_flops",
    "precision_bytes",
    "rank_coordinates",
    "rank_params",
    "resolved_dispatcher",
    "run_plan",
    "stage_activation_bytes",
    "stage_layer_ranges",
    "stage_memory",
    "validate_layout",
]
