"""Mapping between moetrain's Transformer and Hugging Face's `OlmoeForCausalLM`: config and weights.

Pure functions, no file I/O (that is `io.py`), no `transformers` import. Letters: L layers,
E experts, D d_model, F expert hidden, V vocabulary.

Weight names, moetrain -> Hugging Face (per layer i, expert j):
    embed.weight                         model.embed_tokens.weight
    blocks.i.attn_norm.weight            model.layers.i.input_layernorm.weight
    blocks.i.attn.{q,k,v,o}_proj.weight  model.layers.i.self_attn.{q,k,v,o}_proj.weight
    blocks.i.attn.{q,k}_norm.weight      model.layers.i.self_attn.{q,k}_norm.weight
    blocks.i.ffn_norm.weight             model.layers.i.post_attention_layernorm.weight
    blocks.i.ffn.router.gate.weight      model.layers.i.mlp.gate.weight                 (E, D)
    blocks.i.ffn.experts.w_up_eD2F       model.layers.i.mlp.experts.j.gate_proj.weight  (F, D)
      = [gate | up] on the last dim      model.layers.i.mlp.experts.j.up_proj.weight    (F, D)
    blocks.i.ffn.experts.w_down_eFD      model.layers.i.mlp.experts.j.down_proj.weight  (D, F)
    norm.weight                          model.norm.weight
    lm_head.weight                       lm_head.weight (absent when embeddings are tied)
Export writes this per-expert layout (the Hub's OLMoE checkpoints; transformers 5.x fuses it on
load into 3-D `mlp.experts.gate_up_proj` (E, 2F, D) and `mlp.experts.down_proj` (E, D, F));
import reads both layouts. Both directions are exact: renames, transposes, slices, concatenations.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

from moetrain.config import ModelConfig, MoEConfig, RunConfig, TrainConfig
from moetrain.config.fields import unexportable

ExpertLayout = Literal["per_expert", "fused"]

# moetrain name inside a block -> Hugging Face name inside a decoder layer.
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_LAYER_RENAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    **{f"attn.{n}.weight": f"self_attn.{n}.weight" for n in _ATTN},
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.router.gate.weight": "mlp.gate.weight",
}
_W_UP, _W_DOWN = "ffn.experts.w_up_eD2F", "ffn.experts.w_down_eFD"

# OlmoeConfig's defaults, used for keys a config.json leaves out.
_OLMOE_DEFAULTS: dict[str, Any] = {
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
    "attention_bias": False,
    "clip_qkv": None,
    "num_experts_per_tok": 8,
    "num_experts": 64,
    "router_aux_loss_coef": 0.01,
    "norm_topk_prob": False,
}


# ---- architecture ------------------------------------------------------------------------------
def check_expressible(config: RunConfig) -> None:
    """Raise a ValueError naming every field whose value `OlmoeForCausalLM` cannot represent,
    with the value and what is expressible. Each field declares that next to its definition (its
    `olmoe=` rule in `moetrain.config.sections`; a field without one exports its default value
    only): OLMoE has every layer MoE, a softmax router without expert bias, SwiGLU experts, no
    shared expert, qk-norm over d_model-wide projections and RoPE; GQA and tied embeddings are
    allowed. Fields no exported model depends on (`in_model=False`: training settings) pass.
    """
    problems = unexportable(config, "olmoe")
    if problems:
        raise ValueError("cannot express this model as OlmoeForCausalLM: " + "; ".join(problems))


def moetrain_shapes(config: RunConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of an OLMoE-expressible moetrain model's state dict, with its global shape."""
    m, moe = config.model, config.moe
    D, V, E, F = m.d_model, m.vocab_size, moe.num_experts, moe.expert_hidden
    q_dim, kv_dim = m.num_heads * m.dim_per_head, m.kv_heads * m.dim_per_head
    block = {
        "attn_norm.weight": (D,),
        "attn.q_proj.weight": (q_dim, D),
        "attn.k_proj.weight": (kv_dim, D),
        "attn.v_proj.weight": (kv_dim, D),
        "attn.o_proj.weight": (D, q_dim),
        "attn.q_norm.weight": (q_dim,),
        "attn.k_norm.weight": (kv_dim,),
        "ffn_norm.weight": (D,),
        "ffn.router.gate.weight": (E, D),
        _W_UP: (E, D, 2 * F),
        _W_DOWN: (E, F, D),
    }
    shapes = {"embed.weight": (V, D)}
    for i in range(m.num_layers):
        shapes.update({f"blocks.{i}.{name}": shape for name, shape in block.items()})
    shapes["norm.weight"] = (D,)
    if not m.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


# ---- config ------------------------------------------------------------------------------------
def hf_config_dict(
    config: RunConfig, *, dtype: str = "float32", eos_token_id: int | None = None
) -> dict[str, Any]:
    """The config.json of `OlmoeForCausalLM` for this run's model.

    `dtype` is the stored weights' dtype name ("float32", "bfloat16"). `eos_token_id` defaults to
    the byte tokenizer's end-of-document id when the run used it, else None. RoPE theta is written
    both as `rope_parameters` (transformers 5) and `rope_theta` (transformers 4).
    """
    check_expressible(config)
    m, moe = config.model, config.moe
    if eos_token_id is None and config.data.tokenizer == "byte":
        from moetrain.data.tokenizer import ByteTokenizer

        eos_token_id = ByteTokenizer.eos_id
    return {
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": moe.expert_hidden,
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
        "attention_bias": False,
        "attention_dropout": 0.0,
        "clip_qkv": None,
        "num_experts_per_tok": moe.top_k,
        "num_experts": moe.num_experts,
        "output_router_logits": False,
        "router_aux_loss_coef": moe.lb_loss_weight,
        "norm_topk_prob": moe.renormalize,
        "dtype": dtype,
    }


def run_config_from_hf(hf_config: Mapping[str, Any], *, name: str = "imported") -> RunConfig:
    """A RunConfig whose model is the OLMoE of a config.json; training settings keep their
    defaults except train.seq_len = max_position_embeddings. Unsupported OLMoE options (other
    activations, attention biases, qkv clipping, RoPE scaling) are a ValueError naming the key."""
    if hf_config.get("model_type") != "olmoe":
        raise ValueError(
            f"config.json model_type ({hf_config.get('model_type')!r}) must be 'olmoe': only "
            "OlmoeForCausalLM checkpoints can be imported"
        )

    def get(key: str) -> Any:
        value = hf_config.get(key)
        return _OLMOE_DEFAULTS[key] if value is None else value

    problems = []
    if get("hidden_act") != "silu":
        problems.append(f"hidden_act ({get('hidden_act')!r}) must be 'silu'")
    if get("attention_bias"):
        problems.append("attention_bias (True) must be false")
    if get("clip_qkv") is not None:
        problems.append(f"clip_qkv ({get('clip_qkv')}) must be null")
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        problems.append(f"rope_parameters.rope_type ({rope_type!r}) must be 'default'")
    rope_theta = rope.get("rope_theta", hf_config.get("rope_theta", 10_000.0))
    d_model, num_heads = get("hidden_size"), get("num_attention_heads")
    head_dim = hf_config.get("head_dim")
    if head_dim is not None and head_dim * num_heads != d_model:
        problems.append(f"head_dim ({head_dim}) must equal hidden_size / num_attention_heads")
    if problems:
        raise ValueError("cannot import this OLMoE config.json: " + "; ".join(problems))

    num_kv_heads = get("num_key_value_heads") or num_heads
    model = ModelConfig(
        vocab_size=get("vocab_size"),
        d_model=d_model,
        num_layers=get("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=None if num_kv_heads == num_heads else num_kv_heads,
        rope_theta=float(rope_theta),
        norm_eps=float(get("rms_norm_eps")),
        qk_norm="full",
        tie_embeddings=bool(get("tie_word_embeddings")),
        init_std=float(get("initializer_range")),
    )
    moe = MoEConfig(
        num_experts=get("num_experts"),
        top_k=get("num_experts_per_tok"),
        expert_hidden=get("intermediate_size"),
        renormalize=bool(get("norm_topk_prob")),
        lb_loss_weight=float(get("router_aux_loss_coef")),
    )
    train = TrainConfig(seq_len=get("max_position_embeddings"))
    return RunConfig(name=name, model=model, moe=moe, train=train)


# ---- weights -----------------------------------------------------------------------------------
def to_hf_state_dict(
    model_sd: Mapping[str, torch.Tensor],
    config: RunConfig,
    *,
    expert_layout: ExpertLayout = "per_expert",
) -> dict[str, torch.Tensor]:
    """moetrain state dict -> OlmoeForCausalLM state dict (names: module docstring), as views of
    `model_sd`'s tensors (no copy: a writer materializes one shard at a time).
    `expert_layout="fused"` gives transformers 5's 3-D expert tensors instead."""
    check_expressible(config)
    shapes = moetrain_shapes(config)
    _check_names_and_shapes("moetrain state dict", model_sd, shapes)
    F = config.moe.expert_hidden
    hf: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model_sd["embed.weight"]}
    for i in range(config.model.num_layers):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        for ours, theirs in _LAYER_RENAMES.items():
            hf[dst + theirs] = model_sd[src + ours]
        w_up_eD2F, w_down_eFD = model_sd[src + _W_UP], model_sd[src + _W_DOWN]
        if expert_layout == "fused":
            hf[dst + "mlp.experts.gate_up_proj"] = w_up_eD2F.transpose(1, 2)  # (E, 2F, D)
            hf[dst + "mlp.experts.down_proj"] = w_down_eFD.transpose(1, 2)  # (E, D, F)
            continue
        if expert_layout != "per_expert":
            raise ValueError(f"expert_layout ({expert_layout!r}) must be 'per_expert' or 'fused'")
        for j in range(config.moe.num_experts):
            hf[f"{dst}mlp.experts.{j}.gate_proj.weight"] = w_up_eD2F[j, :, :F].T
            hf[f"{dst}mlp.experts.{j}.up_proj.weight"] = w_up_eD2F[j, :, F:].T
            hf[f"{dst}mlp.experts.{j}.down_proj.weight"] = w_down_eFD[j].T
    hf["model.norm.weight"] = model_sd["norm.weight"]
    if not config.model.tie_embeddings:
        hf["lm_head.weight"] = model_sd["lm_head.weight"]
    return hf


def from_hf_state_dict(
    hf_sd: Mapping[str, torch.Tensor], config: RunConfig
) -> dict[str, torch.Tensor]:
    """OlmoeForCausalLM state dict (per-expert or fused experts, per layer) -> moetrain state
    dict with contiguous tensors in the input's dtype. Missing or unexpected names and wrong
    shapes are a ValueError that lists them. Ignored: RoPE `inv_freq` buffers that old
    checkpoints carry, and `lm_head.weight` when embeddings are tied (the head is the embedding).
    """
    check_expressible(config)
    remaining = {k: v for k, v in hf_sd.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.model.tie_embeddings:
        remaining.pop("lm_head.weight", None)
    missing: list[str] = []

    def take(name: str) -> torch.Tensor | None:
        if name in remaining:
            return remaining.pop(name)
        missing.append(name)
        return None

    out: dict[str, torch.Tensor | None] = {"embed.weight": take("model.embed_tokens.weight")}
    E = config.moe.num_experts
    for i in range(config.model.num_layers):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        for ours, theirs in _LAYER_RENAMES.items():
            out[dst + ours] = take(src + theirs)
        if src + "mlp.experts.gate_up_proj" in remaining:
            gate_up_e2FD = take(src + "mlp.experts.gate_up_proj")
            down_eDF = take(src + "mlp.experts.down_proj")
            out[dst + _W_UP] = gate_up_e2FD.transpose(1, 2).contiguous()
            out[dst + _W_DOWN] = None if down_eDF is None else down_eDF.transpose(1, 2).contiguous()
            continue
        experts = src + "mlp.experts."
        gates = [take(f"{experts}{j}.gate_proj.weight") for j in range(E)]
        ups = [take(f"{experts}{j}.up_proj.weight") for j in range(E)]
        downs = [take(f"{experts}{j}.down_proj.weight") for j in range(E)]
        if any(t is None for t in gates + ups + downs):
            continue
        F, D = config.moe.expert_hidden, config.model.d_model
        for kind, tensors, shape in (
            ("gate", gates, (F, D)),
            ("up", ups, (F, D)),
            ("down", downs, (D, F)),
        ):
            for j, t in enumerate(tensors):
                if tuple(t.shape) != shape:
                    raise ValueError(
                        f"{experts}{j}.{kind}_proj.weight has shape {tuple(t.shape)}, the config "
                        f"implies {shape}"
                    )
        up_eD2F = [torch.cat([g.T, u.T], dim=-1) for g, u in zip(gates, ups, strict=True)]
        out[dst + _W_UP] = torch.stack(up_eD2F)
        out[dst + _W_DOWN] = torch.stack([d.T for d in downs]).contiguous()
    out["norm.weight"] = take("model.norm.weight")
    if not config.model.tie_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    if missing or remaining:
        problem = name_mismatch(missing, sorted(remaining))
        raise ValueError(f"Hugging Face state dict does not match the OLMoE config: {problem}")
    result = {k: v for k, v in out.items() if v is not None}
    _check_names_and_shapes("imported state dict", result, moetrain_shapes(config))
    return result


def _check_names_and_shapes(
    what: str, sd: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]
) -> None:
    missing = [k for k in shapes if k not in sd]
    unexpected = [k for k in sd if k not in shapes]
    if missing or unexpected:
        problem = name_mismatch(missing, unexpected)
        raise ValueError(f"{what} does not match the config: {problem}")
    for name, shape in shapes.items():
        if tuple(sd[name].shape) != shape:
            raise ValueError(
                f"{what}: {name} has shape {tuple(sd[name].shape)}, the config implies {shape}"
            )


def name_mismatch(
    missing: list[str], unexpected: list[str], labels: tuple[str, str] = ("missing", "unexpected")
) -> str:
    """The names each side lacks, labelled, at most 8 of each shown; '' when there are none."""
    shown = []
    for label, names in zip(labels, (missing, unexpected), strict=True):
        if names:
            more = f" and {len(names) - 8} more" if len(names) > 8 else ""
            shown.append(f"{label} {', '.join(names[:8])}{more}")
    return "; ".join(shown)
