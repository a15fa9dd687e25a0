"""Parameter, active-parameter and FLOP accounting: the single source of truth for MFU and bench.

Definitions (docs/benchmarks.md):
- active parameters per token: every parameter a token's forward touches, excluding the input
  embedding (a lookup, not a product) and including the LM head; of the experts, only top_k
  (plus shared experts) count.
- model FLOPs per token = 6 x active parameters + 6 x num_layers x d_model x seq_len (causal
  attention scores and values, forward + backward).
Muon's step (optim/muon.py) orthogonalizes every weight matrix of attention, the dense and shared
MLPs and the routed experts, gate and up apart: `muon_matrices` lists them and `muon_flops` counts
the Newton-Schulz products (optim/newton_schulz.py). Counts come from the config alone (no model
is built), so they work for trillion-parameter plans.
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
    muon: int  # the elements Muon updates (`muon_matrices`); AdamW updates the rest


def param_counts(config: RunConfig) -> ParamCounts:
    m, moe = config.model, config.moe
    D, H = m.d_model, m.dim_per_head
    q_dim, kv_dim = m.num_heads * H, m.kv_heads * H
    qk_norms = {"none": 0, "full": q_dim + kv_dim, "per_head": 2 * H}[m.qk_norm]
    attention = D * q_dim + 2 * D * kv_dim + q_dim * D + qk_norms
    block_norms = 2 * D
    expert = 3 * D * moe.expert_hidden
    shared = moe.num_shared_experts * expert
    router = moe.num_experts * D
    num_moe = m.num_layers - m.num_dense
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
        + m.num_dense * dense_mlp
        + num_moe * (router + shared)
        + experts_total
    )
    # a token touches top_k of each layer's experts; an untied model's input embedding is a lookup
    active = total - experts_total + num_moe * moe.top_k * expert - (embedding if lm_head else 0)
    muon = sum(count * rows * cols for count, rows, cols in muon_matrices(config))
    return ParamCounts(
        total=total,
        active=active,
        embedding=embedding,
        lm_head=lm_head,
        attention=m.num_layers * attention,
        experts=experts_total,
        dense=total - experts_total,
        muon=muon,
    )


def muon_matrices(config: RunConfig) -> list[tuple[int, int, int]]:
    """(count, rows, cols) of the matrices Muon orthogonalizes at each step, over the whole
    model: the attention projections q, k, v, o; the gate, up and down projections of the
    dense MLPs, of the shared experts and of every routed expert (gate and up are two matrices
    though stored as one tensor)."""
    m = config.model
    num_moe = m.num_layers - m.num_dense
    per_block = [
        (m.num_dense, _block_matrices(config, "dense")),
        (num_moe, _block_matrices(config, "moe") + _block_matrices(config, "experts")),
    ]
    shapes = [(blocks * n, r, c) for blocks, block in per_block for n, r, c in block]
    return [shape for shape in shapes if shape[0]]


def _block_matrices(config: RunConfig, part: str) -> list[tuple[int, int, int]]:
    """(count, rows, cols) of one block's Muon matrices: "dense" (a dense-MLP block), "moe" (a
    MoE block's attention and shared experts) or "experts" (its routed experts)."""
    m, moe = config.model, config.moe
    D, H = m.d_model, m.dim_per_head
    q_dim, kv_dim = m.num_heads * H, m.kv_heads * H
    if part == "experts":
        return [(3 * moe.num_experts, D, moe.expert_hidden)]
    attention = [(1, q_dim, D), (2, kv_dim, D), (1, D, q_dim)]
    if part == "dense":
        return [*attention, (3, m.dense_hidden_size, D)]
    shared = moe.num_shared_experts * moe.expert_hidden
    return attention + ([(3, shared, D)] if shared else [])


def muon_block_flops(config: RunConfig, part: str, steps: int | None = None) -> int:
    """Newton-Schulz FLOPs of one step over one block's `part` (`_block_matrices`): the
    planner's per-stage count."""
    steps = config.train.muon_ns_steps if steps is None else steps
    return sum(n * newton_schulz_flops(r, c, steps) for n, r, c in _block_matrices(config, part))


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """FLOPs (2 per multiply-add) of `steps` quintic Newton-Schulz steps on one rows x cols
    matrix, m the smaller side: per step X X^T (2 m^2 n), A^2 (2 m^3), (b A + c A^2) X (2 m^2 n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


def muon_flops(config: RunConfig, steps: int | None = None) -> int:
    """Newton-Schulz FLOPs of one Muon step over the whole model (`train.muon_ns_steps` steps
    unless `steps` is given); under expert or data parallelism each rank does its share."""
    steps = config.train.muon_ns_steps if steps is None else steps
    return sum(n * newton_schulz_flops(r, c, steps) for n, r, c in muon_matrices(config))


def flops_per_token(config: RunConfig, seq_len: int | None = None) -> int:
    """Model FLOPs per trained token (forward + backward)."""
    seq_len = seq_len or config.train.seq_len
    m = config.model
    return 6 * param_counts(config).active + 6 * m.num_layers * m.d_model * seq_len
