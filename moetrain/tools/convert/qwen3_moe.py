"""Qwen3-MoE (`Qwen3MoeForCausalLM`): a softmax router with optional top-k renormalization
(norm_topk_prob), no shared expert, RMSNorm of each head's q and k (head_dim wide: q_norm and
k_norm), GQA, any head_dim, dense SwiGLU layers (intermediate_size wide) where mlp_only_layers or
decoder_sparse_step put them (moe_intermediate_size is an expert's width). Refused on import:
attention biases and sliding-window attention."""

from __future__ import annotations

from typing import Any

from moetrain.config import RunConfig
from moetrain.tools.convert.format import ConfigReader, HFFormat, head_dim_field

# Qwen3MoeConfig's defaults, used for keys a config.json leaves out.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10_000.0,
    "attention_bias": False,
    "use_sliding_window": False,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "num_experts": 128,
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001,
    "mlp_only_layers": [],
}


def write_config(config: RunConfig) -> dict[str, Any]:
    m, moe = config.model, config.moe
    return {
        "head_dim": m.dim_per_head,
        "intermediate_size": m.dense_hidden_size,
        "moe_intermediate_size": moe.expert_hidden,
        "num_experts": moe.num_experts,
        "norm_topk_prob": moe.renormalize,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(m.num_layers) if m.is_dense(i)],
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
    }


def read_config(read: ConfigReader) -> tuple[dict[str, Any], dict[str, Any]]:
    read.require("attention_bias", not read.get("attention_bias"), "must be false")
    read.require(
        "use_sliding_window",
        not read.get("use_sliding_window"),
        "must be false: moetrain attends over the whole causal context",
    )
    num_experts = read.get("num_experts", "num_local_experts")
    read.require("num_experts", num_experts > 0, "must be > 0 (a Qwen3 without experts)")
    step = read.get("decoder_sparse_step")
    read.require("decoder_sparse_step", isinstance(step, int) and step >= 1, "must be >= 1")
    step = step if isinstance(step, int) and step >= 1 else 1
    # Qwen3MoeDecoderLayer: MoE unless listed in mlp_only_layers or off the sparse step
    mlp_only = set(read.get("mlp_only_layers") or ())
    layers = range(read.get("num_hidden_layers"))
    dense = tuple(i for i in layers if i in mlp_only or (i + 1) % step)
    first_n = dense == tuple(range(len(dense)))  # the first N: moetrain's num_dense_layers
    dense_hidden = read.get("intermediate_size")
    model = {
        "qk_norm": "per_head",
        "head_dim": head_dim_field(read),
        "num_dense_layers": len(dense) if first_n else 0,
        "dense_layers": () if first_n else dense,
        "dense_hidden": None if dense_hidden == 4 * read.get("hidden_size") else dense_hidden,
    }
    moe = {
        "num_experts": num_experts,
        "expert_hidden": read.get("moe_intermediate_size"),
        "renormalize": bool(read.get("norm_topk_prob")),
    }
    return model, moe


FORMAT = HFFormat(
    name="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    moe_module="mlp",
    expert_weights=("gate_proj", "up_proj", "down_proj"),
    defaults=DEFAULTS,
    write_config=write_config,
    read_config=read_config,
)
