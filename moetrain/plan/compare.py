"""The 8-GPU answer on paper: one rank's measured compute plus the communication of its layout.

`moetrain bench --project` times, on the local GPU, what one rank of an N-GPU layout computes
(`RankCompute`: forward + backward and the optimizer step of the rank's model, its peak memory);
this module adds what the measurement cannot contain, from the config and the link model
(plan/links.py), and nothing here imports torch. Layouts (every one data-parallel over all N
GPUs, one micro-batch of T tokens per rank and step unless `microbatches` says more):

- `ep-replicated`: experts resident, ep = dp = N. A rank holds the dense weights and E / N
  experts of every MoE layer; it runs attention on its T tokens and its experts on the T K rows
  that uniform routing sends it. Per MoE layer and micro-batch four all-to-alls of T K D values
  (dispatch and combine in forward, their gradients in backward); per step an all-reduce of the
  dense gradients over dp in `precision.grad_dtype` (expert gradients need none: at ep = dp each
  expert has one replica, generally they all-reduce over dp / ep ranks ep apart). Memory adds
  the fp32 gradient buffers of GradientSync and the tensors the EP combine keeps (a T K D a
  layer, plan.memory) to the measured peak.
- `ep-sharded`: the same with ShardedAdamW: the update covers 1 / dp of the dense parameters and
  1 / (dp / ep) of the experts, whose fp32 master and moments shrink alike; the gradients are
  reduce-scattered (fp32) and the bf16 parameters all-gathered instead of the all-reduce.
- `fsdp2`: the FSDP2 baseline (`parallel.data_parallel=fsdp`, ep 1): each rank runs the whole
  model, all E experts, on its T tokens, and holds 1 / N of parameters, gradients and optimizer
  state. Per block and micro-batch: an all-gather of its bf16 parameters in forward, another in
  backward (blocks reshard after forward), a reduce-scatter of its gradients (parameter dtype,
  FSDP2 without a mixed-precision policy); the root (embedding, final norm, head) gathers once.
  Memory: the measured peak of the whole model, less its unsharded state, plus the 1 / N shard
  and two blocks gathered (the one running and the one prefetched).

Overlap is stated, not assumed: `no_overlap_s` adds every transfer to the compute;
`overlapped_s` overlaps what the code overlaps: GradientSync's and ShardedAdamW's gradient
reductions run during backward (the backward is taken as 2/3 of forward + backward), FSDP2
prefetches every all-gather but the first and reduce-scatters during backward; the all-to-alls
(the dispatchers wait for them) and ShardedAdamW's parameter all-gather (after the update) are
never hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moetrain.config import RunConfig
from moetrain.model.flops import flops_per_token, param_counts
from moetrain.plan.links import Links
from moetrain.plan.memory import block_activation_bytes, layer_params, precision_bytes

LAYOUTS = ("ep-replicated", "ep-sharded", "fsdp2")
BACKWARD_SHARE = 2 / 3  # of forward + backward: the window gradient reductions can hide in
GATHERED_BLOCKS = 2  # FSDP2 holds the running block's and the prefetched block's parameters


@dataclass(frozen=True)
class RankCompute:
    """One rank's measured step at the model's full depth (extrapolated from shallower copies
    when `depths` does not include it): seconds and bytes of the model the rank runs, timed
    with one data-parallel rank (no collectives, no gradient buffers)."""

    forward_backward_s: float
    optimizer_s: float  # gradient clip + the update of every parameter the timed model has
    peak_bytes: float  # torch.cuda.max_memory_allocated
    depths: tuple[int, ...] = ()  # the layer counts that were timed


@dataclass(frozen=True)
class CommTerm:
    """One kind of transfer per step: its seconds and what it can overlap with."""

    name: str
    seconds: float
    hidden_by: str  # "none", "backward" or "forward"


@dataclass(frozen=True)
class Projection:
    config: str
    layout: str
    gpus: int
    tokens_per_gpu: int  # per step
    compute_s: float
    comm: list[CommTerm] = field(default_factory=list)
    no_overlap_s: float = 0.0
    overlapped_s: float = 0.0
    peak_bytes: float = 0.0
    flops_per_token: int = 0

    @property
    def comm_s(self) -> float:
        return sum(c.seconds for c in self.comm)

    def tokens_per_s(self, overlapped: bool = True) -> float:
        return self.tokens_per_gpu / (self.overlapped_s if overlapped else self.no_overlap_s)

    def tflops(self, overlapped: bool = True) -> float:
        return self.tokens_per_s(overlapped) * self.flops_per_token / 1e12


def local_experts(config: RunConfig, layout: str, gpus: int) -> int:
    """Experts of each MoE layer in the model one rank runs: E / N under EP, E under FSDP2."""
    E = config.moe.num_experts
    if layout not in LAYOUTS:
        raise ValueError(f"layout ({layout!r}) must be one of {', '.join(LAYOUTS)}")
    if layout == "fsdp2":
        return E
    if E % gpus:
        raise ValueError(f"the GPUs ({gpus}) must divide moe.num_experts ({E}) for {layout}")
    return E // gpus


def rank_model_params(config: RunConfig, num_local: int) -> tuple[int, int]:
    """(dense, expert) parameters of the model a rank runs with `num_local` experts a layer."""
    counts = param_counts(config)
    return counts.dense, counts.experts * num_local // config.moe.num_experts


def _num_moe(config: RunConfig) -> int:
    return config.model.num_layers - config.model.num_dense_layers


def comm_terms(
    config: RunConfig, layout: str, gpus: int, links: Links, microbatches: int = 1
) -> list[CommTerm]:
    """The transfers of one step of `layout` on `gpus` GPUs (module docstring)."""
    m, b = config.model, precision_bytes(config)
    T = config.train.micro_batch_size * config.train.seq_len
    K = config.moe.top_k
    num_local = local_experts(config, layout, gpus)
    dense, experts = rank_model_params(config, num_local)
    if layout == "fsdp2":  # no mixed-precision policy: gradients reduce in the parameters' dtype
        lp, L = layer_params(config), _num_moe(config)  # every block of the presets is MoE
        block, root = lp.moe_layer.total, lp.outside.total
        root_gather = links.all_gather_s(root * b.param, gpus)
        root_scatter = links.reduce_scatter_s(root * b.param, gpus)
        block_gather = links.all_gather_s(block * b.param, gpus)
        block_scatter = links.reduce_scatter_s(block * b.param, gpus)
        return [
            CommTerm("root all-gather (first, exposed)", microbatches * root_gather, "none"),
            CommTerm("forward all-gathers", microbatches * L * block_gather, "forward"),
            CommTerm("backward all-gathers", microbatches * L * block_gather, "backward"),
            CommTerm("gradient reduce-scatters", microbatches * L * block_scatter, "backward"),
            CommTerm("root reduce-scatter (last, exposed)", microbatches * root_scatter, "none"),
        ]
    dispatch = 1 + 4 / m.d_model if config.precision.dispatch == "fp8" else b.activation
    payload = T * K * m.d_model  # values a rank sends per exchange (its own share included)
    a2a = links.all_to_all_s(payload * dispatch, gpus) + 3 * links.all_to_all_s(
        payload * b.activation, gpus
    )
    terms = [CommTerm("all-to-alls", microbatches * _num_moe(config) * a2a, "none")]
    ep = config.moe.num_experts // num_local
    edp = gpus // ep
    groups = ((dense, gpus, 1), (experts, edp, ep))
    if layout == "ep-replicated":
        sync = sum(links.all_reduce_s(n * b.grad, g, s) for n, g, s in groups)
        return [*terms, CommTerm("gradient all-reduce", sync, "backward")]
    scatter = sum(links.reduce_scatter_s(n * b.grad, g, s) for n, g, s in groups)
    gather = sum(links.all_gather_s(n * b.param, g, s) for n, g, s in groups)
    return [
        *terms,
        CommTerm("gradient reduce-scatter", scatter, "backward"),
        CommTerm("parameter all-gather", gather, "none"),
    ]


def state_delta_bytes(config: RunConfig, layout: str, gpus: int) -> float:
    """Bytes a rank of `layout` holds beyond (or, negative, short of) the timed model's: that
    ran in one process with the replicated AdamW and no gradient buffer (module docstring)."""
    b = precision_bytes(config)
    num_local = local_experts(config, layout, gpus)
    dense, experts = rank_model_params(config, num_local)
    total = dense + experts
    states = b.master + b.moments
    if layout == "ep-replicated":  # GradientSync's buffers when they are fp32 (accumulate mode)
        buffers = b.grad * total if b.grad > b.param else 0
        return buffers + _ep_saved_bytes(config, gpus)
    if layout == "ep-sharded":
        ep = config.moe.num_experts // num_local
        delta = 0.0
        for numel, group in ((dense, gpus), (experts, gpus // ep)):
            shard = numel / group
            delta += numel * (b.grad - b.param)  # gradient buckets instead of autograd's .grad
            delta += 12 * shard - states * numel  # ShardedAdamW: fp32 master and moments
            delta += b.grad * shard if group > 1 else 0  # the reduce-scatter's output
        return delta + _ep_saved_bytes(config, gpus)
    lp = layer_params(config)
    per_param = 2 * b.param + states  # parameters and their gradients in one dtype
    gathered = GATHERED_BLOCKS * lp.moe_layer.total * 2 * b.param
    return per_param * total / gpus + gathered - per_param * total


def _ep_saved_bytes(config: RunConfig, gpus: int) -> float:
    """What the expert-parallel combine keeps for backward and the one-device dispatch does not
    (its gathered expert outputs, a T K D a MoE layer), from the planner's activation model."""
    T = config.train.micro_batch_size * config.train.seq_len
    ffn_ep = block_activation_bytes(config, T, moe=True, ep=gpus)[2]
    ffn_local = block_activation_bytes(config, T, moe=True, ep=1)[2]
    return _num_moe(config) * (ffn_ep - ffn_local)


def optimizer_share(config: RunConfig, layout: str, gpus: int) -> float:
    """The fraction of the timed optimizer step a rank of `layout` runs."""
    num_local = local_experts(config, layout, gpus)
    dense, experts = rank_model_params(config, num_local)
    if layout == "ep-replicated":
        return 1.0
    if layout == "fsdp2":
        return 1 / gpus
    ep = config.moe.num_experts // num_local
    return (dense / gpus + experts / (gpus // ep)) / (dense + experts)


def project(
    config: RunConfig,
    layout: str,
    gpus: int,
    measured: RankCompute,
    links: Links,
    microbatches: int = 1,
) -> Projection:
    """One rank's step of `layout`: measured compute (forward + backward per micro-batch, the
    rank's share of the optimizer) plus the communication, without and with overlap."""
    if microbatches < 1:
        raise ValueError(f"microbatches ({microbatches}) must be >= 1")
    fb = microbatches * measured.forward_backward_s
    compute = fb + measured.optimizer_s * optimizer_share(config, layout, gpus)
    terms = comm_terms(config, layout, gpus, links, microbatches)
    window = {"backward": BACKWARD_SHARE * fb, "forward": (1 - BACKWARD_SHARE) * fb}
    exposed = sum(t.seconds for t in terms if t.hidden_by == "none")
    for kind, span in window.items():
        exposed += max(0.0, sum(t.seconds for t in terms if t.hidden_by == kind) - span)
    T = config.train.micro_batch_size * config.train.seq_len
    return Projection(
        config=config.name,
        layout=layout,
        gpus=gpus,
        tokens_per_gpu=microbatches * T,
        compute_s=compute,
        comm=terms,
        no_overlap_s=compute + sum(t.seconds for t in terms),
        overlapped_s=compute + exposed,
        peak_bytes=measured.peak_bytes + state_delta_bytes(config, layout, gpus),
        flops_per_token=flops_per_token(config),
    )


def extrapolate(depths: tuple[int, ...], values: list[float], num_layers: int) -> float:
    """The value at `num_layers` of a quantity linear in the layer count (blocks are identical),
    from its values at one depth (which must be `num_layers`) or at two."""
    if len(depths) != len(values) or not 1 <= len(depths) <= 2:
        raise ValueError(f"need one or two depths with a value each, got {depths} / {values}")
    if len(depths) == 1:
        if depths[0] != num_layers:
            raise ValueError(f"one depth ({depths[0]}) must be the model's ({num_layers})")
        return values[0]
    (l1, l2), (v1, v2) = depths, values
    if l1 == l2:
        raise ValueError(f"the two depths must differ, got {depths}")
    return v1 + (v2 - v1) / (l2 - l1) * (num_layers - l1)


def eager_peak_bytes(config: RunConfig, num_local: int) -> float:
    """An upper bound of the timed model's peak (one process, replicated AdamW): its state plus
    what eager autograd saves in every block, for choosing the depths to time."""
    b = precision_bytes(config)
    T = config.train.micro_batch_size * config.train.seq_len
    saved = sum(block_activation_bytes(config, T, moe=True, ep=1))
    per_param = 2 * b.param + b.master + b.moments  # autograd's gradients: the parameters' dtype
    return per_param * sum(rank_model_params(config, num_local)) + config.model.num_layers * saved
