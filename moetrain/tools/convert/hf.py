"""Mapping between moetrain's Transformer and Hugging Face's OLMoE, Qwen3-MoE and Mixtral
(`OlmoeForCausalLM`, `Qwen3MoeForCausalLM`, `MixtralForCausalLM`): config and weights.

Pure functions, no file I/O (that is `io.py`), no `transformers` import. Letters: L layers,
E experts, D d_model, F expert hidden, Fd dense hidden, V vocabulary. A family is an `HFFormat`
(`format.py`; one module each). Which one a model exports to is decided by the fields' rules
(`config.fields.unexportable`): the q/k norm alone tells them apart (full: OLMoE, per_head:
Qwen3-MoE, none: Mixtral), so `export_format` finds the one format that expresses a config, or
names every field each format refuses.

Weight names, moetrain -> Hugging Face (per layer i, expert j; M the family's MoE module, `mlp`
or Mixtral's `block_sparse_moe`; gate/up/down its expert names, Mixtral's w1/w3/w2):
    embed.weight                         model.embed_tokens.weight
    blocks.i.attn_norm.weight            model.layers.i.input_layernorm.weight
    blocks.i.attn.{q,k,v,o}_proj.weight  model.layers.i.self_attn.{q,k,v,o}_proj.weight
    blocks.i.attn.{q,k}_norm.weight      model.layers.i.self_attn.{q,k}_norm.weight  (if qk-norm)
    blocks.i.ffn_norm.weight             model.layers.i.post_attention_layernorm.weight
    blocks.i.ffn.router.gate.weight      model.layers.i.M.gate.weight                (E, D)
    blocks.i.ffn.experts.w_up_eD2F       model.layers.i.M.experts.j.gate.weight      (F, D)
      = [gate | up] on the last dim      model.layers.i.M.experts.j.up.weight        (F, D)
    blocks.i.ffn.experts.w_down_eFD      model.layers.i.M.experts.j.down.weight      (D, F)
    blocks.i.ffn.w_gate_up.weight        model.layers.i.mlp.{gate,up}_proj.weight    (Fd, D) each
      = [gate; up] on the first dim      (a dense layer, Qwen3-MoE)
    blocks.i.ffn.w_down.weight           model.layers.i.mlp.down_proj.weight         (D, Fd)
    norm.weight                          model.norm.weight
    lm_head.weight                       lm_head.weight (absent when embeddings are tied)
Export writes this per-expert layout: the Hub's checkpoints, what transformers 5's
`save_pretrained` writes and 4.x loads; transformers 5 fuses it on load into 3-D
`mlp.experts.gate_up_proj` (E, 2F, D) and `mlp.experts.down_proj` (E, D, F), its in-memory
layout, under `mlp` in every family. Import reads both layouts, under either module name. Both
directions are exact: renames, transposes, slices, concatenations.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

from moetrain.config import ModelConfig, MoEConfig, RunConfig, TrainConfig
from moetrain.config.fields import FORMATS, unexportable
from moetrain.tools.convert import mixtral, olmoe, qwen3_moe
from moetrain.tools.convert.format import ConfigReader, HFFormat, common_config, read_common

ExpertLayout = Literal["per_expert", "fused"]

HF_FORMATS: dict[str, HFFormat] = {
    f.name: f for f in (olmoe.FORMAT, qwen3_moe.FORMAT, mixtral.FORMAT)
}
assert tuple(HF_FORMATS) == FORMATS, "every export format of config.fields has a converter"

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_W_UP, _W_DOWN = "ffn.experts.w_up_eD2F", "ffn.experts.w_down_eFD"
_FUSED_UP, _FUSED_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


# ---- formats -----------------------------------------------------------------------------------
def export_format(config: RunConfig, name: str | None = None) -> HFFormat:
    """The format `name`, or with None the one format that can express this model; a ValueError
    naming every field the format (each format) cannot represent, with the value and what is
    expressible. Each field declares that next to its definition (its `olmoe=`, `qwen3_moe=`,
    `mixtral=` rules in `moetrain.config.architecture`; a field without one exports its default
    only). Fields no exported model depends on (`in_model=False`: training settings) pass."""
    if name is not None and name not in HF_FORMATS:
        raise ValueError(f"export format ({name!r}) must be one of {', '.join(HF_FORMATS)}")
    candidates = [HF_FORMATS[name]] if name is not None else list(HF_FORMATS.values())
    refusals = []
    for fmt in candidates:
        problems = unexportable(config, fmt.name)
        if not problems:
            return fmt
        refusals.append(f"as {fmt.architecture}: " + "; ".join(problems))
    if name is not None:
        raise ValueError(f"cannot express this model {refusals[0]}")
    raise ValueError("no export format expresses this model; " + " | ".join(refusals))


def check_expressible(config: RunConfig, name: str | None = None) -> None:
    """A ValueError unless format `name` (None: some format) can represent the model."""
    export_format(config, name)


def import_format(hf_config: Mapping[str, Any]) -> HFFormat:
    """The family of a config.json, by its model_type."""
    model_type = hf_config.get("model_type")
    for fmt in HF_FORMATS.values():
        if model_type == fmt.model_type:
            return fmt
    known = ", ".join(f"{f.model_type!r} ({f.architecture})" for f in HF_FORMATS.values())
    raise ValueError(
        f"config.json model_type ({model_type!r}) must be one of {known}: only these "
        "checkpoints can be imported"
    )


# ---- config ------------------------------------------------------------------------------------
def hf_config_dict(
    config: RunConfig,
    *,
    format: str | None = None,
    dtype: str = "float32",
    eos_token_id: int | None = None,
) -> dict[str, Any]:
    """The config.json of the model's format (`export_format(config, format)`).

    `dtype` is the stored weights' dtype name ("float32", "bfloat16"). `eos_token_id` defaults to
    the byte tokenizer's end-of-document id when the run used it, else None."""
    fmt = export_format(config, format)
    if eos_token_id is None and config.data.tokenizer == "byte":
        from moetrain.data.tokenizer import ByteTokenizer

        eos_token_id = ByteTokenizer.eos_id
    return {
        "architectures": [fmt.architecture],
        "model_type": fmt.model_type,
        **common_config(config, eos_token_id, dtype),
        **fmt.write_config(config),
    }


def run_config_from_hf(hf_config: Mapping[str, Any], *, name: str = "imported") -> RunConfig:
    """A RunConfig whose model is that of a config.json (its family by model_type); training
    settings keep their defaults except train.seq_len = max_position_embeddings. Options
    moetrain lacks (other activations, attention biases, sliding windows, RoPE scaling, ...) are
    a ValueError naming each key and its value."""
    fmt = import_format(hf_config)
    read = ConfigReader(hf_config, fmt.defaults)
    model, moe = read_common(read)
    family_model, family_moe = fmt.read_config(read)
    if read.problems:
        raise ValueError(
            f"cannot import this {fmt.architecture} config.json: " + "; ".join(read.problems)
        )
    return RunConfig(
        name=name,
        model=ModelConfig(**model, **family_model),
        moe=MoEConfig(**moe, **family_moe),
        train=TrainConfig(seq_len=read.get("max_position_embeddings")),
    )


# ---- weights -----------------------------------------------------------------------------------
def _layer_renames(config: RunConfig) -> dict[str, str]:
    """moetrain name inside a block -> Hugging Face name inside a decoder layer, attention and
    norms (every family)."""
    names = [*_ATTN, *(("q_norm", "k_norm") if config.model.qk_norm != "none" else ())]
    return {
        "attn_norm.weight": "input_layernorm.weight",
        **{f"attn.{n}.weight": f"self_attn.{n}.weight" for n in names},
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }


def moetrain_shapes(config: RunConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of an exportable moetrain model's state dict, with its global shape."""
    m, moe = config.model, config.moe
    D, V, E, F, H = m.d_model, m.vocab_size, moe.num_experts, moe.expert_hidden, m.dim_per_head
    q_dim, kv_dim = m.num_heads * H, m.kv_heads * H
    q_norm, k_norm = {"full": (q_dim, kv_dim), "per_head": (H, H), "none": (0, 0)}[m.qk_norm]
    attention = {
        "attn_norm.weight": (D,),
        "attn.q_proj.weight": (q_dim, D),
        "attn.k_proj.weight": (kv_dim, D),
        "attn.v_proj.weight": (kv_dim, D),
        "attn.o_proj.weight": (D, q_dim),
        **({"attn.q_norm.weight": (q_norm,), "attn.k_norm.weight": (k_norm,)} if q_norm else {}),
        "ffn_norm.weight": (D,),
    }
    moe_ffn = {"ffn.router.gate.weight": (E, D), _W_UP: (E, D, 2 * F), _W_DOWN: (E, F, D)}
    Fd = m.dense_hidden_size
    dense_ffn = {"ffn.w_gate_up.weight": (2 * Fd, D), "ffn.w_down.weight": (D, Fd)}
    shapes = {"embed.weight": (V, D)}
    for i in range(m.num_layers):
        block = {**attention, **(dense_ffn if m.is_dense(i) else moe_ffn)}
        shapes.update({f"blocks.{i}.{name}": shape for name, shape in block.items()})
    shapes["norm.weight"] = (D,)
    if not m.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


def to_hf_state_dict(
    model_sd: Mapping[str, torch.Tensor],
    config: RunConfig,
    *,
    format: str | None = None,
    expert_layout: ExpertLayout = "per_expert",
) -> dict[str, torch.Tensor]:
    """moetrain state dict -> the format's state dict (names: module docstring), as views of
    `model_sd`'s tensors (no copy: a writer materializes one shard at a time).
    `expert_layout="fused"` gives transformers 5's in-memory names and 3-D expert tensors."""
    fmt = export_format(config, format)
    if expert_layout not in ("per_expert", "fused"):
        raise ValueError(f"expert_layout ({expert_layout!r}) must be 'per_expert' or 'fused'")
    _check_names_and_shapes("moetrain state dict", model_sd, moetrain_shapes(config))
    m, F = config.model, config.moe.expert_hidden
    gate, up, down = fmt.expert_weights
    hf: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model_sd["embed.weight"]}
    for i in range(m.num_layers):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        for ours, theirs in _layer_renames(config).items():
            hf[dst + theirs] = model_sd[src + ours]
        if m.is_dense(i):
            gate_up_2FD, Fd = model_sd[src + "ffn.w_gate_up.weight"], m.dense_hidden_size
            hf[dst + "mlp.gate_proj.weight"] = gate_up_2FD[:Fd]
            hf[dst + "mlp.up_proj.weight"] = gate_up_2FD[Fd:]
            hf[dst + "mlp.down_proj.weight"] = model_sd[src + "ffn.w_down.weight"]
            continue
        w_up_eD2F, w_down_eFD = model_sd[src + _W_UP], model_sd[src + _W_DOWN]
        block = dst + ("mlp" if expert_layout == "fused" else fmt.moe_module)
        hf[block + ".gate.weight"] = model_sd[src + "ffn.router.gate.weight"]
        if expert_layout == "fused":
            hf[dst + _FUSED_UP] = w_up_eD2F.transpose(1, 2)  # (E, 2F, D)
            hf[dst + _FUSED_DOWN] = w_down_eFD.transpose(1, 2)  # (E, D, F)
            continue
        for j in range(config.moe.num_experts):
            hf[f"{block}.experts.{j}.{gate}.weight"] = w_up_eD2F[j, :, :F].T
            hf[f"{block}.experts.{j}.{up}.weight"] = w_up_eD2F[j, :, F:].T
            hf[f"{block}.experts.{j}.{down}.weight"] = w_down_eFD[j].T
    hf["model.norm.weight"] = model_sd["norm.weight"]
    if not m.tie_embeddings:
        hf["lm_head.weight"] = model_sd["lm_head.weight"]
    return hf


def from_hf_state_dict(
    hf_sd: Mapping[str, torch.Tensor], config: RunConfig, *, format: str | None = None
) -> dict[str, torch.Tensor]:
    """The format's state dict (per-expert or fused experts, per layer, under the Hub's module
    name or `mlp`) -> moetrain state dict with contiguous tensors in the input's dtype. Missing
    or unexpected names and wrong shapes are a ValueError that lists them (missing ones by their
    Hub names). Ignored: RoPE `inv_freq` buffers that old checkpoints carry, and
    `lm_head.weight` when embeddings are tied (the head is the embedding)."""
    fmt = export_format(config, format)
    m, moe = config.model, config.moe
    remaining = {k: v for k, v in hf_sd.items() if not k.endswith("rotary_emb.inv_freq")}
    if m.tie_embeddings:
        remaining.pop("lm_head.weight", None)
    missing: list[str] = []

    def take(name: str, *aliases: str) -> torch.Tensor | None:
        for candidate in (name, *aliases):
            if candidate in remaining:
                return remaining.pop(candidate)
        missing.append(name)
        return None

    def take_ffn(layer: str, suffix: str, shape: tuple[int, ...] | None = None):
        """A feed-forward tensor, under the Hub's module name or transformers 5's `mlp`."""
        name, memory_name = f"{layer}{fmt.moe_module}.{suffix}", f"{layer}mlp.{suffix}"
        t = take(name, memory_name)
        if t is not None and shape is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, the config implies {shape}")
        return t

    out: dict[str, torch.Tensor | None] = {"embed.weight": take("model.embed_tokens.weight")}
    gate, up, down = fmt.expert_weights
    D, F, E = m.d_model, moe.expert_hidden, moe.num_experts
    for i in range(m.num_layers):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        for ours, theirs in _layer_renames(config).items():
            out[dst + ours] = take(src + theirs)
        if m.is_dense(i):
            Fd = m.dense_hidden_size
            shapes = {"gate": (Fd, D), "up": (Fd, D), "down": (D, Fd)}
            mlp = [take_ffn(src, f"{n}_proj.weight", shape) for n, shape in shapes.items()]
            if all(t is not None for t in mlp):
                out[dst + "ffn.w_gate_up.weight"] = torch.cat(mlp[:2])
                out[dst + "ffn.w_down.weight"] = mlp[2].contiguous()
            continue
        out[dst + "ffn.router.gate.weight"] = take_ffn(src, "gate.weight")
        fused = any(f"{src}{n}.experts.gate_up_proj" in remaining for n in (fmt.moe_module, "mlp"))
        if fused:
            gate_up_e2FD = take_ffn(src, "experts.gate_up_proj", (E, 2 * F, D))
            down_eDF = take_ffn(src, "experts.down_proj", (E, D, F))
            out[dst + _W_UP] = gate_up_e2FD.transpose(1, 2).contiguous()
            out[dst + _W_DOWN] = None if down_eDF is None else down_eDF.transpose(1, 2).contiguous()
            continue
        gates, ups, downs = (
            [take_ffn(src, f"experts.{j}.{name}.weight", shape) for j in range(E)]
            for name, shape in ((gate, (F, D)), (up, (F, D)), (down, (D, F)))
        )
        if any(t is None for t in gates + ups + downs):
            continue
        up_eD2F = [torch.cat([g.T, u.T], dim=-1) for g, u in zip(gates, ups, strict=True)]
        out[dst + _W_UP] = torch.stack(up_eD2F)
        out[dst + _W_DOWN] = torch.stack([d.T for d in downs]).contiguous()
    out["norm.weight"] = take("model.norm.weight")
    if not m.tie_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    if missing or remaining:
        problem = name_mismatch(missing, sorted(remaining))
        raise ValueError(
            f"Hugging Face state dict does not match the {fmt.architecture} config: {problem}"
        )
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
