"""The precision plan (moetrain.parallel.precision): what `resolve_precision` builds from the
`precision` section, that the parallelize recipe installs it in every module that runs it, and
the start-up errors for choices this machine cannot run, naming the field to change."""

from __future__ import annotations

import pytest
import torch

from moetrain.config.presets import tiny
from moetrain.model.transformer import Transformer
from moetrain.moe.dispatch import LocalDispatcher
from moetrain.moe.experts import BF16GroupedGemm
from moetrain.moe.grouped_gemm import FP8RowwiseEmulatedGroupedGemm, FP8RowwiseGroupedGemm
from moetrain.moe.mxfp8 import MXFP8EmulatedGroupedGemm
from moetrain.moe.payload import BF16_PAYLOAD, FP8_PAYLOAD
from moetrain.nn.attention import Attention
from moetrain.nn.linear import BF16Linear, FP8Linear
from moetrain.nn.loss import BF16HeadProducts, FP8HeadProducts
from moetrain.nn.mlp import SwiGLU
from moetrain.parallel import precision
from moetrain.parallel.mesh import ParallelDims
from moetrain.parallel.parallelize import parallelize
from moetrain.parallel.precision import resolve_param_dtype, resolve_precision

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
ALL_FP8 = [
    "precision.experts=fp8_rowwise",
    "precision.linear=fp8_rowwise",
    "precision.lm_head=fp8_rowwise",
    "precision.dispatch=fp8",
]
# a dense layer and a shared expert: every kind of SwiGLU the linears' setting reaches
WIDE = ["model.num_dense_layers=1", "model.dense_hidden=96", "moe.num_shared_experts=1"]


def _parallelized(config, plan) -> Transformer:
    """The trainer's way, on the meta device: build, then the recipe with the plan."""
    with torch.device("meta"):
        model = Transformer(config)
    return parallelize(model, config, ParallelDims(local_rank=0, device=CPU), plan)


def test_fp32_parameters_with_compiled_blocks_are_a_start_up_error():
    """torch.compile's shape function of torch._grouped_mm takes bf16 only (eager runs fp32), so
    the combination would fail at the first compiled forward, deep in a dynamo traceback."""
    assert resolve_param_dtype(tiny(), CPU) == torch.float32  # compile is off on the CPU
    assert resolve_param_dtype(tiny(), CUDA) == torch.bfloat16
    eager_fp32 = tiny().with_overrides(["precision.param_dtype=fp32", "parallel.compile=false"])
    assert resolve_param_dtype(eager_fp32, CUDA) == torch.float32
    for overrides, device in (
        (["precision.param_dtype=fp32"], CUDA),  # compile defaults on there
        (["parallel.compile=true"], CPU),
    ):
        with pytest.raises(ValueError, match="parallel.compile=false"):
            resolve_param_dtype(tiny().with_overrides(overrides), device)


def test_the_default_plan_is_bf16_everywhere():
    plan = resolve_precision(tiny(), CPU)
    assert plan.param_dtype == torch.float32 and plan.reduce_dtype == torch.float32
    assert isinstance(plan.experts, BF16GroupedGemm) and isinstance(plan.linear, BF16Linear)
    assert isinstance(plan.lm_head, BF16HeadProducts) and plan.dispatch is BF16_PAYLOAD
    config = tiny().with_overrides(["precision.grad_dtype=bf16", "precision.experts=mxfp8"])
    plan = resolve_precision(config, CPU)
    assert plan.reduce_dtype is None and isinstance(plan.experts, MXFP8EmulatedGroupedGemm)


def test_the_recipe_installs_the_plan_in_every_module_that_runs_it(capsys):
    """Every attention and SwiGLU (dense layer, shared experts) gets the plan's linear, every MoE
    layer its expert GEMM, its dispatcher the payload and (local: rows stay on the device) the
    FP8 experts' quantized rows, the model the LM head's products: the emulations on the CPU,
    each announced once."""
    config = tiny().with_overrides([*ALL_FP8, *WIDE])
    plan = resolve_precision(config, CPU)
    assert plan.linear == FP8Linear(emulate=True, fast_accum=True)
    assert plan.lm_head == FP8HeadProducts(emulate=True, fast_accum=True)
    assert isinstance(plan.experts, FP8RowwiseEmulatedGroupedGemm)
    assert plan.dispatch is FP8_PAYLOAD
    notes = capsys.readouterr().out.splitlines()
    for field in ("dispatch", "linear", "lm_head", "experts"):
        assert sum(f"precision.{field}=" in n for n in notes) == 1, (field, notes)
    model = _parallelized(config, plan)
    kinds = [type(m) for m in model.modules() if getattr(m, "gemm", None) is plan.linear]
    assert kinds.count(Attention) == 2 and kinds.count(SwiGLU) == 2  # dense + shared
    layers = model.moe_layers()
    assert layers and all(layer.experts.gemm is plan.experts for layer in layers)
    for layer in layers:
        assert isinstance(layer.dispatcher, LocalDispatcher)
        assert layer.dispatcher.payload is FP8_PAYLOAD
        assert layer.dispatcher.quantized_rows == plan.experts.quantized_rows
    assert model.head_products is plan.lm_head
    assert capsys.readouterr().out == ""  # resolved once: installing it says nothing again


def test_widths_the_fp8_kernels_cannot_take_are_start_up_errors():
    for overrides, name in (
        (["precision.linear=fp8_rowwise", "model.d_model=72"], "model.d_model=72"),
        (["precision.linear=fp8_rowwise", *WIDE[:1], "model.dense_hidden=72"], "dense_hidden=72"),
        (
            ["precision.linear=fp8_rowwise", *WIDE[2:], "moe.expert_hidden=72"],
            "num_shared_experts=72",
        ),  # fmt: skip
        (["precision.lm_head=fp8_rowwise", "model.vocab_size=260"], "model.vocab_size=260"),
    ):
        with pytest.raises(ValueError, match=f"fp8_rowwise: FP8 GEMMs need widths .*{name}"):
            resolve_precision(tiny().with_overrides(overrides), CPU)


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_a_start_up_error(monkeypatch):
    """An A100 (sm80), say: precision.linear, precision.lm_head and precision.experts =
    fp8_rowwise fail at start-up naming the GPU, never a silent emulation."""
    reason = "FP8 tensor-core GEMMs need compute capability 9.x or 10.x; NVIDIA A100 has 8.0"
    monkeypatch.setattr(precision, "fp8_unsupported_reason", lambda device: reason)
    for field in ("precision.linear", "precision.experts", "precision.lm_head"):
        config = tiny().with_overrides([f"{field}=fp8_rowwise"])
        with pytest.raises(ValueError, match=f"{field}=fp8_rowwise is unavailable: .*A100"):
            resolve_precision(config, CUDA)


@pytest.mark.parametrize("fast", [True, False])
def test_fp8_accumulation_choice_reaches_every_fp8_product(monkeypatch, fast):
    """precision.fp8_fast_accum is what the expert GEMM, the linears and the LM head are built
    with, on the tensor cores (a GPU with FP8 tensor cores stood in for: nothing runs here)."""
    monkeypatch.setattr(precision, "fp8_unsupported_reason", lambda device: None)
    config = tiny().with_overrides([*ALL_FP8, f"precision.fp8_fast_accum={str(fast).lower()}"])
    plan = resolve_precision(config, CUDA)
    assert type(plan.experts) is FP8RowwiseGroupedGemm and plan.experts.use_fast_accum is fast
    assert plan.linear == FP8Linear(emulate=False, fast_accum=fast)
    assert plan.lm_head == FP8HeadProducts(emulate=False, fast_accum=fast)
