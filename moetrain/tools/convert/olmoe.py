"""OLMoE (`OlmoeForCausalLM`): every layer MoE, a softmax router with optional top-k
renormalization (norm_topk_prob), RMSNorm over the full q and k projections (so heads span
hidden_size), no attention bias or qkv clipping."""

from __future__ import annotations

from typing import Any

from moetrain.config import RunConfig
from moetrain.tools.convert.format import ConfigReader, HFFormat

# OlmoeConfig's defaults, used for keys a config.json leaves out.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 50304,
    "hidden_size": 2048,
    "intermediate_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": None,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_theta": 10_000.0,
    "attention_bias": False,
    "clip_qkv": None,
    "num_experts_per_tok": 8,
    "num_experts": 64,
    "router_aux_loss_coef": 0.01,
    "norm_topk_prob": False,
}


def write_config(config: RunConfig) -> dict[str, Any]:
    moe = config.moe
    return {
        "intermediate_size": moe.expert_hidden,
        "attention_bias": False,
        "clip_qkv": None,
        "num_experts": moe.num_experts,
        "norm_topk_prob": moe.renormalize,
    }


def read_config(read: ConfigReader) -> tuple[dict[str, Any], dict[str, Any]]:
    read.require("attention_bias", not read.get("attention_bias"), "must be false")
    read.require("clip_qkv", read.get("clip_qkv") is None, "must be null")
    head_dim = read.get("head_dim")
    read.require(
        "head_dim",
        head_dim is None or head_dim * read.get("num_attention_heads") == read.get("hidden_size"),
        "must equal hidden_size / num_attention_heads",
    )
    moe = {
        "num_experts": read.get("num_experts"),
        "expert_hidden": read.get("intermediate_size"),
        "renormalize": bool(read.get("norm_topk_prob")),
    }
    return {"qk_norm": "full"}, moe


FORMAT = HFFormat(
    name="olmoe",
    architecture="OlmoeForCausalLM",
    model_type="olmoe",
    moe_module="mlp",
    expert_weights=("gate_proj", "up_proj", "down_proj"),
    defaults=DEFAULTS,
    write_config=write_config,
    read_config=read_config,
)
