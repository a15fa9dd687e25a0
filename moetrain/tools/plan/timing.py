"""Time and traffic of one pipeline stage: a roofline model, nothing overlapped (docs/plan.md,
"Time model"). Per micro-batch: products, elementwise kernels, expert all-to-alls and pipeline
sends; per step: the distributed optimizer's reduce-scatter + all-gather and its update (with
Muon, its Newton-Schulz products too).
`search.estimate` adds the pipeline bubble of the schedule and combines the stages.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moetrain.config import RunConfig
from moetrain.model.flops import muon_block_flops
from moetrain.tools.plan.layout import (
    GIB,
    INTERLEAVED_CHUNKS,
    Cluster,
    Layout,
    microbatch_tokens,
    stage_layers,
)
from moetrain.tools.plan.links import members_per_node, split_all_to_all, split_collective
from moetrain.tools.plan.memory import (
    Memory,
    RankParams,
    block_activation_bytes,
    expert_rows,
    in_flight_microbatches,
    layer_params,
    optimizer_shards,
    precision_bytes,
    rank_params,
    recomputed_swiglu_bytes,
    stage_memory,
    state_bytes_per_element,
    uses_muon,
)

ELEMENTWISE_PASSES = 4  # saved bytes: written in forward, read in backward; their gradient too


@dataclass(frozen=True)
class Traffic:
    """Bytes one GPU sends per optimizer step, inside its node (NVLink) and to other nodes."""

    all_to_all_intra: float = 0.0
    all_to_all_inter: float = 0.0
    grad_sync_intra: float = 0.0
    grad_sync_inter: float = 0.0
    pipeline_intra: float = 0.0
    pipeline_inter: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in dataclasses.fields(self))


@dataclass(frozen=True)
class StageEstimate:
    """One pipeline stage (every rank of a stage is alike). Times of one micro-batch are its
    forward + backward, recomputation included."""

    stage: int
    layers: range
    params: RankParams
    memory: Memory
    traffic: Traffic
    in_flight: float
    microbatch_matmul_s: float  # products at their efficiency-scaled peaks
    microbatch_expert_s: float  # the experts' grouped products among them
    microbatch_elementwise_s: float  # memory-bound kernels at HBM bandwidth
    microbatch_comm_s: float  # all-to-alls and pipeline sends (not overlapped)
    microbatch_all_to_all_s: float  # the all-to-alls among them
    grad_sync_s: float
    optimizer_s: float

    @property
    def microbatch_s(self) -> float:
        return self.microbatch_matmul_s + self.microbatch_elementwise_s + self.microbatch_comm_s


def bubble_microbatches(layout: Layout) -> float:
    """Idle time of the pipeline in units of one micro-batch's forward + backward on a stage."""
    pp = layout.pp
    return {
        "gpipe": pp - 1,
        "1f1b": pp - 1,
        "interleaved_1f1b": (pp - 1) / INTERLEAVED_CHUNKS,
        "zero_bubble": (pp - 1) / 3,  # ZB-H1: backward split into input- and weight-gradients
    }[layout.schedule]


def fp8_experts(config: RunConfig, cluster: Cluster) -> bool:
    """Whether the expert GEMMs run on FP8 tensor cores (MXFP8 only on Blackwell)."""
    recipe = config.precision.experts
    return recipe == "fp8_rowwise" or (recipe == "mxfp8" and cluster.gpu.name.startswith("b"))


def _matmul_parts(
    config: RunConfig, cluster: Cluster, layout: Layout, stage: int
) -> tuple[float, float]:
    """One micro-batch's products on a stage: (the experts' grouped products, the others). A
    forward is a third of forward + backward; moe checkpointing redoes the experts and the router
    (2 D E FLOPs per token), full everything. FP8 GEMMs run forward and input gradient at the
    FP8 rate; their weight gradient stays bf16."""
    m, moe, gpu = config.model, config.moe, cluster.gpu
    lp = layer_params(config)
    _, num_dense, num_moe = stage_layers(config, layout.pp, stage)
    grouped_rate = gpu.bf16_tflops * 1e12 * cluster.grouped_efficiency
    fp8_rate = gpu.fp8_tflops * 1e12 * cluster.fp8_efficiency
    dense_rate = gpu.bf16_tflops * 1e12 * cluster.matmul_efficiency
    attention_rate = gpu.bf16_tflops * 1e12 * cluster.attention_efficiency

    ckpt = layout.activation_checkpointing
    redo_all = 1 / 3 if ckpt == "full" else 0.0
    redo_experts = 1 / 3 if ckpt in ("moe", "full") else 0.0
    redo_router = 2 * m.d_model * moe.num_experts if ckpt == "moe" else 0
    experts = 6 * moe.top_k * lp.moe_layer.experts // moe.num_experts
    attention = lp.attention_flops_per_token_layer
    other = num_moe * (lp.flops_per_token_layer - experts - attention + redo_router)
    other += num_dense * 6 * lp.dense_layer.active
    # precision.linear=fp8_rowwise: the projections and the dense SwiGLUs (all but the router)
    linear = 0
    if config.precision.linear == "fp8_rowwise":
        dense_mlp = 6 * (lp.dense_layer.active - lp.dense_layer.attention)
        shared = 6 * 3 * m.d_model * moe.expert_hidden * moe.num_shared_experts
        linear = (num_moe + num_dense) * 6 * lp.moe_layer.attention
        linear += num_dense * dense_mlp + num_moe * shared
        other -= linear
    head = 6 * lp.outside.active if stage == layout.pp - 1 else 0
    tokens = microbatch_tokens(config, layout)
    if fp8_experts(config, cluster):
        expert_s = experts * ((2 / 3 + redo_experts) / fp8_rate + 1 / 3 / grouped_rate)
    else:
        expert_s = experts * (1 + redo_experts) / grouped_rate
    linear_s = linear * ((2 / 3 + redo_all) / fp8_rate + 1 / 3 / dense_rate)
    if config.precision.lm_head == "fp8_rowwise":
        head_s = head * (2 / 3 / fp8_rate + 1 / 3 / dense_rate)
    else:
        head_s = head / dense_rate
    rest = (
        (num_moe + num_dense) * attention * (1 + redo_all) / attention_rate
        + other * (1 + redo_all) / dense_rate
        + head_s
        + linear_s
    )
    return tokens * num_moe * expert_s, tokens * rest


def _fp8_quantization_bytes(config: RunConfig, layout: Layout, stage: int) -> float:
    """HBM bytes of one micro-batch's FP8 quantizations on a stage (read a bytes, write one,
    per element): the experts' rows (x: without expert parallelism the dispatcher quantizes the
    T token rows and gathers the FP8 bytes, otherwise the experts quantize the rows they get;
    the output gradient; the SwiGLU kernels write a's and dh's FP8 rows as they go, one byte
    more each) and their weights in both layouts; the projections' inputs, output gradients and
    weights; the LM head's inputs, the logits' gradient and its weight in both layouts.
    Recomputed forwards quantize again."""
    m, moe = config.model, config.moe
    b = precision_bytes(config)
    a, p = b.activation, b.param
    _, num_dense, num_moe = stage_layers(config, layout.pp, stage)
    tokens = microbatch_tokens(config, layout)
    ckpt = layout.activation_checkpointing
    total = 0.0
    if config.precision.experts == "fp8_rowwise" and num_moe:
        D, F = m.d_model, moe.expert_hidden
        rows = expert_rows(config, layout.ep, tokens).rows
        redo = ckpt in ("moe", "full")
        if layout.ep == 1:  # T rows quantized, their bytes and scales gathered K-fold
            x_rows = tokens * D * (a + 1) + rows * (D + 4)
        else:
            x_rows = rows * D * (a + 1)
        forward_rows = x_rows + rows * F
        backward_rows = rows * (D * (a + 1) + 2 * F)
        weights = 3 * D * F * moe.num_experts // layout.ep
        forward_weights = backward_weights = weights * (p + 1)
        per_layer = (1 + redo) * (forward_rows + forward_weights) + backward_rows + backward_weights
        total += num_moe * per_layer
    if config.precision.linear == "fp8_rowwise":
        lp = layer_params(config)
        q_out = (m.num_heads + 2 * m.kv_heads) * m.dim_per_head
        attn_in = m.num_heads * m.dim_per_head
        per_token = (m.d_model + attn_in) * (a + 1)  # the two projections' inputs
        per_token += (q_out + m.d_model) * (a + 1)  # their output gradients
        weights = 2 * lp.moe_layer.attention * (p + 1)  # both layouts
        redo = 1 if ckpt == "full" else 0
        layers = num_moe + num_dense
        total += layers * (tokens * per_token * (1 + redo / 2) + weights * (1 + redo / 2))
    if config.precision.lm_head == "fp8_rowwise" and stage == layout.pp - 1:
        V, D = m.vocab_size, m.d_model
        total += tokens * (D + V) * (a + 1) + 2 * V * D * (p + 1)
    return total


def _elementwise_s(config: RunConfig, cluster: Cluster, layout: Layout, stage: int) -> float:
    """Memory-bound kernels (norms, softmax, SwiGLU, RoPE, permutes) move about as many bytes as
    autograd saves, ELEMENTWISE_PASSES times; recomputation writes its part once more."""
    _, num_dense, num_moe = stage_layers(config, layout.pp, stage)
    tokens = microbatch_tokens(config, layout)
    ckpt = layout.activation_checkpointing
    saved = redone = 0
    for is_moe, count in ((False, num_dense), (True, num_moe)):
        if count:
            attention, norm, ffn = block_activation_bytes(config, tokens, moe=is_moe, ep=layout.ep)
            if is_moe:  # not held, but written all the same
                ffn += recomputed_swiglu_bytes(config, tokens, layout.ep)
            saved += count * (attention + norm + ffn)
            if ckpt == "full":
                redone += count * (attention + norm + ffn)
            elif ckpt == "moe" and is_moe:
                redone += count * ffn
    quantized = _fp8_quantization_bytes(config, layout, stage)
    return (ELEMENTWISE_PASSES * saved + redone + quantized) / cluster.hbm_bps


def _all_to_all(
    config: RunConfig, cluster: Cluster, layout: Layout, num_moe: int
) -> tuple[float, float, float]:
    """(intra bytes, inter bytes, seconds) of one micro-batch's expert all-to-alls on a stage:
    dispatch and combine in the forward, their gradients in the backward, and the forward pair
    again when checkpointing recomputes the MoE layer."""
    if layout.ep == 1 or num_moe == 0:
        return 0.0, 0.0, 0.0
    a = precision_bytes(config).activation
    D = config.model.d_model
    tokens = microbatch_tokens(config, layout)
    rows = expert_rows(config, layout.ep, tokens).rows  # 1 / ep of them stay on the rank
    dispatch = 1 + 4 / D if config.precision.dispatch == "fp8" else a  # fp8 with a row scale
    forward = rows * D * (dispatch + a)
    backward = rows * D * 2 * a
    recompute = layout.activation_checkpointing != "none"
    per_layer = forward * (1 + recompute) + backward
    intra, inter = split_all_to_all(num_moe * per_layer, layout.ep, cluster.gpus_per_node)
    launches = num_moe * (4 + 2 * recompute)
    links = cluster.links
    rate = links.message_rate(rows * D * a / layout.ep)  # a bf16 exchange's message to a peer
    seconds = links.transfer_s(intra, inter, concurrent=True) / rate
    return intra, inter, seconds + launches * cluster.latency_us * 1e-6


def _pipeline_sends(
    config: RunConfig, cluster: Cluster, layout: Layout, stage: int
) -> tuple[float, float, float]:
    """(intra bytes, inter bytes, seconds) of one micro-batch's sends from a stage: activations
    to the next stage, gradients to the previous one. Stages sit dp ranks apart."""
    local = members_per_node(layout.pp, layout.dp, cluster.gpus_per_node)
    a = precision_bytes(config).activation
    nbytes = a * microbatch_tokens(config, layout) * config.model.d_model
    intra = inter = 0.0
    boundaries = [(stage, stage + 1)] * (stage < layout.pp - 1) + [(stage - 1, stage)] * (stage > 0)
    for lo, hi in boundaries:
        if lo // local == hi // local:
            intra += nbytes
        else:
            inter += nbytes
    seconds = cluster.links.transfer_s(intra, inter, concurrent=False)
    return intra, inter, seconds + len(boundaries) * cluster.latency_us * 1e-6


def _grad_sync(
    config: RunConfig, cluster: Cluster, layout: Layout, params: RankParams
) -> tuple[float, float, float]:
    """(intra bytes, inter bytes, seconds) of the distributed optimizer once per step: reduce-
    scatter gradients and all-gather parameters, dense ones over dp (consecutive ranks), expert
    ones over the expert-data-parallel group (ranks ep apart)."""
    b = precision_bytes(config)
    intra = inter = seconds = 0.0
    for numel, group, stride in (
        (params.dense, layout.dp, 1),
        (params.experts, layout.expert_dp, layout.ep),
    ):
        if group == 1 or numel == 0:
            continue
        for per_element in (b.grad, b.param):
            i, o = split_collective(numel * per_element, group, stride, cluster.gpus_per_node)
            intra, inter = intra + i, inter + o
            seconds += cluster.links.transfer_s(i, o, concurrent=False) + cluster.latency_us * 1e-6
    return intra, inter, seconds


def _optimizer_s(
    config: RunConfig, cluster: Cluster, layout: Layout, params: RankParams, stage: int
) -> float:
    """The update of this rank's shards: read master, moments and gradient shard; write master,
    moments and the bf16 parameter; with Muon also its Newton-Schulz products at the dense
    matmul rate."""
    b = precision_bytes(config)
    optimizer_bytes = sum(
        shard * (2 * state_bytes_per_element(b, muon) + b.grad + b.param)
        for shard, _, muon in optimizer_shards(params, layout, uses_muon(config))
    )
    matmul_rate = cluster.gpu.bf16_tflops * 1e12 * cluster.matmul_efficiency
    return optimizer_bytes / cluster.hbm_bps + rank_muon_flops(config, layout, stage) / matmul_rate


def rank_muon_flops(config: RunConfig, layout: Layout, stage: int) -> int:
    """Newton-Schulz FLOPs of one optimizer step on a rank of `stage` (0 without Muon): the
    stage's dense matrices and its 1 / ep of the experts; muon_sharded divides them over dp
    and dp / ep (each rank orthogonalizes the matrices it owns)."""
    if not uses_muon(config):
        return 0
    _, num_dense, num_moe = stage_layers(config, layout.pp, stage)
    dense = num_moe * muon_block_flops(config, "moe")
    dense += num_dense * muon_block_flops(config, "dense")
    experts = num_moe * muon_block_flops(config, "experts") // layout.ep
    if config.train.optimizer == "muon_sharded":
        return dense // layout.dp + experts // layout.expert_dp
    return dense + experts


def stage_estimate(
    config: RunConfig, cluster: Cluster, layout: Layout, stage: int, num_micro: int
) -> StageEstimate:
    """Memory, traffic per step and times of one stage (the layout is assumed valid)."""
    layers, _, num_moe = stage_layers(config, layout.pp, stage)
    params = rank_params(config, pp=layout.pp, ep=layout.ep, stage=stage)
    a2a_intra, a2a_inter, a2a_s = _all_to_all(config, cluster, layout, num_moe)
    p2p_intra, p2p_inter, p2p_s = _pipeline_sends(config, cluster, layout, stage)
    sync_intra, sync_inter, sync_s = _grad_sync(config, cluster, layout, params)
    expert_s, rest_s = _matmul_parts(config, cluster, layout, stage)
    return StageEstimate(
        stage=stage,
        layers=layers,
        params=params,
        memory=stage_memory(
            config,
            layout,
            stage,
            num_micro,
            int(cluster.overhead_gib * GIB),
            cluster.activation_factor,
        ),
        traffic=Traffic(
            all_to_all_intra=a2a_intra * num_micro,
            all_to_all_inter=a2a_inter * num_micro,
            grad_sync_intra=sync_intra,
            grad_sync_inter=sync_inter,
            pipeline_intra=p2p_intra * num_micro,
            pipeline_inter=p2p_inter * num_micro,
        ),
        in_flight=in_flight_microbatches(layout, stage, num_micro),
        microbatch_matmul_s=expert_s + rest_s,
        microbatch_expert_s=expert_s,
        microbatch_elementwise_s=_elementwise_s(config, cluster, layout, stage),
        microbatch_comm_s=a2a_s + p2p_s,
        microbatch_all_to_all_s=a2a_s,
        grad_sync_s=sync_s,
        optimizer_s=_optimizer_s(config, cluster, layout, params, stage),
    )
