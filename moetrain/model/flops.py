"""Parameter, active-parameter and FLOP accounting: the single source of truth for MFU and bench.

Definitions (docs/benchmarks.md):
- active parameters per token: every parameter a token's forward touches, excluding the input
  embedding (a lookup, not a product) and including the LM head; of the experts, only top_k
  (plus shared experts) count.
- model FLOPs per token = 6 x active parameters + 6 x num_layers x d_model x seq_len (causal
  attention scores and values, forward + backward).
Counts come from the config alone (no model is built), so they work for trillion-parameter plans.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config import RunConfig


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int  # per token, excluding the input embedding, including the LM head
    embedding: int
    lm_head: int  # 0 when tied
    attention: int  # all layers, projections and qk-norms
    experts: int  # all routed experts of all layers
    dense: int  # everything that is not a routed expert (replicated under expert parallelism)


def param_counts(config: RunConfig) -> ParamCounts:
    m, moe = config.model, config.moe
    D, H = m.d_model, m.dim_per_head
    q_dim, kv_dim = m.num_heads * H, m.kv_heads * H
    attention = D * q_dim + 2 * D * kv_dim + q_dim * D + ((q_dim + kv_dim) if m.qk_norm else 0)
    block_norms = 2 * D
    expert = 3 * D * moe.expert_hidden
    shared = moe.num_shared_experts * expert
    router = moe.num_experts * D
    num_moe = m.num_layers - m.num_dense_layers
    dense_mlp = 3 * D * m.dense_hidden_size

    embedding = m.vocab_size * D
    lm_head = 0 if m.tie_embeddings else m.vocab_size * D
    per_layer_common = attention + block_norms
    experts_total = num_moe * moe.num_experts * expert
    total = (
        embedding
        + lm_head
        + D  # final norm
        + m.num_layers * per_layer_common
        + m.num_dense_layers * dense_mlp
        + num_moe * (router + shared)
        + experts_total
    )
    # a token touches top_k of each layer's experts; an untied model's input embedding is a lookup
    active = total - experts_total + num_moe * moe.top_k * expert - (embedding if lm_head else 0)
    return ParamCounts(
        total=total,
        active=active,
        embedding=embedding,
        lm_head=lm_head,
        attention=m.num_layers * attention,
        experts=experts_total,
        dense=total - experts_total,
    )


def flops_per_token(config: RunConfig, seq_len: int | None = None) -> int:
    """Model FLOPs per trained token (forward + backward)."""
    seq_len = seq_len or config.train.seq_len
    m = config.model
    return 6 * param_counts(config).active + 6 * m.num_layers * m.d_model * seq_len
