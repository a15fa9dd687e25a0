"""What a Hugging Face model family is to the converter: `HFFormat`, and the config.json keys
the families share (their decoder blocks all read embed -> [norm, attention, norm, MoE or MLP]
-> norm -> head, with SwiGLU experts, RMSNorm and RoPE).

A family's module (`olmoe.py`, `qwen3_moe.py`, `mixtral.py`) holds one `HFFormat`: its names in
checkpoints and its own config.json keys, written from a RunConfig and read back through a
`ConfigReader`, which gives a key the family's default where config.json leaves it out (as
transformers does) and collects every key that moetrain cannot represent, so an import names
them all. No torch, no file I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from moetrain.config import RunConfig


class ConfigReader:
    """A config.json's values with the family's defaults, and the problems found reading it."""

    def __init__(self, hf_config: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
        self.hf_config, self.defaults = hf_config, defaults
        self.problems: list[str] = []

    def get(self, key: str, *aliases: str) -> Any:
        """The value of `key` (or of the first alias config.json has), else the default."""
        for name in (key, *aliases):
            if self.hf_config.get(name) is not None:
                return self.hf_config[name]
        return self.defaults.get(key)

    def require(self, key: str, holds: bool, what: str) -> None:
        """Record `key (value) what` unless `holds`."""
        if not holds:
            self.problems.append(f"{key} ({self.get(key)!r}) {what}")


@dataclass(frozen=True)
class HFFormat:
    """A Hugging Face model family moetrain converts to and from.

    `name` is its name in `config.fields.FORMATS` (each field's export rule) and `moetrain export
    --format`. Weights: each MoE block's module is `moe_module` in the Hub's per-expert
    checkpoints (transformers 5 names it `mlp` in memory, with fused expert tensors), its experts
    `experts.{j}.{gate}.weight` etc. with `expert_weights` = (gate, up, down). `defaults` are the
    config class's values for keys a config.json leaves out. `write_config` gives the family's
    own config.json keys for an expressible RunConfig; `read_config` returns the ModelConfig and
    MoEConfig fields the family sets beyond `read_common`'s, recording what it refuses."""

    name: str
    architecture: str
    model_type: str
    moe_module: str
    expert_weights: tuple[str, str, str]
    defaults: Mapping[str, Any]
    write_config: Callable[[RunConfig], dict[str, Any]]
    read_config: Callable[[ConfigReader], tuple[dict[str, Any], dict[str, Any]]]


def common_config(config: RunConfig, eos_token_id: int | None, dtype: str) -> dict[str, Any]:
    """The config.json keys every family has. RoPE theta is written both as `rope_parameters`
    (transformers 5) and `rope_theta` (transformers 4)."""
    m, moe = config.model, config.moe
    return {
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": config.train.seq_len,
        "initializer_range": m.init_std,
        "rms_norm_eps": m.norm_eps,
        "use_cache": True,
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "tie_word_embeddings": m.tie_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "rope_theta": m.rope_theta,
        "attention_dropout": 0.0,
        "num_experts_per_tok": moe.top_k,
        "output_router_logits": False,
        "router_aux_loss_coef": moe.lb_loss_weight,
        "dtype": dtype,
    }


def read_common(read: ConfigReader) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ModelConfig and MoEConfig fields every family's config.json gives, recording what
    moetrain lacks: another activation, RoPE scaling or partial rotation."""
    read.require("hidden_act", read.get("hidden_act") == "silu", "must be 'silu'")
    rope = read.get("rope_parameters") or read.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        read.problems.append(
            f"rope_parameters.rope_type ({rope_type!r}) must be 'default' (moetrain has no RoPE "
            "scaling)"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        read.problems.append(
            f"rope_parameters.partial_rotary_factor ({rope['partial_rotary_factor']}) must be 1"
        )
    theta = rope.get("rope_theta", read.get("rope_theta"))
    num_heads, num_kv_heads = read.get("num_attention_heads"), read.get("num_key_value_heads")
    model = {
        "vocab_size": read.get("vocab_size"),
        "d_model": read.get("hidden_size"),
        "num_layers": read.get("num_hidden_layers"),
        "num_heads": num_heads,
        "num_kv_heads": None if num_kv_heads in (None, num_heads) else num_kv_heads,
        "rope_theta": float(theta),
        "norm_eps": float(read.get("rms_norm_eps")),
        "tie_embeddings": bool(read.get("tie_word_embeddings")),
        "init_std": float(read.get("initializer_range")),
    }
    moe = {
        "top_k": read.get("num_experts_per_tok"),
        "lb_loss_weight": float(read.get("router_aux_loss_coef")),
    }
    return model, moe


def head_dim_field(read: ConfigReader) -> int | None:
    """model.head_dim of a config.json's head_dim: None where it is d_model / num_heads."""
    head_dim = read.get("head_dim")
    if head_dim is None or head_dim * read.get("num_attention_heads") == read.get("hidden_size"):
        return None
    return head_dim
