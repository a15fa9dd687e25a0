"""Mixtral (`MixtralForCausalLM`): every layer MoE, the softmax of the top-k router logits (a
softmax over all experts, renormalized over the top k: moe.renormalize), no q/k norm, GQA, any
head_dim; experts w1 (gate), w3 (up), w2 (down) under `block_sparse_moe` in Hub checkpoints.
Refused on import: sliding-window attention and router jitter noise."""

from __future__ import annotations

from typing import Any

from moetrain.config import RunConfig
from moetrain.tools.convert.format import ConfigReader, HFFormat, head_dim_field

# MixtralConfig's defaults, used for keys a config.json leaves out.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 4096 * 32,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_theta": 1e6,
    "num_experts_per_tok": 2,
    "num_local_experts": 8,
    "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0,
}


def write_config(config: RunConfig) -> dict[str, Any]:
    m, moe = config.model, config.moe
    return {
        "head_dim": m.dim_per_head,
        "intermediate_size": moe.expert_hidden,
        "num_local_experts": moe.num_experts,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
    }


def read_config(read: ConfigReader) -> tuple[dict[str, Any], dict[str, Any]]:
    read.require(
        "sliding_window",
        read.get("sliding_window") is None,
        "must be null: moetrain attends over the whole causal context",
    )
    read.require("router_jitter_noise", not read.get("router_jitter_noise"), "must be 0")
    read.require("attention_bias", not read.get("attention_bias"), "must be false")
    moe = {
        "num_experts": read.get("num_local_experts", "num_experts"),
        "expert_hidden": read.get("intermediate_size"),
        "renormalize": True,
    }
    return {"qk_norm": "none", "head_dim": head_dim_field(read)}, moe


FORMAT = HFFormat(
    name="mixtral",
    architecture="MixtralForCausalLM",
    model_type="mixtral",
    moe_module="block_sparse_moe",
    expert_weights=("w1", "w3", "w2"),
    defaults=DEFAULTS,
    write_config=write_config,
    read_config=read_config,
)
