"""The MXFP8 expert product compiled as a compiled block runs it, against eager: output and both
gradients. Its autograd.Function reads `ctx.needs_input_grad`, the pattern that gave the
compiled FP8 row-scaled product zero gradients on the H200 (moe/fp8_ops.py); on the CPU the
compiled emulation matches eager exactly, so the GPU is where this can fail."""

from __future__ import annotations

import pytest
import torch

from moetrain.moe.mxfp8 import MXFP8EmulatedGroupedGemm

COUNTS = [1500, 0, 2500, 700, 1300, 17, 1000, 976]  # 8 uneven groups, one empty: 7993 rows
ROWS, D, F = 8192, 256, 128  # padding rows past the last offset; D, F multiples of 32


def _run(gemm, x, w, offs, g):
    """Rows within groups, and the gradients of sum(y * g) over them, in fp32."""
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    n = g.shape[0]
    y = gemm(x, w, offs)
    (y[:n].float() * g).sum().backward()
    return y[:n].detach().float(), x.grad[:n].float(), w.grad.float()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mxfp8_cuda_compiled_matches_eager():
    gen = torch.Generator().manual_seed(11)
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32).cuda()
    x = torch.randn(ROWS, D, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(len(COUNTS), D, F, generator=gen) / D**0.5).to("cuda", torch.bfloat16)
    g = torch.randn(sum(COUNTS), F, generator=gen).cuda()
    gemm = MXFP8EmulatedGroupedGemm()
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, o: gemm(a, b, o), fullgraph=True)
    names = ("output", "input gradient", "weight gradient")
    pairs = zip(names, _run(compiled, x, w, offs, g), _run(gemm, x, w, offs, g), strict=True)
    for name, got, want in pairs:
        assert want.abs().max() > 0, name
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err < 1e-2, (name, err)  # zero compiled gradients would give 1.0
