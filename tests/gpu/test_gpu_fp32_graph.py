"""One process, fp32 parameters (the reference of the fp32 multi-rank GPU test): why its step is
not CUDA-graphed, and that it trains without a failed capture. torch._grouped_mm has a CUDA
kernel for bf16 only; fp32 expert GEMMs run as a loop over the experts that copies the offsets
to the host, which a capture refuses. These tests check that claim on the GPU, that it is the
step's only obstacle (with a bf16 expert GEMM swapped in, the fp32 step captures), and that the
trainer refuses the graph up front instead of warning after a failed capture."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

from moetrain.config.presets import tiny
from moetrain.moe.experts import BF16GroupedGemm
from moetrain.train.graph import StepGraph
from moetrain.train.trainer import Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FP32 = [
    "precision.param_dtype=fp32",
    "parallel.compile=false",
    "train.steps=4",
    "train.log_every=1",
    "train.eval_every=0",
    "train.checkpoint_every=0",
]

_CAPTURE = """
import torch
offs = torch.tensor([32, 64, 96, 128], dtype=torch.int32, device="cuda")
x = torch.randn(128, 64, device="cuda", dtype=torch.{dtype})
w = torch.randn(4, 64, 32, device="cuda", dtype=torch.{dtype})
torch._grouped_mm(x, w, offs=offs)  # warm-up, outside the capture
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph, capture_error_mode="thread_local"):
    y = torch._grouped_mm(x, w, offs=offs)
graph.replay()
print("captured")
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_grouped_mm_captures_in_bf16_only(dtype):
    """Each in its own process: a failed capture can leave the CUDA context unusable."""
    code = _CAPTURE.format(dtype=dtype)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert ("captured" in done.stdout) == (dtype == "bfloat16"), done.stderr[-2000:]


class _BF16Kernel(BF16GroupedGemm):
    """The bf16 kernel on fp32 operands: the expert GEMM that can be captured."""

    def __call__(self, x_ND, w_eDF, offs_e):
        return torch._grouped_mm(x_ND.bfloat16(), w_eDF.bfloat16(), offs=offs_e).to(x_ND.dtype)


def test_fp32_step_captures_once_the_expert_gemm_can(tmp_cache, tmp_path):
    """Everything else in the fp32 step is capturable: with the expert GEMM swapped for the bf16
    kernel, a strict StepGraph captures at step 3 and replays step 4."""
    config = tiny().with_overrides([*FP32, "train.cuda_graph=false"])
    trainer = Trainer(config, tmp_path, device="cuda", progress=False)
    for layer in trainer.model.moe_layers():
        layer.experts.gemm = _BF16Kernel()
    trainer.step_graph = StepGraph(
        trainer._device_step, trainer.accum_steps, trainer.device, strict=True
    )
    trainer.train()
    assert trainer.step_graph.graph is not None and trainer.step == 4


def test_fp32_run_is_not_graphed_and_warns_nothing(tmp_cache, tmp_path):
    config = tiny().with_overrides(FP32)
    trainer = Trainer(config, tmp_path / "auto", device="cuda", progress=False)
    assert trainer.step_graph is None
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="capturing the training step")
        trainer.train()
    with pytest.raises(ValueError, match=r"cuda_graph \(true\).*fp32 expert GEMMs"):
        Trainer(
            config.with_overrides(["train.cuda_graph=true"]),
            tmp_path / "forced",
            device="cuda",
            progress=False,
        )
