"""Bytes on one GPU: parameters, gradients, optimizer state and activations of a pipeline stage.

Parameter counts come from model/flops.py, placement from layout.py, optimizer terms from
ShardedAdamW (ZeRO-1 over dp for dense parameters, over dp / ep for experts), or with
train.optimizer muon / muon_sharded from the sharded Muon: one fp32 momentum buffer instead of
AdamW's two moments for each matrix Muon updates (model/flops.py `muon_matrices`). The activation
formula is what autograd saves for our block, checked byte for byte against a materialized model
in tests/test_plan.py. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from moetrain.config import ParallelConfig, RunConfig
from moetrain.model.flops import ParamCounts, flops_per_token, param_counts
from moetrain.moe.capacity import auto_dispatcher, expert_buffer_rows
from moetrain.tools.plan.layout import (
    GIB,
    INTERLEAVED_CHUNKS,
    Layout,
    microbatch_tokens,
    stage_layers,
)

LOSS_CHUNK_TOKENS = 4096  # chunk of chunked_linear_cross_entropy (nn/loss.py)
SHARD_ALIGN = 64  # optim/sharded.py: shard sizes are multiples of this many elements


# ---- parameters per rank ---------------------------------------------------------------------
@dataclass(frozen=True)
class LayerParams:
    """Per-layer and outside-layer parameter counts, derived from `flops.param_counts`."""

    moe_layer: ParamCounts  # one MoE block: attention, norms, router, shared and routed experts
    dense_layer: ParamCounts  # one dense-MLP block (meaningful only where the model has one)
    outside: ParamCounts  # embedding, final norm, LM head
    flops_per_token_layer: int  # one MoE block, forward + backward, at train.seq_len
    attention_flops_per_token_layer: int  # the S^2 part of it (attention scores and values)


def _with_layers(config: RunConfig, num_layers: int, num_dense: int) -> RunConfig:
    """The same blocks, `num_layers` of them (the first `num_dense` dense), on one device."""
    model = dataclasses.replace(
        config.model, num_layers=num_layers, num_dense_layers=num_dense, dense_layers=()
    )
    train = dataclasses.replace(config.train, global_batch_tokens=None)
    return dataclasses.replace(config, model=model, parallel=ParallelConfig(), train=train)


def _minus(a: ParamCounts, b: ParamCounts) -> ParamCounts:
    return ParamCounts(
        *(x - y for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b), strict=True))
    )


@functools.lru_cache(maxsize=32)
def layer_params(config: RunConfig) -> LayerParams:
    """One layer's counts are differences of whole-model counts, so flops.py stays the only
    place that knows the parameter shapes."""
    one, two = _with_layers(config, 1, 0), _with_layers(config, 2, 0)
    moe_layer = _minus(param_counts(two), param_counts(one))
    dense_layer = _minus(param_counts(_with_layers(config, 2, 1)), param_counts(one))
    layer_flops = flops_per_token(two) - flops_per_token(one)
    return LayerParams(
        moe_layer=moe_layer,
        dense_layer=dense_layer,
        outside=_minus(param_counts(one), moe_layer),
        flops_per_token_layer=layer_flops,
        attention_flops_per_token_layer=layer_flops - 6 * moe_layer.active,
    )


@dataclass(frozen=True)
class RankParams:
    """Parameters one rank holds: dense ones are replicated over dp (sharded optimizer over dp);
    expert ones are this rank's num_experts / ep experts of each of its MoE layers."""

    dense: int
    experts: int
    dense_muon: int = 0  # of `dense`, the matrices Muon would update (every expert is one)

    @property
    def total(self) -> int:
        return self.dense + self.experts


def rank_params(config: RunConfig, *, pp: int, ep: int, stage: int) -> RankParams:
    """Stage s holds its layers; stage 0 the embedding; the last stage the final norm and the LM
    head (with tied embeddings and pp > 1, a copy of the embedding serves as its head)."""
    lp = layer_params(config)
    _, num_dense, num_moe = stage_layers(config, pp, stage)
    experts = num_moe * lp.moe_layer.experts // ep
    dense = num_moe * lp.moe_layer.dense + num_dense * lp.dense_layer.total
    dense_muon = (
        num_moe * (lp.moe_layer.muon - lp.moe_layer.experts) + num_dense * lp.dense_layer.muon
    )
    out = lp.outside
    final_norm = out.total - out.embedding - out.lm_head
    if stage == 0:
        dense += out.embedding
    if stage == pp - 1:
        tied_copy = out.embedding if (out.lm_head == 0 and pp > 1) else 0
        dense += final_norm + out.lm_head + tied_copy
    return RankParams(dense=dense, experts=experts, dense_muon=dense_muon)


# ---- optimizer state and activations ---------------------------------------------------------
@dataclass(frozen=True)
class PrecisionBytes:
    param: int
    grad: int
    master: int  # fp32 master copy, sharded
    moments: int  # Adam exp_avg + exp_avg_sq, sharded
    activation: int


def precision_bytes(config: RunConfig) -> PrecisionBytes:
    """auto: the GPU recipe (bf16 parameters, fp32 master and moments). Gradients live in
    ShardedAdamW's flat buckets, in fp32 with `precision.grad_dtype=fp32` (the default; see
    `parallel.precision.resolve_grad_dtype`), else in the parameters' dtype."""
    p = config.precision
    if p.param_dtype == "fp32":
        return PrecisionBytes(param=4, grad=4, master=0, moments=8, activation=4)
    grad = 4 if p.grad_dtype == "fp32" else 2
    if p.master_weights:
        return PrecisionBytes(param=2, grad=grad, master=4, moments=8, activation=2)
    return PrecisionBytes(param=2, grad=grad, master=0, moments=4, activation=2)


def shard_numel(numel: int, shards: int) -> int:
    """The ZeRO-1 shard of ShardedAdamW (optim/sharded.py): a flat bucket padded so that it splits
    into equal shards of a multiple of SHARD_ALIGN elements; unsharded when the group is one rank.
    Modeled as one bucket per sync group (the real 25 MB buckets pad each by < shards x 64)."""
    if shards == 1:
        return numel
    return -(-numel // (shards * SHARD_ALIGN)) * SHARD_ALIGN


def uses_muon(config: RunConfig) -> bool:
    return config.train.optimizer in ("muon", "muon_sharded")


def optimizer_shards(
    params: RankParams, layout: Layout, muon: bool = False
) -> list[tuple[int, int, bool]]:
    """(shard elements, group size, updated by Muon) of each sync group: dense over dp, experts
    over dp / ep; with `muon` the dense group's matrices and the experts are Muon's (its whole
    matrices modeled as flat shards: the same bytes but for the regions' padding)."""
    dense_muon = params.dense_muon if muon else 0
    groups = (
        (params.dense - dense_muon, layout.dp, False),
        (dense_muon, layout.dp, True),
        (params.experts, layout.expert_dp, muon),
    )
    return [(shard_numel(numel, group), group, m) for numel, group, m in groups if numel]


def state_bytes_per_element(b: PrecisionBytes, muon: bool) -> int:
    """Master and moments of one sharded element: Muon keeps one moment (momentum), AdamW two."""
    return b.master + (b.moments // 2 if muon else b.moments)


def resolved_dispatcher(config: RunConfig, ep: int) -> str:
    """`parallel.expert.resolve_dispatcher` on GPUs: auto is local without EP, else no_sync with
    a capacity factor and all_to_all (dropless) without (`moetrain.moe.capacity`)."""
    if config.moe.dispatcher == "auto":
        return auto_dispatcher(ep, True, config.moe.capacity_factor)
    return config.moe.dispatcher


@dataclass(frozen=True)
class ExpertRows:
    """The rows one rank's experts take in one MoE layer for one micro-batch of `tokens` tokens
    (the dispatched rows; x 2 F the gate|up output, x F the SwiGLU output): docs/plan.md,
    "Expert buffer rows"."""

    dispatcher: str
    tokens: int
    routes: int  # T K: this rank's routes
    rows: int

    def describe(self) -> str:
        what = {
            "local": "all experts on the device, exactly the T*K routes",
            "all_to_all": "dropless, exact splits, T*K expected under uniform routing",
            "no_sync": "capacity mode, fixed blocks, routes beyond capacity dropped and counted",
        }.get(self.dispatcher, self.dispatcher)
        return (
            f"{self.rows:,} rows per MoE layer and micro-batch = {self.rows / self.routes:.2f} "
            f"x T*K (T*K = {self.routes:,}); {self.dispatcher}: {what}"
        )


def expert_rows(config: RunConfig, ep: int, tokens: int) -> ExpertRows:
    """`ExpertRows` of a rank at expert-parallel degree `ep` for `tokens` local tokens."""
    moe = config.moe
    dispatcher = resolved_dispatcher(config, ep)
    rows = expert_buffer_rows(
        dispatcher, tokens, moe.top_k, ep, moe.num_experts, moe.capacity_factor
    )
    return ExpertRows(dispatcher=dispatcher, tokens=tokens, routes=tokens * moe.top_k, rows=rows)


def norm_activation_bytes(a: int, tokens: int, width: int) -> int:
    """What one RMSNorm saves (moetrain.nn.norm): its input (a bytes each) and the fp32
    reciprocal RMS of each row."""
    return a * tokens * width + 4 * tokens


def block_activation_bytes(
    config: RunConfig, tokens: int, *, moe: bool, ep: int = 1
) -> tuple[int, int, int]:
    """Bytes autograd saves in one block's forward for `tokens` tokens (exact for bf16 eager with
    the local dispatcher and SDPA flash/cuDNN, which keep no S x S matrix), split into the
    attention half (attn_norm -> attention), ffn_norm, and the feed-forward (MoE layer or MLP,
    whose input, the norm's output, is among its saved tensors). Each term, in the letters of
    docs/plan.md ("Memory model"; R T: `expert_rows`), is a line of the code below."""
    m, moe_cfg = config.model, config.moe
    a = precision_bytes(config).activation
    T, S, D = tokens, config.train.seq_len, m.d_model
    H, N = m.dim_per_head, m.num_heads
    q, kv = N * H, m.kv_heads * H
    G = m.kv_heads
    # the fp32 reciprocal RMS of each normed row of q and k (the norms' input is the projection)
    qk_rstd = {"none": 0, "full": 8 * T, "per_head": 4 * T * (N + G)}[m.qk_norm]

    def norm(width: int) -> int:
        return norm_activation_bytes(a, T, width)

    attention = (
        norm(D)
        + a * T * (q + 2 * kv)  # the projection
        + qk_rstd
        + a * T * (D + 2 * q + kv)
        + 4 * T * N
        + 2 * a * S * H
    )
    ffn = a * T * D
    if not moe:
        return attention, norm(D), ffn + 4 * a * T * m.dense_hidden_size
    E, K, F = moe_cfg.num_experts, moe_cfg.top_k, moe_cfg.expert_hidden
    rows = expert_rows(config, ep, T).rows  # R T
    ffn += 8 * T * E + 4 * T + 4 * E  # router
    combine_outputs = a * T * K * D if ep > 1 else 0
    ffn += 24 * T * K + combine_outputs + 4 * T * K + 4 * (E // ep)  # dispatch and combine
    ffn += a * rows * (D + 3 * F)  # rows, gate|up (the swiglu's only save), its output
    ffn -= recomputed_swiglu_bytes(config, tokens, ep)
    ffn += 4 * a * T * F * moe_cfg.num_shared_experts
    return attention, norm(D), ffn


def recomputed_swiglu_bytes(config: RunConfig, tokens: int, ep: int = 1) -> int:
    """Bytes of the experts' SwiGLU output that FP8 experts do not hold from forward to
    backward (their SwiGLU backward writes it again, moe/fp8_experts.py); 0 otherwise."""
    if config.precision.experts != "fp8_rowwise":
        return 0
    a = precision_bytes(config).activation
    return a * expert_rows(config, ep, tokens).rows * config.moe.expert_hidden


def stage_activation_bytes(
    config: RunConfig, layout: Layout, stage: int, tokens: int
) -> tuple[int, int]:
    """(bytes kept per in-flight micro-batch, transient peak of the backward) for one stage,
    under its checkpointing mode (docs/plan.md: what each mode keeps, what the first and last
    stage add). The transient is one block's recomputed part plus the gradients of one MoE
    layer's largest intermediates, and on the last stage a chunk of logits."""
    m, b = config.model, precision_bytes(config)
    a = b.activation
    T, D, V = tokens, m.d_model, m.vocab_size
    ckpt = layout.activation_checkpointing
    _, num_dense, num_moe = stage_layers(config, layout.pp, stage)
    kept, recompute = 0, 0
    for is_moe, count in ((False, num_dense), (True, num_moe)):
        if count == 0:
            continue
        attention, ffn_norm, ffn = block_activation_bytes(config, T, moe=is_moe, ep=layout.ep)
        if ckpt == "full":
            kept += count * a * T * D
            recompute = max(recompute, attention + ffn_norm + ffn)
        elif ckpt == "moe" and is_moe:
            kept += count * (attention + ffn_norm + a * T * D)
            recompute = max(recompute, ffn - a * T * D)
        else:
            kept += count * (attention + ffn_norm + ffn)
    if num_moe:
        F = config.moe.expert_hidden
        recompute += a * expert_rows(config, layout.ep, T).rows * (D + 2 * F)
    if stage == 0:
        kept += 8 * T
    elif ckpt != "full":  # the received input; under full it is the first block's kept input
        kept += a * T * D
    if stage == layout.pp - 1:
        kept += norm_activation_bytes(a, T, D) + a * T * D + b.param * V * D
        recompute = max(recompute, (2 * a + 4) * min(T, LOSS_CHUNK_TOKENS) * V)
    return kept, recompute


def in_flight_microbatches(layout: Layout, stage: int, num_micro: int) -> float:
    """Micro-batches whose activations a stage holds at its peak (in whole-stage units)."""
    pp, v = layout.pp, INTERLEAVED_CHUNKS
    if layout.schedule == "gpipe":
        return float(num_micro)
    if layout.schedule == "interleaved_1f1b" and pp > 1:
        return min(float(num_micro), ((pp - stage - 1) * 2 + (v - 1) * pp + 1) / v)
    return float(min(pp - stage, num_micro))  # 1f1b and zero_bubble (ZB-H1)


@dataclass(frozen=True)
class Memory:
    """Bytes on one GPU at its peak."""

    params: int
    grads: int
    optimizer: int  # fp32 master + Adam moments (Muon: momentum), this rank's ZeRO-1 shards
    activations: int  # in-flight micro-batches x kept bytes
    transient: int
    overhead: int

    @property
    def peak(self) -> int:
        return sum(getattr(self, f.name) for f in dataclasses.fields(self))


def stage_memory(
    config: RunConfig,
    layout: Layout,
    stage: int,
    num_micro: int,
    overhead: int = 2 * GIB,
    activation_factor: float = 1.0,
) -> Memory:
    """Bytes of a stage's rank by docs/plan.md's memory table (ShardedAdamW's buffers, then
    activations, the backward's transient and the overhead). `activation_factor` scales the
    activations and the transient (1: eager autograd's bytes; `Cluster.activation_factor`)."""
    b = precision_bytes(config)
    params = rank_params(config, pp=layout.pp, ep=layout.ep, stage=stage)
    shards = optimizer_shards(params, layout, uses_muon(config))
    kept, transient = stage_activation_bytes(
        config, layout, stage, microbatch_tokens(config, layout)
    )
    return Memory(
        params=b.param * params.total,
        grads=b.grad * (params.total + sum(shard for shard, group, _ in shards if group > 1)),
        optimizer=sum(shard * state_bytes_per_element(b, muon) for shard, _, muon in shards),
        activations=int(
            in_flight_microbatches(layout, stage, num_micro) * kept * activation_factor
        ),
        transient=int(transient * activation_factor),
        overhead=overhead,
    )
