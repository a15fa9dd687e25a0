"""What the rows of resident experts and FSDP2 are made of: the layout variants, the
setting every row shares, and one rank's compute per micro-batch by kind (`Compute`): from the
planner's roofline on the row's GPU, or measured (`RankCompute`, bench/measure_rank.py) and
carried to each point of the sweep and to the row's GPU (docs/plan.md, "Compute"). Nothing here
imports torch.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from moetrain.config import RunConfig
from moetrain.model.flops import param_counts
from moetrain.tools.plan.layout import CHECKPOINTING, GPUS, Cluster, Layout
from moetrain.tools.plan.overlap import ASSUMED, Overlap
from moetrain.tools.plan.timing import stage_estimate

MICROBATCH_TOKENS = (4096, 8192, 16384, 32768)
GLOBAL_BATCH_TOKENS = 4 * 2**20
KINDS = ("experts", "products", "memory", "idle")


@dataclass(frozen=True, kw_only=True)
class Variant:
    """A layout as users run it: resident experts (`fsdp` False) or FSDP2 / HSDP."""

    name: str
    fsdp: bool = False
    sharded_optimizer: bool = True  # resident: ShardedAdamW, else the replicated AdamW
    two_chunk: bool = False  # resident: moe.overlap two_chunk hides all-to-alls (overlap pairs)
    dispatch: str = "bf16"  # resident: precision.dispatch
    reshard: str = "forward"  # FSDP2: parallel.fsdp_reshard
    reduce: str = "fp32"  # FSDP2: precision.grad_dtype, the reduce dtype
    hsdp: bool = False  # FSDP2: shard inside a node, replicate across nodes


RESIDENT = (
    Variant(name="resident"),
    Variant(name="resident, replicated AdamW", sharded_optimizer=False),
    Variant(name="resident, two_chunk", two_chunk=True),
    Variant(name="resident, fp8 dispatch", dispatch="fp8"),
)
FSDP = (
    Variant(name="fsdp2", fsdp=True),
    Variant(name="fsdp2, bf16 reduce", fsdp=True, reduce="bf16"),
    Variant(name="fsdp2, reshard backward", fsdp=True, reshard="backward"),
    Variant(name="fsdp2, reshard step", fsdp=True, reshard="step"),
    Variant(name="hsdp", fsdp=True, hsdp=True),
)
VARIANTS = {v.name: v for v in (*RESIDENT, *FSDP)}


def global_batch_tokens(config: RunConfig) -> int:
    """The config's global batch, else GLOBAL_BATCH_TOKENS (as large MoE runs use)."""
    return config.train.global_batch_tokens or GLOBAL_BATCH_TOKENS


@dataclass(frozen=True)
class RankCompute:
    """One rank's step measured on GPU `gpu` at `tokens` a micro-batch, no checkpointing, at the
    model's full depth (extrapolated from shallower copies when `depths` does not include it),
    timed with one data-parallel rank (no collectives, no gradient buffers)."""

    forward_backward_s: float
    optimizer_s: float  # gradient clip + the update of every parameter the timed model has
    peak_bytes: float  # torch.cuda.max_memory_allocated
    depths: tuple[int, ...] = ()  # the layer counts that were timed
    shares: dict[str, float] = field(default_factory=dict)  # of forward_backward_s, by KINDS
    tokens: int = 0
    gpu: str = "h200"


@dataclass(frozen=True)
class Compute:
    """One micro-batch's forward + backward on a rank, by kind, and the step's optimizer."""

    experts: float
    products: float
    memory: float
    idle: float = 0.0
    optimizer: float = 0.0

    @property
    def forward_backward(self) -> float:
        return self.experts + self.products + self.memory + self.idle


@dataclass(frozen=True, kw_only=True)
class Setting:
    """What every row of a comparison shares: the cluster (GPU, count, node size, link
    efficiency), the batch, the overlap, the expert load and, for `bench --project`, the
    measured rank compute ("resident", "fsdp") with the dispatcher's measured costs."""

    cluster: Cluster
    global_batch_tokens: int = GLOBAL_BATCH_TOKENS
    overlap: Overlap = ASSUMED
    expert_load: float = 1.25
    load_source: str = "stated capacity factor"
    dispatcher: str = "no_sync"  # resident under EP; all_to_all adds the host sync
    measured: dict[str, RankCompute] = field(default_factory=dict)
    compute_scale: float | None = None  # replaces the datasheet ratios of measured compute
    index_work_s: float = 0.0  # per MoE layer and micro-batch at the measured tokens
    host_sync_s: float = 0.0  # per MoE layer forward (all_to_all)
    microbatch_tokens: tuple[int, ...] = MICROBATCH_TOKENS
    checkpointing: tuple[str, ...] = CHECKPOINTING

    def __post_init__(self) -> None:
        if self.expert_load < 1:
            raise ValueError(f"expert load ({self.expert_load}) must be >= 1 (max / mean rows)")
        if self.dispatcher not in ("no_sync", "all_to_all"):
            raise ValueError(f"dispatcher ({self.dispatcher!r}) must be no_sync or all_to_all")
        if self.compute_scale is not None and self.compute_scale <= 0:
            raise ValueError(f"--compute-scale ({self.compute_scale}) must be > 0")

    def ratios(self, measured_gpu: str) -> tuple[float, float]:
        """(products, memory-bound) speed of the row's GPU over the measuring one."""
        if self.compute_scale is not None:
            return self.compute_scale, self.compute_scale
        here, there = GPUS[measured_gpu], self.cluster.gpu
        return there.bf16_tflops / here.bf16_tflops, there.hbm_tbps / here.hbm_tbps


def rank_experts(config: RunConfig, gpus: int, fsdp: bool) -> int:
    """Experts of each MoE layer in the model a rank runs: E under FSDP2, E / N at ep = N."""
    E = config.moe.num_experts
    if fsdp:
        return E
    if E % gpus:
        raise ValueError(f"the GPUs ({gpus}) must divide moe.num_experts ({E}) at ep = GPUs")
    return E // gpus


def rank_model_params(config: RunConfig, num_local: int) -> tuple[int, int]:
    """(dense, expert) parameters of the model a rank runs with `num_local` experts a layer."""
    counts = param_counts(config)
    return counts.dense, counts.experts * num_local // config.moe.num_experts


def optimizer_share(config: RunConfig, variant: Variant, layout: Layout, cluster: Cluster) -> float:
    """The share of the timed model's update (all its parameters) a rank of the row runs."""
    if variant.fsdp:
        return 1 / fsdp_shard(variant, cluster)
    if not variant.sharded_optimizer:
        return 1.0
    dense, experts = rank_model_params(config, config.moe.num_experts // layout.ep)
    return (dense / layout.dp + experts / layout.expert_dp) / (dense + experts)


def fsdp_shard(variant: Variant, cluster: Cluster) -> int:
    """Ranks an FSDP2 row shards over: a node under HSDP, else all."""
    return min(cluster.gpus_per_node, cluster.num_gpus) if variant.hsdp else cluster.num_gpus


def resident_config(config: RunConfig, variant: Variant, setting: Setting, ep: int) -> RunConfig:
    """The config the planner sees for a resident row: its dispatch payload, and under EP
    buffers of `expert_load` x T K rows (NoSync's capacity blocks carry the busiest rank's
    load, for the exact-split dispatcher too)."""
    load = setting.expert_load if ep > 1 else None
    return with_dispatch(config, variant.dispatch, "no_sync" if load else None, load)


@functools.lru_cache(maxsize=64)
def with_dispatch(
    config: RunConfig, payload: str, dispatcher: str | None, capacity_factor: float | None
) -> RunConfig:
    """`config` with precision.dispatch and (unless None) moe.dispatcher and its capacity."""
    precision = dataclasses.replace(config.precision, dispatch=payload)
    moe = config.moe
    if dispatcher is not None:
        moe = dataclasses.replace(moe, dispatcher=dispatcher, capacity_factor=capacity_factor)
    return dataclasses.replace(config, precision=precision, moe=moe)


def roofline_compute(est_stage, load: float) -> Compute:
    return Compute(
        experts=est_stage.microbatch_expert_s * load,
        products=est_stage.microbatch_matmul_s - est_stage.microbatch_expert_s,
        memory=est_stage.microbatch_elementwise_s,
        optimizer=est_stage.optimizer_s,
    )


@functools.lru_cache(maxsize=1024)
def _roof(config: RunConfig, cluster: Cluster, layout: Layout) -> Compute:
    """The roofline's compute of one micro-batch of `layout` (a sweep reuses each many times)."""
    return roofline_compute(stage_estimate(config, cluster, layout, 0, 1), 1.0)


def measured_compute(
    config: RunConfig, setting: Setting, variant: Variant, layout: Layout
) -> Compute:
    """Measured compute carried to `layout` (a point of the sweep) and to the row's GPU."""
    measured = setting.measured["fsdp" if variant.fsdp else "resident"]
    cluster = dataclasses.replace(setting.cluster, gpu=GPUS[measured.gpu])
    mb = measured.tokens // config.train.seq_len
    at = dataclasses.replace(layout, micro_batch_size=mb, activation_checkpointing="none", pp=1)
    base = config if variant.fsdp else with_dispatch(config, variant.dispatch, "all_to_all", None)
    anchor = _roof(base, cluster, at)
    here = config if variant.fsdp else resident_config(config, variant, setting, layout.ep)
    ref = _roof(here, cluster, layout)
    fb = measured.forward_backward_s
    shares = measured.shares or _shares(anchor)
    load = 1.0 if variant.fsdp else setting.expert_load
    parts = {
        kind: fb * shares.get(kind, 0.0) * getattr(ref, kind) / getattr(anchor, kind)
        for kind in ("experts", "products", "memory")
    }
    parts["experts"] *= load
    products, memory = setting.ratios(measured.gpu)
    extra = dispatcher_s(config, setting, variant, layout, measured.tokens)
    return Compute(
        experts=parts["experts"] / products,
        products=parts["products"] / products,
        memory=(parts["memory"] + extra[0]) / memory,
        idle=fb * shares.get("idle", 0.0) + extra[1],
        optimizer=measured.optimizer_s * optimizer_share(config, variant, layout, cluster) / memory,
    )


def _shares(c: Compute) -> dict[str, float]:
    total = c.experts + c.products + c.memory
    return {kind: getattr(c, kind) / total for kind in ("experts", "products", "memory")}


def dispatcher_s(
    config: RunConfig, setting: Setting, variant: Variant, layout: Layout, measured_tokens: int
) -> tuple[float, float]:
    """(index work, host sync) of the EP dispatcher per micro-batch: index work per MoE layer
    scaled by the tokens, once more for a recomputed forward (half of forward + backward); the
    exact-split dispatcher's host sync per MoE layer forward, recomputed ones included."""
    if variant.fsdp or layout.ep == 1:
        return 0.0, 0.0
    num_moe = -(-(config.model.num_layers - config.model.num_dense) // layout.pp)
    redo = layout.activation_checkpointing != "none"
    tokens = layout.micro_batch_size * config.train.seq_len
    index = setting.index_work_s * tokens / max(measured_tokens, 1) * (1 + 0.5 * redo)
    sync = setting.host_sync_s * (1 + redo) if setting.dispatcher == "all_to_all" else 0.0
    return num_moe * index, num_moe * sync
