"""Start-up choices of train/model_build.py that fail with the field to change."""

from __future__ import annotations

import pytest
import torch

from moetrain.config.presets import tiny
from moetrain.train.model_build import resolve_param_dtype


def test_fp32_parameters_with_compiled_blocks_are_a_start_up_error():
    """torch.compile's shape function of torch._grouped_mm takes bf16 only (eager runs fp32), so
    the combination would fail at the first compiled forward, deep in a dynamo traceback."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_param_dtype(tiny(), cpu) == torch.float32  # compile is off on the CPU
    assert resolve_param_dtype(tiny(), cuda) == torch.bfloat16
    eager_fp32 = tiny().with_overrides(["precision.param_dtype=fp32", "parallel.compile=false"])
    assert resolve_param_dtype(eager_fp32, cuda) == torch.float32
    for overrides, device in (
        (["precision.param_dtype=fp32"], cuda),  # compile defaults on there
        (["parallel.compile=true"], cpu),
    ):
        with pytest.raises(ValueError, match="parallel.compile=false"):
            resolve_param_dtype(tiny().with_overrides(overrides), device)


def test_fp8_linears_are_installed_and_checked_at_start_up():
    """precision.linear=fp8_rowwise puts every attention and dense SwiGLU on the FP8 linear (the
    emulation on the CPU); a width the FP8 kernels cannot take is an error naming it."""
    from moetrain.model.transformer import Transformer
    from moetrain.nn.attention import Attention
    from moetrain.nn.mlp import SwiGLU
    from moetrain.train.model_build import apply_precision

    config = tiny().with_overrides(
        ["precision.linear=fp8_rowwise", "model.num_dense_layers=1", "model.dense_hidden=96"]
    )
    model = Transformer(config)
    apply_precision(model, config, torch.device("cpu"))
    kinds = [type(m) for m in model.modules() if getattr(m, "fp8", None) == "fp8-emulated"]
    assert kinds.count(Attention) == 2 and kinds.count(SwiGLU) == 1
    bad = tiny().with_overrides(["precision.linear=fp8_rowwise", "model.d_model=72"])
    with pytest.raises(ValueError, match="model.d_model=72"):
        apply_precision(Transformer(bad), bad, torch.device("cpu"))


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_a_start_up_error(monkeypatch):
    """An A100 (sm80), say: precision.linear and precision.experts=fp8_rowwise fail at start-up
    naming the GPU, never a silent emulation."""
    from moetrain.model.transformer import Transformer
    from moetrain.moe import grouped_gemm
    from moetrain.train import model_build

    reason = "FP8 tensor-core GEMMs need compute capability 9.x or 10.x; NVIDIA A100 has 8.0"
    monkeypatch.setattr(model_build, "fp8_unsupported_reason", lambda device: reason)
    monkeypatch.setattr(grouped_gemm, "fp8_unsupported_reason", lambda device: reason)
    cuda = torch.device("cuda")
    for field in ("precision.linear", "precision.experts", "precision.lm_head"):
        config = tiny().with_overrides([f"{field}=fp8_rowwise"])
        with pytest.raises(ValueError, match=f"{field}=fp8_rowwise is unavailable: .*A100"):
            model_build.apply_precision(Transformer(config), config, cuda)


@pytest.mark.parametrize("fast", [True, False])
def test_fp8_accumulation_choice_reaches_every_fp8_product(monkeypatch, fast):
    """precision.fp8_fast_accum is what the expert GEMM of every MoE layer and every FP8 linear
    is built with (a GPU with FP8 tensor cores stood in for: nothing runs here)."""
    from moetrain.model.transformer import Transformer
    from moetrain.moe import grouped_gemm
    from moetrain.nn.attention import Attention
    from moetrain.train import model_build

    monkeypatch.setattr(model_build, "fp8_unsupported_reason", lambda device: None)
    monkeypatch.setattr(grouped_gemm, "fp8_unsupported_reason", lambda device: None)
    config = tiny().with_overrides(
        [
            "precision.experts=fp8_rowwise",
            "precision.linear=fp8_rowwise",
            "precision.lm_head=fp8_rowwise",
            f"precision.fp8_fast_accum={str(fast).lower()}",
        ]
    )
    model = Transformer(config)
    model_build.apply_precision(model, config, torch.device("cuda"))
    gemms = [layer.experts.gemm for layer in model.moe_layers()]
    assert gemms and all(not g.emulated and g.use_fast_accum is fast for g in gemms)
    assert all(layer.dispatcher.fp8_rows for layer in model.moe_layers())  # the fused MLP's
    attention = [m for m in model.modules() if isinstance(m, Attention)]
    assert attention and all(m.fp8 == "fp8" and m.fp8_fast_accum is fast for m in attention)
    assert model.lm_head_fp8 == "fp8" and model.lm_head_fp8_fast_accum is fast


def test_fp8_lm_head_is_an_emulation_on_cpu_and_checks_its_widths():
    """precision.lm_head=fp8_rowwise: the head's products in FP8 (an emulation on the CPU); a
    vocabulary the kernels cannot take is an error naming it."""
    from moetrain.model.transformer import Transformer
    from moetrain.train.model_build import apply_precision

    config = tiny().with_overrides(["precision.lm_head=fp8_rowwise"])
    model = Transformer(config)
    assert model.lm_head_fp8 is None
    apply_precision(model, config, torch.device("cpu"))
    assert model.lm_head_fp8 == "fp8-emulated"
    bad = tiny().with_overrides(["precision.lm_head=fp8_rowwise", "model.vocab_size=260"])
    with pytest.raises(ValueError, match="model.vocab_size=260"):
        apply_precision(Transformer(bad), bad, torch.device("cpu"))
