"""SwiGLU: the references against float64 autograd of silu(g) * u, the CPU autograd Function, and
the Triton ops against the references on CUDA and, on CPU, through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    TRITON_INSTALLED,
    assert_compiled_matches_eager,
    assert_within,
    interpreted,
    needs_cuda_and_triton,
    needs_interpreter,
    run_interpreted_tests,
)

from moetrain.kernels.swiglu import (
    swiglu,
    swiglu_backward_reference,
    swiglu_reference,
    weighted_swiglu_backward_reference,
)


def randn(*shape, dtype=torch.float32, seed=0, device="cpu", scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=gen)).to(dtype=dtype, device=device)


def exact(h_N2F, grad_NF):
    """float64 autograd of the obvious expression, on the same (rounded) inputs."""
    h = h_N2F.detach().double().requires_grad_()
    gate, up = h.chunk(2, dim=-1)
    out = F.silu(gate) * up
    return out.detach(), torch.autograd.grad(out, h, grad_NF.double())[0]


def scales(h_N2F, grad_NF):
    """float64 bounds on the terms of the forward and of [dgate | dup]: fp32 rounding errors are
    relative to these, not to the results (1 + g (1 - s) cancels near g = -1.28)."""
    gate, up = h_N2F.double().abs().chunk(2, dim=-1)
    s = torch.sigmoid(h_N2F.double().chunk(2, dim=-1)[0])
    g = grad_NF.double().abs()
    return gate * s * up, torch.cat([g * up * s * (1 + gate * (1 - s)), g * gate * s], dim=-1)


def exact_weighted(h_N2F, w_N, grad_NF):
    """float64 autograd of w * silu(g) * u: (out, grad_h, grad_w)."""
    h = h_N2F.detach().double().requires_grad_()
    w = w_N.detach().double().requires_grad_()
    gate, up = h.chunk(2, dim=-1)
    out = F.silu(gate) * up * w[:, None]
    grad_h, grad_w = torch.autograd.grad(out, (h, w), grad_NF.double())
    return out.detach(), grad_h, grad_w


def weighted_scales(h_N2F, w_N, grad_NF):
    """`scales` times |w| per row, and the sum of |grad * silu(g) * u| over a row (dw's terms)."""
    scale_out, scale_grad = scales(h_N2F, grad_NF)
    abs_w = w_N.double().abs()[:, None]
    gate, up = h_N2F.double().chunk(2, dim=-1)
    scale_w = (grad_NF.double().abs() * (gate * torch.sigmoid(gate) * up).abs()).sum(-1)
    return scale_out * abs_w, scale_grad * abs_w, scale_w


def row_weights(N, seed=0, device="cpu", dtype=torch.float32):
    """Router-like weights in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(N, generator=gen).to(dtype=dtype, device=device)


# --- references and the CPU autograd Function --------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,F_", [(1, 3), (37, 17), (8, 64)])
def test_references_match_float64_autograd(N, F_, dtype):
    h = randn(N, 2 * F_, dtype=dtype, seed=N + F_)
    g = randn(N, F_, dtype=dtype, seed=N + F_ + 1)
    out, grad_h = swiglu_reference(h), swiglu_backward_reference(h, g)
    assert out.dtype == grad_h.dtype == dtype
    assert out.shape == (N, F_) and grad_h.shape == (N, 2 * F_)
    exact_out, exact_grad = exact(h, g)
    if dtype == torch.float64:
        torch.testing.assert_close(out, exact_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad_h, exact_grad, rtol=1e-12, atol=1e-12)
    else:  # fp32 math rounded once to nearest: half an ulp, plus fp32 errors
        scale_out, scale_grad = scales(h, g)
        assert_within(out, exact_out, scale_out, dtype, ulps=0.5)
        assert_within(grad_h, exact_grad, scale_grad, dtype, ulps=0.5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,F_", [(1, 3), (37, 17), (8, 64)])
def test_weighted_references_match_float64_autograd(N, F_, dtype):
    h = randn(N, 2 * F_, dtype=dtype, seed=N + F_)
    g = randn(N, F_, dtype=dtype, seed=N + F_ + 1)
    w = row_weights(N, seed=N, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    out = swiglu_reference(h, w)
    grad_h, grad_w = weighted_swiglu_backward_reference(h, g, w)
    assert out.dtype == grad_h.dtype == dtype and grad_w.dtype == w.dtype
    exact_out, exact_grad, exact_w = exact_weighted(h, w, g)
    if dtype == torch.float64:
        for got, want in ((out, exact_out), (grad_h, exact_grad), (grad_w, exact_w)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    else:
        scale_out, scale_grad, scale_w = weighted_scales(h, w, g)
        assert_within(out, exact_out, scale_out, dtype, ulps=0.5)
        assert_within(grad_h, exact_grad, scale_grad, dtype, ulps=0.5)
        assert_within(grad_w, exact_w, scale_w, torch.float32, ulps=0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_swiglu_on_cpu_is_the_references(dtype):
    h = randn(37, 34, dtype=dtype, seed=3).requires_grad_()
    w = row_weights(37, seed=4).requires_grad_()
    g = randn(37, 17, dtype=dtype, seed=5)
    out = swiglu(h, w)
    assert torch.equal(out, swiglu_reference(h.detach(), w.detach()))
    grad_h, grad_w = torch.autograd.grad(out, (h, w), g)
    ref_h, ref_w = weighted_swiglu_backward_reference(h.detach(), g, w.detach())
    assert torch.equal(grad_h, ref_h) and torch.equal(grad_w, ref_w)


def test_weighted_swiglu_passes_gradcheck():
    h = randn(5, 14, dtype=torch.float64, seed=5).requires_grad_()
    w = row_weights(5, seed=6, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(swiglu, (h, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_on_cpu_is_the_references(dtype):
    h = randn(37, 34, dtype=dtype, seed=3).requires_grad_()
    g = randn(37, 17, dtype=dtype, seed=4)
    out = swiglu(h)
    assert torch.equal(out, swiglu_reference(h.detach()))
    (grad_h,) = torch.autograd.grad(out, h, g)
    assert torch.equal(grad_h, swiglu_backward_reference(h.detach(), g))


def test_swiglu_passes_gradcheck():
    h = randn(5, 14, dtype=torch.float64, seed=5).requires_grad_()
    assert torch.autograd.gradcheck(swiglu, (h,))


def saved_bytes(fn, h):
    """Bytes of the tensors autograd saves for fn(h), by storage, and whether all are h's."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(h)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(storages.values()), set(storages) == {h.untyped_storage().data_ptr()}


def test_swiglu_saves_only_its_input():
    x = randn(16, 8, dtype=torch.bfloat16, seed=6).requires_grad_()
    h = x @ randn(8, 40, dtype=torch.bfloat16, seed=7)
    nbytes, only_h = saved_bytes(swiglu, h)
    assert only_h and nbytes == h.numel() * h.element_size()
    w = row_weights(16, seed=8).requires_grad_()
    nbytes, _ = saved_bytes(lambda h: swiglu(h, w), h)
    assert nbytes == h.numel() * h.element_size() + w.numel() * w.element_size()


@pytest.mark.parametrize(
    "h", [torch.zeros(6), torch.zeros(4, 7), torch.zeros(2, 3, 4), torch.zeros(6, 4).t()]
)
def test_swiglu_rejects_other_layouts(h):
    with pytest.raises(ValueError, match="swiglu"):
        swiglu(h)


def test_swiglu_compiles_fullgraph_on_cpu():
    def layer(x, w_up, w_down, w_rows):
        return swiglu(x @ w_up, w_rows) @ w_down

    def run(fn):
        x = randn(64, 32, seed=8).requires_grad_()
        w_up = (randn(32, 96, seed=9) / 8).requires_grad_()
        w_down = (randn(48, 32, seed=10) / 8).requires_grad_()
        w_rows = row_weights(64, seed=11).requires_grad_()
        out = fn(x, w_up, w_down, w_rows)
        out.square().sum().backward()
        return out, x.grad, w_up.grad, w_down.grad, w_rows.grad

    torch._dynamo.reset()
    compiled = run(torch.compile(layer, fullgraph=True))
    for c, e in zip(compiled, run(layer), strict=True):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5 * e.abs().max().item())


def test_swiglu_triton_module_imports_without_triton():
    from moetrain.kernels import swiglu_triton

    assert swiglu_triton.triton_available() == TRITON_INSTALLED


# --- Triton ops == references ------------------------------------------------------------------


def check_weighted_triton_ops(N, F_, dtype, device, seed=0):
    """The op with row weights: out, grad_h and grad_w against the references and float64 (grad_w
    within one fp32 ulp plus the fp32 rounding of its row sum)."""
    from moetrain.kernels.swiglu_triton import swiglu_triton

    h = randn(N, 2 * F_, dtype=dtype, seed=seed, device=device).requires_grad_()
    w = row_weights(N, seed=seed + 2, device=device).requires_grad_()
    g = randn(N, F_, dtype=dtype, seed=seed + 1, device=device)
    out = swiglu_triton(h, w)
    grad_h, grad_w = torch.autograd.grad(out, (h, w), g)
    assert out.dtype == grad_h.dtype == dtype and grad_w.dtype == torch.float32
    hd, wd = h.detach(), w.detach()
    scale_out, scale_grad, scale_w = weighted_scales(hd, wd, g)
    exact_out, exact_grad, exact_w = exact_weighted(hd, wd, g)
    ref_grad, ref_w = weighted_swiglu_backward_reference(hd, g, wd)
    assert_within(out, swiglu_reference(hd, wd), scale_out, dtype)
    assert_within(out, exact_out, scale_out, dtype)
    assert_within(grad_h, ref_grad, scale_grad, dtype)
    assert_within(grad_h, exact_grad, scale_grad, dtype)
    assert_within(grad_w, ref_w, scale_w, torch.float32)
    assert_within(grad_w, exact_w, scale_w, torch.float32)


def check_triton_ops(N, F_, dtype, device, seed=0):
    """Forward and backward of the Triton op, through autograd, against the fp32 references
    (within one ulp: both round fp32 values that differ by a few fp32 ulps, from different exp
    and division code, and the interpreter truncates where CUDA rounds to nearest) and against
    float64 on the same inputs; a strided h and an expanded gradient give the same bits. The
    same with row weights."""
    check_weighted_triton_ops(N, F_, dtype, device, seed)
    from moetrain.kernels.swiglu_triton import swiglu_triton

    wide = randn(N, 2 * F_ + 16, dtype=dtype, seed=seed, device=device)
    h = wide[:, : 2 * F_].contiguous().requires_grad_()
    g = randn(N, F_, dtype=dtype, seed=seed + 1, device=device)
    out = swiglu_triton(h)
    (grad_h,) = torch.autograd.grad(out, h, g, retain_graph=True)
    assert out.dtype == grad_h.dtype == dtype
    assert out.shape == (N, F_) and grad_h.shape == (N, 2 * F_) and grad_h.is_contiguous()
    scale_out, scale_grad = scales(h.detach(), g)
    exact_out, exact_grad = exact(h, g)
    assert_within(out, swiglu_reference(h.detach()), scale_out, dtype)
    assert_within(out, exact_out, scale_out, dtype)
    assert_within(grad_h, swiglu_backward_reference(h.detach(), g), scale_grad, dtype)
    assert_within(grad_h, exact_grad, scale_grad, dtype)

    strided = wide[:, : 2 * F_].requires_grad_()  # row stride 2F + 16
    assert torch.equal(swiglu_triton(strided), out)
    g_row = g[:1].expand(N, F_)  # row stride 0
    (grad_strided,) = torch.autograd.grad(swiglu_triton(strided), strided, g_row)
    assert torch.equal(grad_strided, torch.autograd.grad(out, h, g_row.contiguous())[0])


def check_fp8_triton_ops(N, F_, dtype, device, weighted, seed=0):
    """The fused FP8 variants: (q, scale) equal the reference quantization of the plain Triton
    ops' rows; dh and the backward's recomputed forward output equal the plain ops bit for bit;
    dw as the plain op's (sum order may differ across column blocks: within fp32 rounding)."""
    from moetrain.kernels import quant
    from moetrain.kernels.swiglu_triton import (
        swiglu_fp8_backward_triton,
        swiglu_fp8_triton,
        swiglu_triton,
    )

    h = randn(N, 2 * F_, dtype=dtype, seed=seed, device=device)
    g = randn(N, F_, dtype=dtype, seed=seed + 1, device=device)
    w = row_weights(N, seed=seed + 2, device=device) if weighted else None
    out = swiglu_triton(h, w)
    q, scale = swiglu_fp8_triton(h, w)
    q_ref, scale_ref = quant.quantize_fp8_rowwise(out)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scale, scale_ref)

    dh, q, scale, dw, out_again = swiglu_fp8_backward_triton(h, g, w)
    assert torch.equal(out_again, out)
    want_dh, want_dw = torch.ops.moetrain.swiglu_backward(h, g, w)
    assert torch.equal(dh, want_dh)
    q_ref, scale_ref = quant.quantize_fp8_rowwise(dh)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scale, scale_ref)
    if weighted:  # a row sum of 2F products: fp32 rounding relative to the sum of |terms|
        scale_w = weighted_scales(h.float(), w, g.float())[2]
        assert ((dw.double() - want_dw.double()).abs() <= 1e-5 * scale_w + 1e-30).all()
    else:
        assert dw is None


@needs_interpreter
def test_triton_swiglu_under_interpreter():
    """Runs this file's `interpreted` tests in a fresh process with TRITON_INTERPRET=1 (the ops
    run eagerly on CPU tensors there; their compile path is covered by the CUDA tests)."""
    run_interpreted_tests(__file__)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,F_", [(1, 3), (37, 17), (9, 512), (5, 600), (3, 1024)])
def test_triton_ops_match_references_interpreted(N, F_, dtype):
    """F = 3, 17, 600: masked column tails (600: a full 512 block and a masked one)."""
    check_triton_ops(N, F_, dtype, "cpu", seed=N + F_)


@interpreted
@pytest.mark.parametrize("N,F_,dtype", [(70, 40, torch.float16), (0, 8, torch.bfloat16)])
def test_triton_ops_edge_shapes_interpreted(N, F_, dtype):
    """fp16, rows over one 64-row tile, no rows at all."""
    check_triton_ops(N, F_, dtype, "cpu", seed=11)


@interpreted
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("N,F_,dtype", [(37, 17, torch.bfloat16), (9, 512, torch.bfloat16), (5, 600, torch.float32)])  # fmt: skip
def test_fused_fp8_swiglu_matches_plain_op_and_quantization_interpreted(N, F_, dtype, weighted):
    check_fp8_triton_ops(N, F_, dtype, "cpu", weighted, seed=N)


def test_fused_fp8_swiglu_is_the_references_off_the_gpu():
    """On the CPU `swiglu_fp8` and its backward are the references and the row quantization."""
    from moetrain.kernels import quant
    from moetrain.kernels.swiglu import swiglu_fp8, swiglu_fp8_backward

    h, g = randn(33, 64, dtype=torch.bfloat16), randn(33, 32, dtype=torch.bfloat16, seed=1)
    w = row_weights(33)
    out = swiglu_reference(h, w)
    q, scale = swiglu_fp8(h, w)
    q_ref, scale_ref = quant.quantize_fp8_rowwise(out)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(
        scale, scale_ref
    )
    dh, q, scale, dw, out_again = swiglu_fp8_backward(h, g, w)
    want_dh, want_dw = weighted_swiglu_backward_reference(h, g, w)
    assert torch.equal(dh, want_dh) and torch.equal(dw, want_dw)
    assert torch.equal(out_again, out)
    q_ref, scale_ref = quant.quantize_fp8_rowwise(dh)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(
        scale, scale_ref
    )


# --- GPU: the compiled kernels -----------------------------------------------------------------

gpu = needs_cuda_and_triton


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "N,F_", [(1, 3), (37, 17), (4096, 512), (4096, 1000), (1000, 1024), (0, 64), (300, 4100)]
)
def test_triton_ops_match_references_cuda(N, F_, dtype):
    check_triton_ops(N, F_, dtype, "cuda", seed=N + F_)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize(
    "N,F_,dtype",
    [(4096, 512, torch.bfloat16), (1000, 1024, torch.bfloat16), (300, 4096, torch.bfloat16), (77, 40, torch.float32)],
)  # fmt: skip
def test_fused_fp8_swiglu_matches_plain_op_and_quantization_cuda(N, F_, dtype, weighted):
    check_fp8_triton_ops(N, F_, dtype, "cuda", weighted, seed=N)


@pytest.mark.gpu
@gpu
def test_triton_op_saves_only_its_input_and_passes_opcheck():
    h = randn(64, 96, dtype=torch.bfloat16, device="cuda").requires_grad_()
    g = randn(64, 48, dtype=torch.bfloat16, seed=1, device="cuda")
    nbytes, only_h = saved_bytes(swiglu, h)
    assert only_h and nbytes == h.numel() * h.element_size()
    w = row_weights(64, seed=2, device="cuda").requires_grad_()
    nbytes, _ = saved_bytes(lambda h: swiglu(h, w), h)
    assert nbytes == h.numel() * h.element_size() + w.numel() * w.element_size()
    torch.library.opcheck(torch.ops.moetrain.swiglu.default, (h, None))
    torch.library.opcheck(torch.ops.moetrain.swiglu.default, (h, w))
    # the backward op has no autograd formula of its own (no double backward)
    for w_ in (None, w.detach()):
        torch.library.opcheck(torch.ops.moetrain.swiglu_backward.default, (h.detach(), g, w_))


@pytest.mark.gpu
@gpu
def test_triton_op_under_torch_compile_fullgraph():
    def layer(x, w_up, w_down, w_rows):
        return swiglu(x @ w_up, w_rows) @ w_down * 2.0

    def run(fn):  # fp32, so that eager and Inductor's GEMMs agree closely
        x = randn(512, 256, seed=1, device="cuda").requires_grad_()
        w_up = (randn(256, 1024, seed=2, device="cuda") / 32).requires_grad_()
        w_down = (randn(512, 256, seed=3, device="cuda") / 32).requires_grad_()
        w_rows = row_weights(512, seed=4, device="cuda").requires_grad_()
        out = fn(x, w_up, w_down, w_rows)
        out.square().sum().backward()
        return out, x.grad, w_up.grad, w_down.grad, w_rows.grad

    assert_compiled_matches_eager(layer, run)
