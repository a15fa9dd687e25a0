"""The precision plan: the `precision` section resolved once at start-up, for the device the step
runs on, into what each module runs; `apply_precision` installs it (a step of the parallelize
recipe). Modules never read the settings: they run the objects they hold.

    plan field     what runs it                                       precision.
    experts        every MoE layer's GroupedExperts.gemm (its MLP),   experts, fp8_fast_accum
                   and a local dispatcher's `quantized_rows`
    linear         every Attention's and SwiGLU's gemm (the           linear, fp8_fast_accum
                   projections, dense layers, shared experts; the
                   router stays bf16)
    lm_head        Transformer.head_products (the chunked loss)       lm_head, fp8_fast_accum
    dispatch       every dispatcher's payload                         dispatch
    param_dtype    the trainer's parameters                           param_dtype
    reduce_dtype   FSDP2's gradient reduction                         grad_dtype

A choice this device cannot run fails here, naming the field; an emulation (FP8 off the GPU) or
a setting that changes nothing is a note. Also resolved here, for the optimizer that
train/optimizer_build.py builds: `resolve_grad_dtype` (precision.grad_dtype under DDP and the sharded optimizers; the
master weights are precision.master_weights as it is), and what the precision means for the
whole-step CUDA graph (`cuda_graph_blocker`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetrain.config import RunConfig
from moetrain.model.transformer import Transformer
from moetrain.moe.dispatch import LocalDispatcher
from moetrain.moe.experts import BF16GroupedGemm, GroupedGemm
from moetrain.moe.grouped_gemm import FP8RowwiseEmulatedGroupedGemm, FP8RowwiseGroupedGemm
from moetrain.moe.mxfp8 import MXFP8EmulatedGroupedGemm
from moetrain.moe.payload import BF16_PAYLOAD, FP8_PAYLOAD, Payload
from moetrain.nn.attention import Attention
from moetrain.nn.fp8 import check_fp8_widths, fp8_unsupported_reason
from moetrain.nn.linear import BF16Linear, FP8Linear, LinearGemm
from moetrain.nn.loss import BF16HeadProducts, FP8HeadProducts, HeadProducts
from moetrain.nn.mlp import SwiGLU
from moetrain.parallel.mesh import ParallelDims

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# precision.grad_dtype -> FSDP2's reduce dtype (None: the parameters' own)
_REDUCE_DTYPES = {"fp32": torch.float32, "bf16": None}


@dataclass(frozen=True, kw_only=True)
class PrecisionPlan:
    """What each module runs (module docstring); built by `resolve_precision`."""

    param_dtype: torch.dtype
    experts: GroupedGemm
    linear: LinearGemm
    lm_head: HeadProducts
    dispatch: Payload
    reduce_dtype: torch.dtype | None  # None: FSDP2 reduces in the parameters' dtype


def resolve_precision(config: RunConfig, device: torch.device) -> PrecisionPlan:
    """The plan of `config.precision` on `device`; ValueError for a choice it cannot run (the
    parameter dtype included: `resolve_param_dtype`)."""
    return plan_precision(config, device, resolve_param_dtype(config, device))


def plan_precision(
    config: RunConfig, device: torch.device, param_dtype: torch.dtype
) -> PrecisionPlan:
    """The plan of `config.precision` on `device` for parameters in `param_dtype`, which the
    caller resolved; ValueError for a GEMM or payload choice it cannot run."""
    p = config.precision
    dispatch = _payload(config)
    linear, lm_head = _linear(config, device), _lm_head(config, device)
    return PrecisionPlan(
        param_dtype=param_dtype,
        experts=make_grouped_gemm(p.experts, device, use_fast_accum=p.fp8_fast_accum),
        linear=linear,
        lm_head=lm_head,
        dispatch=dispatch,
        reduce_dtype=_REDUCE_DTYPES[p.grad_dtype],
    )


def apply_precision(model: Transformer, precision: PrecisionPlan) -> None:
    """Install the plan in the model's modules (those of this pipeline stage) and in the
    dispatchers expert parallelism installed."""
    for module in model.modules():
        if isinstance(module, (Attention, SwiGLU)):
            module.gemm = precision.linear
    for layer in model.moe_layers():
        layer.experts.gemm = precision.experts
        layer.dispatcher.payload = precision.dispatch
        if isinstance(layer.dispatcher, LocalDispatcher):  # rows quantized before the K-fold gather
            layer.dispatcher.quantized_rows = precision.experts.quantized_rows
    model.head_products = precision.lm_head


def make_grouped_gemm(
    recipe: str, device: torch.device | str, *, use_fast_accum: bool = True
) -> GroupedGemm:
    """The expert GEMM for a precision recipe on `device` (the device the step runs on).

    "bf16": `torch._grouped_mm`. "fp8_rowwise": FP8 tensor cores on compute capability 9.x/10.x
    (fast accumulation unless `use_fast_accum=False`); on the CPU an emulation (for tests and
    debugging); any other device raises ValueError. "mxfp8": always the emulation (no MXFP8
    grouped kernel exists for Hopper).
    An emulation is announced with a note.
    """
    device = torch.device(device)
    if recipe == "bf16":
        return BF16GroupedGemm()
    if recipe == "mxfp8":
        return _emulation(recipe, MXFP8EmulatedGroupedGemm())
    if recipe != "fp8_rowwise":
        raise ValueError(
            f"precision.experts: unknown recipe {recipe!r}; valid: 'bf16', 'fp8_rowwise', 'mxfp8'"
        )
    if device.type == "cpu":
        return _emulation(recipe, FP8RowwiseEmulatedGroupedGemm(use_fast_accum=use_fast_accum))
    reason = fp8_unsupported_reason(device)
    if reason is not None:
        raise ValueError(
            f"precision.experts=fp8_rowwise is unavailable: {reason}; use 'bf16' or 'mxfp8' (emulation)"
        )
    return FP8RowwiseGroupedGemm(use_fast_accum=use_fast_accum)


def _emulation(recipe: str, gemm: GroupedGemm) -> GroupedGemm:
    print(f"note: precision.experts={recipe} runs as {gemm.name}: for studying numerics, not for speed")  # fmt: skip
    return gemm


def _fp8_emulated(setting: str, device: torch.device) -> bool:
    """False where FP8 tensor cores run; True off the GPU (numerics only, with a note); a GPU
    without them is a start-up error naming `setting`."""
    reason = fp8_unsupported_reason(device)
    if device.type == "cuda" and reason is not None:
        raise ValueError(f"{setting}=fp8_rowwise is unavailable: {reason}; use 'bf16'")
    if reason is not None:
        print(f"note: {setting}=fp8_rowwise runs as an emulation: numerics, not speed")
    return reason is not None


def _linear(config: RunConfig, device: torch.device) -> LinearGemm:
    """precision.linear: the attention projections and the dense and shared-expert SwiGLUs."""
    if config.precision.linear != "fp8_rowwise":
        return BF16Linear()
    emulate = _fp8_emulated("precision.linear", device)
    m, moe = config.model, config.moe
    widths = {
        "model.d_model": m.d_model,
        "num_heads * head_dim": m.num_heads * m.dim_per_head,
        "num_kv_heads * head_dim": m.kv_heads * m.dim_per_head,
    }
    if m.num_dense:
        widths["model.dense_hidden"] = m.dense_hidden_size
    if moe.num_shared_experts and m.num_dense < m.num_layers:
        widths["moe.expert_hidden * moe.num_shared_experts"] = (
            moe.expert_hidden * moe.num_shared_experts
        )
    check_fp8_widths("precision.linear=fp8_rowwise", **widths)
    return FP8Linear(emulate, config.precision.fp8_fast_accum)


def _lm_head(config: RunConfig, device: torch.device) -> HeadProducts:
    """precision.lm_head: the LM head's logits and input gradient (its weight gradient stays)."""
    if config.precision.lm_head != "fp8_rowwise":
        return BF16HeadProducts()
    emulate = _fp8_emulated("precision.lm_head", device)
    m = config.model
    check_fp8_widths(
        "precision.lm_head=fp8_rowwise",
        **{"model.d_model": m.d_model, "model.vocab_size": m.vocab_size},
    )
    return FP8HeadProducts(emulate, config.precision.fp8_fast_accum)


def _payload(config: RunConfig) -> Payload:
    """precision.dispatch: what the dispatched rows travel as."""
    if config.precision.dispatch != "fp8":
        return BF16_PAYLOAD
    if config.parallel.ep == 1:
        print(
            "note: precision.dispatch=fp8 without expert parallelism: no rows leave the device;"
            " the dispatched rows get the FP8 rounding only (same numerics as with ep > 1)"
        )
    return FP8_PAYLOAD


def resolve_param_dtype(config: RunConfig, device: torch.device) -> torch.dtype:
    """precision.param_dtype: auto is bf16 on CUDA and fp32 elsewhere. fp32 with compiled
    blocks is an error: torch.compile's shape function of torch._grouped_mm accepts bf16 only."""
    dtype = default_param_dtype(config, device)
    compiled = config.parallel.compiles(device.type)
    if dtype == torch.float32 and compiled and config.precision.experts == "bf16":
        raise ValueError(
            "precision.param_dtype (fp32) needs parallel.compile=false: compiled, the expert "
            "GEMM (torch._grouped_mm) takes bf16 only"
        )
    return dtype


def default_param_dtype(config: RunConfig, device: torch.device) -> torch.dtype:
    """precision.param_dtype with auto read (bf16 on CUDA, fp32 elsewhere), unchecked."""
    choice = config.precision.param_dtype
    if choice == "auto":
        choice = "bf16" if device.type == "cuda" else "fp32"
    return _DTYPES[choice]


def resolve_grad_dtype(
    model: Transformer, config: RunConfig, dims: ParallelDims
) -> torch.dtype | None:
    """The dtype gradients accumulate and are reduced in, when not the parameters' own (None).
    `precision.grad_dtype` fp32 with bf16 parameters gives fp32, except where nothing is
    accumulated or reduced (one micro-batch, one dp rank, no pipeline: a buffer would only add a
    pass); FSDP reduces its own; the sharded optimizers always take it (their buckets exist)."""
    if config.precision.grad_dtype != "fp32" or config.parallel.data_parallel == "fsdp":
        return None
    if all(p.dtype == torch.float32 for p in model.parameters()):
        return None
    accumulates = config.grad_accum_steps(dims.dp) > 1 or dims.dp > 1 or dims.pp > 1
    if not accumulates and config.train.optimizer not in ("sharded", "muon_sharded"):
        return None
    return torch.float32


def cuda_graph_blocker(config: RunConfig) -> str | None:
    """Why the precision keeps the step from being one CUDA graph, or None."""
    if config.precision.param_dtype == "fp32" and config.model.num_dense < (
        config.model.num_layers
    ):
        return (
            "fp32 expert GEMMs (precision.param_dtype=fp32): torch._grouped_mm has a CUDA "
            "kernel for bf16 only and runs other dtypes as a loop over the experts that "
            "copies the offsets to the host, which a capture refuses"
        )
    return None
