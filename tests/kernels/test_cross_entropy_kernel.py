"""The Triton cross-entropy chunk (loss and scale * (softmax - onehot)) against the torch chunk it
replaces on CUDA (`moetrain.nn.loss._chunk_loss_and_grad`), on CUDA and, on CPU, through Triton's
interpreter; on CUDA also through `chunked_linear_cross_entropy`."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    TRITON_INSTALLED,
    interpreted,
    needs_cuda_and_triton,
    needs_interpreter,
    run_interpreted_tests,
)

from moetrain.nn import loss as loss_mod
from moetrain.nn.loss import _chunk_loss_and_grad

# configurations that exercise the loops' corners besides the defaults: several blocks with a
# ragged last one, groups of 16 and 32, no hints
CONFIGS = [{}, dict(block=256, num_warps=4, hints=False), dict(block=512, sub=16), dict(block=128, sub=32)]  # fmt: skip
CONFIG_IDS = ["-".join(f"{k}{x}" for k, x in c.items()) or "default" for c in CONFIGS]
# grad tolerance: fp32 math on both sides, rounded once to the output dtype (the interpreter
# truncates where CUDA rounds to nearest: one ulp)
RTOL = {torch.float32: 1e-5, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def make_inputs(rows, vocab, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 2
    if rows > 1:
        logits[1] *= 20  # a peaked row: softmax ~ one-hot, exp underflows for most columns
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    if rows:
        targets[0] = logits[0].argmax()  # a target at the row's maximum
    if rows > 2:
        targets[-1] = vocab - 1  # a target in the last (masked) block
    return logits.to(dtype=dtype, device=device), targets.to(device)


def check_kernel(cfg, rows, vocab, dtype, device, seed=0):
    """The kernel against the torch chunk on the same logits, which it must leave alone."""
    from moetrain.kernels.cross_entropy_triton import chunk_loss_and_grad_triton

    logits, targets = make_inputs(rows, vocab, dtype, device, seed)
    scale = 1.0 / (3 * max(rows, 1))
    ref_loss, ref_grad = _chunk_loss_and_grad(logits, targets, scale)
    before = logits.clone()
    loss, grad = chunk_loss_and_grad_triton(logits, targets, scale, **cfg)
    assert torch.equal(logits, before)
    assert loss.dtype == torch.float32 and loss.shape == () and grad.dtype == dtype
    assert grad.shape == logits.shape and grad.is_contiguous()
    torch.testing.assert_close(loss, ref_loss.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=RTOL[dtype], atol=scale * 1e-6)


def check_bad_targets_give_nan(cfg, device):
    """An id outside [0, V) makes its row's loss (so the sum) NaN, with no stray read; the
    other rows' gradients are still right."""
    from moetrain.kernels.cross_entropy_triton import chunk_loss_and_grad_triton

    logits, _ = make_inputs(3, 100, torch.float32, device, seed=5)
    good = torch.tensor([3, 7, 99], device=device)
    _, ref_grad = _chunk_loss_and_grad(logits, good, 1.0)
    for bad in (-1, 100, 1 << 40):
        targets = torch.tensor([3, bad, 99], device=device)
        loss, grad = chunk_loss_and_grad_triton(logits, targets, 1.0, **cfg)
        assert torch.isnan(loss)
        torch.testing.assert_close(grad[0::2], ref_grad[0::2], rtol=1e-5, atol=1e-6)


def test_cross_entropy_module_imports_without_triton():
    from moetrain.kernels import cross_entropy_triton

    assert cross_entropy_triton.triton_available() == TRITON_INSTALLED
    if not TRITON_INSTALLED:
        with pytest.raises(RuntimeError, match="Triton"):
            cross_entropy_triton.chunk_loss_and_grad_triton(
                torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 1.0
            )


def test_chunk_fn_picks_the_eager_torch_chunk_on_cpu():
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert loss_mod._chunk_fn(torch.device("cpu"), dtype) is _chunk_loss_and_grad


@needs_interpreter
def test_cross_entropy_triton_under_interpreter():
    """Runs this file's `interpreted` tests in a fresh process with TRITON_INTERPRET=1."""
    run_interpreted_tests(__file__)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), [(5, 7), (7, 1000)])
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_kernel_matches_torch_chunk_interpreted(cfg, rows, vocab, dtype):
    """V = 7: one masked block; V = 1000: several blocks with a masked tail."""
    check_kernel(cfg, rows, vocab, dtype, "cpu", seed=rows + vocab)


@interpreted
def test_kernel_at_the_model_vocabulary_interpreted():
    """V = 50304 at the default 8192-column blocks: 6 full blocks and a 1152-column tail."""
    check_kernel({}, 3, 50304, torch.bfloat16, "cpu", seed=1)


@interpreted
def test_fp16_and_no_rows_interpreted():
    check_kernel({}, 4, 300, torch.float16, "cpu", seed=2)
    check_kernel({}, 0, 300, torch.bfloat16, "cpu")


@interpreted
@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=CONFIG_IDS[:2])
def test_bad_targets_interpreted(cfg):
    check_bad_targets_give_nan(cfg, "cpu")


@interpreted
def test_rejects_bad_arguments_interpreted():
    from moetrain.kernels.cross_entropy_triton import chunk_loss_and_grad_triton as ce

    logits, targets = torch.zeros(4, 6), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="contiguous"):
        ce(torch.zeros(6, 4).t(), targets, 1.0)
    with pytest.raises(ValueError, match="targets"):
        ce(logits, targets[:3], 1.0)
    with pytest.raises(TypeError, match="bf16"):
        ce(logits.double(), targets, 1.0)
    with pytest.raises(ValueError, match="power"):
        ce(logits, targets, 1.0, block=1000)


# --- GPU: the compiled kernel ------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda_and_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), [(5, 7), (37, 1000), (300, 50304), (4096, 50304)])
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_kernel_matches_torch_chunk_cuda(cfg, rows, vocab, dtype):
    check_kernel(cfg, rows, vocab, dtype, "cuda", seed=rows + vocab)


@pytest.mark.gpu
@needs_cuda_and_triton
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_bad_targets_cuda(cfg):
    check_bad_targets_give_nan(cfg, "cuda")


@pytest.mark.gpu
@needs_cuda_and_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_uses_the_kernel_cuda(dtype):
    """`chunked_linear_cross_entropy` on CUDA runs the Triton chunk (three chunks, a ragged last
    one) and matches the full-logits reference and the compiled torch chunk."""
    from moetrain.kernels import cross_entropy_triton

    assert loss_mod._chunk_fn(torch.device("cuda"), dtype) is (
        cross_entropy_triton.chunk_loss_and_grad_triton
    )
    assert loss_mod._chunk_fn(torch.device("cuda"), torch.float64) is (
        loss_mod._compiled_torch_chunk()
    )
    gen = torch.Generator().manual_seed(0)
    T, D, V = 300, 64, 1000
    h = (torch.randn(T, D, generator=gen) / D**0.25).to("cuda", dtype).requires_grad_()
    w = (torch.randn(V, D, generator=gen) / D**0.25).to("cuda", dtype).requires_grad_()
    t = torch.randint(0, V, (T,), generator=gen).cuda()

    def run(fn):
        h.grad = w.grad = None
        loss = fn()
        (2.5 * loss).backward()
        return loss.detach(), h.grad.clone(), w.grad.clone()

    got = run(lambda: loss_mod.chunked_linear_cross_entropy(h, w, t, chunk_size=128))
    ref = run(lambda: loss_mod.linear_cross_entropy_reference(h, w, t))
    with pytest.MonkeyPatch.context() as patch:  # the torch chunk the kernel replaced
        patch.setattr(loss_mod, "_chunk_fn", lambda device, dtype: loss_mod._compiled_torch_chunk())
        torch_chunk = run(lambda: loss_mod.chunked_linear_cross_entropy(h, w, t, chunk_size=128))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-4)
    for want in (ref, torch_chunk):
        torch.testing.assert_close(got[0], want[0].float(), rtol=1e-5, atol=1e-5)
        for g, r in zip(got[1:], want[1:], strict=True):
            torch.testing.assert_close(g, r, **tol)
