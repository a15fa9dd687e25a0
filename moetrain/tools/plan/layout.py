"""The machines and the layouts: GPU datasheets, the cluster, a parallel layout, its validation
and the enumeration of every valid one.

Rank placement (it decides which traffic stays inside a node): rank = stage * dp + dp_rank and
ep_rank = dp_rank % ep, i.e. expert-parallel groups are innermost (consecutive ranks), the replicas
of the same experts (the expert-data-parallel group, dp / ep ranks) sit ep ranks apart, and
pipeline stages are outermost (dp ranks apart). docs/plan.md states the assumptions.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from moetrain.config import RunConfig
from moetrain.model.stages import INTERLEAVED_CHUNKS, stage_layer_ranges
from moetrain.tools.plan.links import Links

GIB = 2**30
CHECKPOINTING = ("none", "moe", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
OVERHEAD_GIB = 2.0  # per GPU: CUDA context, library workspaces, communication buffers


# ---- hardware --------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPU:
    """Datasheet leads: dense TFLOP/s, HBM GB (1e9) and TB/s, GB/s per direction per GPU."""

    name: str
    bf16_tflops: float
    fp8_tflops: float
    memory_gb: float
    hbm_tbps: float
    nvlink_gbps: float
    internode_gbps: float  # default network bandwidth per GPU (one NIC per GPU)


GPUS = {
    "h100": GPU("h100", 989, 1979, 80, 3.35, 450, 50),
    "h200": GPU("h200", 989, 1979, 141, 4.8, 450, 50),
    "b200": GPU("b200", 2250, 4500, 180, 8.0, 900, 50),
    "b300": GPU("b300", 2250, 4500, 288, 8.0, 900, 100),
}


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The machines and the model's efficiency knobs. Bandwidths in GB/s (1e9 B/s) per GPU."""

    gpu: GPU
    num_gpus: int
    gpus_per_node: int = 8  # the NVLink domain
    memory_gib: float | None = None  # usable memory per GPU; None: the datasheet HBM
    nvlink_gbps: float | None = None  # None: the GPU's datasheet value
    internode_gbps: float | None = None
    # Efficiencies: shares of the datasheet peak (their basis: docs/plan.md).
    matmul_efficiency: float = 0.8  # dense BF16 products
    grouped_efficiency: float = 0.7  # the experts' grouped GEMMs
    fp8_efficiency: float = 0.5  # FP8 products (row-scaled), of the FP8 peak
    attention_efficiency: float = 0.41  # in model FLOPs (6 D S per token and layer)
    latency_us: float = 10.0  # per collective or send
    link_efficiency: float = 0.8  # share of the datasheet link bandwidth collectives reach
    overhead_gib: float = OVERHEAD_GIB
    hbm_tbps: float | None = None  # memory-bound kernels and the optimizer; None: datasheet
    activation_factor: float = 1.0  # kept activations / eager autograd's (a calibration's)

    def __post_init__(self) -> None:
        positive = (
            "num_gpus", "gpus_per_node", "matmul_efficiency", "grouped_efficiency",
            "fp8_efficiency", "link_efficiency",
        )  # fmt: skip
        for name in (*positive, "attention_efficiency", "activation_factor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"cluster {name} ({getattr(self, name)}) must be > 0")

    @property
    def memory_bytes(self) -> int:
        gib = self.memory_gib if self.memory_gib is not None else self.gpu.memory_gb * 1e9 / GIB
        return int(gib * GIB)

    @property
    def nvlink_bps(self) -> float:
        return (self.nvlink_gbps or self.gpu.nvlink_gbps) * 1e9

    @property
    def internode_bps(self) -> float:
        return (self.internode_gbps or self.gpu.internode_gbps) * 1e9

    @property
    def hbm_bps(self) -> float:
        return (self.hbm_tbps or self.gpu.hbm_tbps) * 1e12

    @property
    def links(self) -> Links:
        return Links(
            nvlink_gbps=self.nvlink_bps / 1e9,
            internode_gbps=self.internode_bps / 1e9,
            gpus_per_node=self.gpus_per_node,
            latency_us=self.latency_us,
            efficiency=self.link_efficiency,
        )


# ---- layouts ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Layout:
    """One parallel layout: world = pp x dp; ep divides dp (experts sharded inside a stage)."""

    pp: int
    dp: int
    ep: int
    micro_batch_size: int
    activation_checkpointing: str = "none"
    schedule: str = "1f1b"

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert: the size of the group that shares its gradient."""
        return self.dp // self.ep


def stage_layers(config: RunConfig, pp: int, stage: int) -> tuple[range, int, int]:
    """(layer range, number of dense-MLP layers, number of MoE layers) of a stage."""
    layers = stage_layer_ranges(config.model.num_layers, pp)[stage]
    num_dense = sum(config.model.is_dense(i) for i in layers)
    return layers, num_dense, len(layers) - num_dense


def rank_coordinates(layout: Layout, rank: int) -> tuple[int, int, int]:
    """(stage, dp_rank, ep_rank) of a global rank under the placement of the module docstring."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank ({rank}) must be in [0, {layout.world_size})")
    stage, dp_rank = divmod(rank, layout.dp)
    return stage, dp_rank, dp_rank % layout.ep


def local_experts(num_experts: int, layout: Layout, rank: int) -> range:
    """Global ids of the experts `rank` holds in each MoE layer: num_experts / ep consecutive ones,
    the ep_rank-th slice."""
    _, _, ep_rank = rank_coordinates(layout, rank)
    per_rank = num_experts // layout.ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def microbatch_tokens(config: RunConfig, layout: Layout) -> int:
    """Tokens of one micro-batch on one rank."""
    return layout.micro_batch_size * config.train.seq_len


def num_microbatches(config: RunConfig, layout: Layout, global_batch_tokens: int) -> int:
    per_step = microbatch_tokens(config, layout) * layout.dp
    if global_batch_tokens % per_step:
        raise ValueError(
            f"train.global_batch_tokens ({global_batch_tokens}) must be a multiple of "
            f"micro_batch_size * seq_len * dp ({per_step})"
        )
    return global_batch_tokens // per_step


def validate_layout(
    config: RunConfig, layout: Layout, num_gpus: int, global_batch_tokens: int
) -> None:
    """Raise a ValueError naming the field when the layout does not divide the model or cluster."""
    L, E = config.model.num_layers, config.moe.num_experts
    for name in ("pp", "dp", "ep"):
        if getattr(layout, name) < 1:
            raise ValueError(f"parallel.{name} ({getattr(layout, name)}) must be >= 1")
    if layout.micro_batch_size < 1:
        raise ValueError(f"train.micro_batch_size ({layout.micro_batch_size}) must be >= 1")
    if num_gpus % layout.pp:
        raise ValueError(f"parallel.pp ({layout.pp}) must divide the number of GPUs ({num_gpus})")
    if layout.dp * layout.pp != num_gpus:
        raise ValueError(
            f"parallel.dp ({layout.dp}) times parallel.pp ({layout.pp}) must equal the number "
            f"of GPUs ({num_gpus})"
        )
    if layout.pp > L:
        raise ValueError(f"parallel.pp ({layout.pp}) must be <= model.num_layers ({L})")
    if E % layout.ep:
        raise ValueError(f"parallel.ep ({layout.ep}) must divide moe.num_experts ({E})")
    if layout.dp % layout.ep:
        raise ValueError(f"parallel.ep ({layout.ep}) must divide parallel.dp ({layout.dp})")
    if layout.activation_checkpointing not in CHECKPOINTING:
        raise ValueError(
            f"parallel.activation_checkpointing ({layout.activation_checkpointing!r}) must be "
            f"one of {', '.join(CHECKPOINTING)}"
        )
    if layout.schedule not in SCHEDULES:
        raise ValueError(
            f"parallel.pp_schedule ({layout.schedule!r}) must be one of {', '.join(SCHEDULES)}"
        )
    if layout.schedule == "interleaved_1f1b" and layout.pp * INTERLEAVED_CHUNKS > L:
        raise ValueError(
            f"parallel.pp ({layout.pp}) times {INTERLEAVED_CHUNKS} chunks must be <= "
            f"model.num_layers ({L}) for parallel.pp_schedule interleaved_1f1b"
        )
    num_microbatches(config, layout, global_batch_tokens)


# ---- enumeration -----------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(
    config: RunConfig,
    num_gpus: int,
    global_batch_tokens: int,
    *,
    pp: int | None = None,
    dp: int | None = None,
    ep: int | None = None,
    micro_batch_size: int | None = None,
    checkpointing: str | None = None,
    schedule: str | None = None,
) -> list[Layout]:
    """Every valid layout, with the pinned values fixed. If the pins leave none, the ValueError
    of the first pinned layout says why (e.g. `parallel.ep (3) must divide moe.num_experts`)."""
    schedule = schedule or config.parallel.pp_schedule
    max_mb = max(16, config.train.micro_batch_size)
    mbs = [2**i for i in range(max_mb.bit_length())]
    mbs = mbs if micro_batch_size is None else [micro_batch_size]
    ckpts = list(CHECKPOINTING) if checkpointing is None else [checkpointing]
    pps = [d for d in _divisors(num_gpus) if d <= config.model.num_layers]
    layouts, errors = [], []
    for pp_ in pps if pp is None else [pp]:
        dp_ = num_gpus // max(pp_, 1) if dp is None else dp
        eps = _divisors(math.gcd(dp_, config.moe.num_experts)) if ep is None else [ep]
        for ep_, mb, ckpt in itertools.product(eps, mbs, ckpts):
            layout = Layout(
                pp=pp_,
                dp=dp_,
                ep=ep_,
                micro_batch_size=mb,
                activation_checkpointing=ckpt,
                schedule=schedule,
            )
            try:
                validate_layout(config, layout, num_gpus, global_batch_tokens)
            except ValueError as exc:
                errors.append(exc)
                continue
            layouts.append(layout)
    if not layouts:
        raise errors[0] if errors else ValueError(f"no layout fits {num_gpus} GPUs")
    return layouts


def default_global_batch_tokens(config: RunConfig, num_gpus: int) -> int:
    """The config's global batch, else one micro-batch of the config's size per GPU."""
    t = config.train
    return t.global_batch_tokens or t.micro_batch_size * t.seq_len * num_gpus
