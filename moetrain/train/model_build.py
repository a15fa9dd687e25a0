"""The model a run trains, built as the recipe says (docs/design.md): on the meta device, then
parallelized (parallel/parallelize.py), materialized and initialized (`init_weights`), cast to
`precision.param_dtype`, and given the GEMM precisions of `precision.experts`, `.linear` and
`.lm_head`. FSDP is the exception: it shards weights already materialized. A precision this
machine cannot run fails at start-up, naming the field to change.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moetrain.config import RunConfig
from moetrain.model.transformer import Transformer
from moetrain.moe.grouped_gemm import make_grouped_gemm
from moetrain.nn.attention import Attention
from moetrain.nn.fp8 import check_fp8_widths, fp8_unsupported_reason
from moetrain.nn.mlp import SwiGLU
from moetrain.parallel.mesh import ParallelDims
from moetrain.parallel.parallelize import parallelize


def build_model(
    config: RunConfig,
    dims: ParallelDims,
    model_transform: Callable[[Transformer], None] | None = None,
) -> Transformer:
    """This rank's model, in training mode. `model_transform` changes the parallelized model
    before it is materialized (on meta; with FSDP after)."""
    param_dtype = resolve_param_dtype(config, dims.device)
    with torch.device("meta"):
        model = Transformer(config)
    fsdp = config.parallel.data_parallel == "fsdp"
    if fsdp:  # the baseline shards materialized, initialized weights (see parallel/data.py)
        _materialize(model, config, dims.device, param_dtype)
    model = parallelize(model, config, dims)
    if model_transform is not None:
        model_transform(model)
    if not fsdp:
        _materialize(model, config, dims.device, param_dtype)
    apply_precision(model, config, dims.device)
    model.train()
    return model


def _materialize(
    model: Transformer, config: RunConfig, device: torch.device, dtype: torch.dtype
) -> None:
    model.to_empty(device=device)
    model.init_weights(config.train.seed)
    for param in model.parameters():
        param.data = param.data.to(dtype)


def apply_precision(model: Transformer, config: RunConfig, device: torch.device) -> None:
    """Install the expert GEMM of `precision.experts` and the projections' precision of
    `precision.linear`; an unsupported choice fails here, never as a silent fallback
    (`precision.dispatch` is installed with the dispatchers, parallel/expert.py)."""
    if config.precision.dispatch == "fp8" and config.parallel.ep == 1:
        print(
            "note: precision.dispatch=fp8 without expert parallelism: no rows leave the device;"
            " the dispatched rows get the FP8 rounding only (same numerics as with ep > 1)"
        )
    if config.precision.linear == "fp8_rowwise":
        install_fp8_linears(model, config, device)
    if config.precision.lm_head == "fp8_rowwise":
        install_fp8_lm_head(model, config, device)
    if config.precision.experts == "bf16":
        return
    gemm = make_grouped_gemm(
        config.precision.experts, device, use_fast_accum=config.precision.fp8_fast_accum
    )
    for layer in model.moe_layers():
        layer.experts.gemm = gemm
        if hasattr(layer.dispatcher, "fp8_rows"):  # the local dispatchers: rows quantized there
            layer.dispatcher.fp8_rows = getattr(gemm, "takes_fp8_rows", False)
    if gemm.emulated:
        print(
            f"note: precision.experts={config.precision.experts} runs as {gemm.name}: "
            "for studying numerics, not for speed"
        )


def _fp8_mode(setting: str, device: torch.device) -> str:
    """ "fp8" where FP8 tensor cores run, "fp8-emulated" off the GPU (numerics only, with a
    note); a GPU without them is a start-up error naming `setting`."""
    reason = fp8_unsupported_reason(device)
    if device.type == "cuda" and reason is not None:
        raise ValueError(f"{setting}=fp8_rowwise is unavailable: {reason}; use 'bf16'")
    if reason is not None:
        print(f"note: {setting}=fp8_rowwise runs as an emulation: numerics, not speed")
    return "fp8" if reason is None else "fp8-emulated"


def install_fp8_linears(model: Transformer, config: RunConfig, device: torch.device) -> None:
    """precision.linear=fp8_rowwise: attention projections and dense SwiGLUs in FP8."""
    mode = _fp8_mode("precision.linear", device)
    m = config.model
    for module in model.modules():
        if isinstance(module, Attention):
            widths = {
                "model.d_model": m.d_model,
                "num_heads * head_dim": module.num_heads * module.head_dim,
                "num_kv_heads * head_dim": module.num_kv_heads * module.head_dim,
            }
        elif isinstance(module, SwiGLU):
            widths = {"d_model": m.d_model, "hidden": module.hidden}
        else:
            continue
        check_fp8_widths("precision.linear=fp8_rowwise", **widths)
        module.fp8 = mode
        module.fp8_fast_accum = config.precision.fp8_fast_accum


def install_fp8_lm_head(model: Transformer, config: RunConfig, device: torch.device) -> None:
    """precision.lm_head=fp8_rowwise: the LM head's logits and input gradient in FP8 (nn.loss)."""
    mode = _fp8_mode("precision.lm_head", device)
    m = config.model
    check_fp8_widths(
        "precision.lm_head=fp8_rowwise",
        **{"model.d_model": m.d_model, "model.vocab_size": m.vocab_size},
    )
    model.lm_head_fp8 = mode
    model.lm_head_fp8_fast_accum = config.precision.fp8_fast_accum


def resolve_param_dtype(config: RunConfig, device: torch.device) -> torch.dtype:
    """precision.param_dtype: auto is bf16 on CUDA and fp32 elsewhere. fp32 with compiled
    blocks is an error: torch.compile's shape function of torch._grouped_mm accepts bf16 only."""
    choice = config.precision.param_dtype
    if choice == "auto":
        choice = "bf16" if device.type == "cuda" else "fp32"
    compiled = config.parallel.compiles(device.type)
    if choice == "fp32" and compiled and config.precision.experts == "bf16":
        raise ValueError(
            "precision.param_dtype (fp32) needs parallel.compile=false: compiled, the expert "
            "GEMM (torch._grouped_mm) takes bf16 only"
        )
    return torch.bfloat16 if choice == "bf16" else torch.float32
