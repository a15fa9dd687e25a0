"""Route gather / combine: the torch references against loops and float64 autograd (CPU), and the
Triton ops against the references on CUDA and, on CPU, through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    TRITON_INSTALLED,
    assert_compiled_matches_eager,
    interpreted,
    needs_cuda_and_triton,
    needs_interpreter,
    run_interpreted_tests,
)

from moetrain.kernels import gather
from moetrain.kernels.gather import (
    combine_routes_backward_reference,
    combine_routes_reference,
    gather_routes_backward_reference,
    gather_routes_reference,
)

# one bf16 / fp16 ulp relative to the value (the result is rounded once from an fp32 sum)
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 0.0}


def make_routes(num_tokens: int, top_k: int, seed: int = 0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    order_N = torch.randperm(num_tokens * top_k, generator=gen)
    inverse_TK = torch.argsort(order_N).view(num_tokens, top_k)
    return order_N.to(device), inverse_TK.to(device)


def randn(*shape, dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


def assert_within(actual, exact, scale, dtype, rel=1e-5):
    """|actual - exact| <= one `dtype` ulp of exact + rel * scale (scale: the sum of the absolute
    terms, which bounds the error of an fp32 sum in any order); below the normal range of
    `dtype` an ulp is that of its smallest normal."""
    err = (actual.double() - exact.double()).abs()
    ulp = ULP[dtype] * exact.double().abs().clamp(min=torch.finfo(dtype).tiny)
    bound = ulp + rel * scale.double() + 1e-30
    worst = (err - bound).max().item() if err.numel() else 0.0
    assert worst <= 0, f"error exceeds its bound by {worst:.3g} (max error {err.max().item():.3g})"


# --- references: loops and float64 autograd ----------------------------------------------------


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("dim", [8, 100])
def test_references_match_loops(top_k, dim):
    T = 37
    order_N, inverse_TK = make_routes(T, top_k, seed=top_k + dim)
    assert torch.equal(inverse_TK.reshape(-1)[order_N], torch.arange(T * top_k))
    x = randn(T, dim, dtype=torch.float64, seed=1)
    y = randn(T * top_k, dim, dtype=torch.float64, seed=2)
    w = torch.rand(T, top_k, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    g_rows = randn(T * top_k, dim, dtype=torch.float64, seed=4)
    g = randn(T, dim, dtype=torch.float64, seed=5)
    rows = gather_routes_reference(x, order_N, inverse_TK)
    out = combine_routes_reference(y, order_N, inverse_TK, w)
    grad_x = gather_routes_backward_reference(g_rows, inverse_TK)
    grad_y, grad_w = combine_routes_backward_reference(g, y, order_N, w)
    for n in range(T * top_k):
        token, slot = divmod(order_N[n].item(), top_k)
        assert torch.equal(rows[n], x[token])
        assert torch.allclose(grad_y[n], w[token, slot] * g[token])
        assert torch.allclose(grad_w[token, slot], (y[n] * g[token]).sum())
    for t in range(T):
        routes = [inverse_TK[t, k] for k in range(top_k)]
        assert torch.allclose(out[t], sum(w[t, k] * y[routes[k]] for k in range(top_k)))
        assert torch.allclose(grad_x[t], sum(g_rows[r] for r in routes))


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("dim", [8, 100])
def test_reference_gradients_match_naive_autograd(top_k, dim):
    """float64: autograd of the references and the explicit backward formulas == autograd of the
    obvious expressions x[order // K] and (y[inverse] * w).sum(1)."""
    T = 37
    order_N, inverse_TK = make_routes(T, top_k, seed=7 * top_k + dim)
    x = randn(T, dim, dtype=torch.float64, seed=1).requires_grad_()
    y = randn(T * top_k, dim, dtype=torch.float64, seed=2).requires_grad_()
    w = torch.rand(T, top_k, dtype=torch.float64).requires_grad_()
    g_rows = randn(T * top_k, dim, dtype=torch.float64, seed=3)
    g = randn(T, dim, dtype=torch.float64, seed=4)

    naive_rows = x[order_N // top_k]
    (naive_gx,) = torch.autograd.grad(naive_rows, x, g_rows)
    rows = gather_routes_reference(x, order_N, inverse_TK)
    torch.testing.assert_close(rows, naive_rows, rtol=0, atol=0)
    torch.testing.assert_close(torch.autograd.grad(rows, x, g_rows)[0], naive_gx)
    torch.testing.assert_close(gather_routes_backward_reference(g_rows, inverse_TK), naive_gx)

    naive_out = (y[inverse_TK] * w[..., None]).sum(1)
    naive_gy, naive_gw = torch.autograd.grad(naive_out, (y, w), g)
    out = combine_routes_reference(y, order_N, inverse_TK, w)
    torch.testing.assert_close(out, naive_out)
    gy, gw = torch.autograd.grad(out, (y, w), g)
    torch.testing.assert_close(gy, naive_gy)
    torch.testing.assert_close(gw, naive_gw)
    ref_gy, ref_gw = combine_routes_backward_reference(g, y.detach(), order_N, w.detach())
    torch.testing.assert_close(ref_gy, naive_gy)
    torch.testing.assert_close(ref_gw, naive_gw)


def test_references_pass_gradcheck():
    order_N, inverse_TK = make_routes(5, 3, seed=11)
    x = randn(5, 4, dtype=torch.float64).requires_grad_()
    y = randn(15, 4, dtype=torch.float64, seed=1).requires_grad_()
    w = torch.rand(5, 3, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: gather_routes_reference(x, order_N, inverse_TK), x)
    assert torch.autograd.gradcheck(
        lambda y, w: combine_routes_reference(y, order_N, inverse_TK, w), (y, w)
    )


def test_public_functions_on_cpu_use_references_and_accumulate_in_fp32():
    order_N, inverse_TK = make_routes(37, 8, seed=5)
    y = randn(37 * 8, 64, dtype=torch.bfloat16, seed=1).requires_grad_()
    w = torch.rand(37, 8).requires_grad_()
    out = gather.combine_routes(y, order_N, inverse_TK, w)
    assert out.dtype == torch.bfloat16
    exact = combine_routes_reference(y.double(), order_N, inverse_TK, w.double())
    scale = combine_routes_reference(y.double().abs(), order_N, inverse_TK, w.double())
    assert_within(out, exact, scale, torch.bfloat16)
    out.float().sum().backward()
    assert y.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    x = randn(37, 64, seed=2).requires_grad_()
    rows = gather.gather_routes(x, order_N, inverse_TK)
    assert torch.equal(rows, x[order_N // 8])


# --- Triton ops == references ------------------------------------------------------------------


def check_triton_ops(T, K, D, dtype, device, seed=0):
    """Forward and both gradients of the two Triton ops, through autograd, against float64
    values of the references on the same (rounded) inputs."""
    from moetrain.kernels import gather_triton

    order_N, inverse_TK = make_routes(T, K, seed=seed, device=device)
    x = randn(T, D, dtype=dtype, seed=seed + 1, device=device).requires_grad_()
    rows = gather_triton.gather_routes_triton(x, inverse_TK)
    assert rows.dtype == dtype and rows.shape == (T * K, D)
    assert torch.equal(rows, gather_routes_reference(x, order_N, inverse_TK))  # a copy: exact
    g_rows = randn(T * K, D, dtype=dtype, seed=seed + 2, device=device)
    (grad_x,) = torch.autograd.grad(rows, x, g_rows)
    assert grad_x.dtype == dtype
    exact = gather_routes_backward_reference(g_rows.double(), inverse_TK)
    scale = gather_routes_backward_reference(g_rows.double().abs(), inverse_TK)
    assert_within(grad_x, exact, scale, dtype)

    y = randn(T * K, D, dtype=dtype, seed=seed + 3, device=device).requires_grad_()
    gen = torch.Generator().manual_seed(seed + 4)
    w = torch.rand(T, K, generator=gen).to(device).requires_grad_()
    out = gather_triton.combine_routes_triton(y, inverse_TK, w)
    assert out.dtype == dtype and out.shape == (T, D)
    exact = combine_routes_reference(y.double(), order_N, inverse_TK, w.double())
    scale = combine_routes_reference(y.double().abs(), order_N, inverse_TK, w.double())
    assert_within(out, exact, scale, dtype)
    g = randn(T, D, dtype=dtype, seed=seed + 5, device=device)
    grad_y, grad_w = torch.autograd.grad(out, (y, w), g)
    assert grad_y.dtype == dtype and grad_w.dtype == torch.float32
    exact_gy, exact_gw = combine_routes_backward_reference(
        g.double(), y.double(), order_N, w.double()
    )
    assert_within(grad_y, exact_gy, exact_gy.abs(), dtype)
    if device != "cpu":  # one fp32 product rounded once: the fp32 reference's bits (the
        # interpreter truncates fp32 -> bf16 instead of rounding to nearest)
        ref_gy, _ = combine_routes_backward_reference(g, y.detach(), order_N, w.detach())
        assert torch.equal(grad_y, ref_gy)
    _, scale_gw = combine_routes_backward_reference(
        g.double().abs(), y.double().abs(), order_N, w.double()
    )
    assert_within(grad_w, exact_gw, scale_gw, torch.float32)
    # weights that need no gradient take the kernel path that skips the dot products
    out = gather_triton.combine_routes_triton(y, inverse_TK, w.detach())
    assert torch.equal(torch.autograd.grad(out, y, g)[0], grad_y)
    # the unweighted sum (rows the experts weighted): the gather's backward, and its backward
    # is the gather
    out = gather_triton.sum_routes_triton(y, inverse_TK)
    assert out.dtype == dtype and out.shape == (T, D)
    exact = gather_routes_backward_reference(y.double(), inverse_TK)
    scale = gather_routes_backward_reference(y.double().abs(), inverse_TK)
    assert_within(out, exact, scale, dtype)
    (grad_y,) = torch.autograd.grad(out, y, g)
    assert torch.equal(grad_y, gather_routes_reference(g, order_N, inverse_TK))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_routes_on_cpu_sums_each_tokens_rows_and_spreads_its_gradient(dtype):
    T, K, D = 37, 3, 20
    order_N, inverse_TK = make_routes(T, K, seed=7)
    y = randn(T * K, D, dtype=dtype, seed=8).requires_grad_()
    out = gather.sum_routes(y, order_N, inverse_TK)
    loop = torch.stack([sum(y[n].double() for n in inverse_TK[t].tolist()) for t in range(T)])
    assert_within(out, loop, y.detach().double().abs()[inverse_TK].sum(1), dtype)
    g = randn(T, D, dtype=dtype, seed=9)
    (grad_y,) = torch.autograd.grad(out, y, g)
    assert torch.equal(grad_y, g[order_N // K])


@needs_interpreter
def test_triton_gather_under_interpreter():
    """Runs this file's `interpreted` tests in a fresh process with TRITON_INTERPRET=1. There the
    triton_ops run eagerly on CPU tensors (torch's wrap_triton passes interpreted kernels
    through); their fake/compile path needs a GPU and is covered by the CUDA tests."""
    run_interpreted_tests(__file__)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("T,D", [(1, 64), (37, 64), (37, 100)])
def test_triton_ops_match_references_interpreted(T, D, top_k, dtype):
    check_triton_ops(T, top_k, D, dtype, "cpu", seed=T + D + top_k)


@interpreted
@pytest.mark.parametrize(
    "T,K,D,dtype",
    [(3, 2, 4100, torch.float16), (5, 16, 24, torch.bfloat16), (0, 2, 64, torch.float32)],
)
def test_triton_ops_edge_shapes_interpreted(T, K, D, dtype):
    """Rows over 4096 (two D blocks, a masked tail), fp16, K = 16, no tokens at all."""
    check_triton_ops(T, K, D, dtype, "cpu", seed=9)


def test_gather_triton_module_imports_without_triton():
    from moetrain.kernels import gather_triton

    assert gather_triton.triton_available() == TRITON_INSTALLED


# --- GPU: the compiled kernels ----------------------------------------------------------------

gpu = needs_cuda_and_triton


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("T", [1, 37, 4096])
@pytest.mark.parametrize("D", [64, 1000, 2048])
def test_triton_ops_match_references_cuda(D, T, top_k, dtype):
    check_triton_ops(T, top_k, D, dtype, "cuda", seed=T + D + top_k)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "T,K,D,dtype",
    [(300, 2, 8192, torch.bfloat16), (77, 16, 4100, torch.float16), (0, 8, 64, torch.bfloat16)],
)
def test_triton_ops_edge_shapes_cuda(T, K, D, dtype):
    check_triton_ops(T, K, D, dtype, "cuda", seed=3)


@pytest.mark.gpu
@gpu
def test_triton_ops_pass_opcheck():
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch of each op."""
    from moetrain.kernels import gather_triton  # noqa: F401 - registers the ops

    _, inverse_TK = make_routes(37, 4, device="cuda")
    x = randn(37, 96, dtype=torch.bfloat16, device="cuda").requires_grad_()
    y = randn(148, 96, dtype=torch.bfloat16, seed=1, device="cuda").requires_grad_()
    w = torch.rand(37, 4, device="cuda").requires_grad_()
    g = randn(37, 96, dtype=torch.bfloat16, seed=2, device="cuda")
    ops = torch.ops.moetrain
    torch.library.opcheck(ops.gather_routes.default, (x, inverse_TK))
    torch.library.opcheck(ops.sum_routes.default, (y, inverse_TK, w))
    torch.library.opcheck(ops.sum_routes.default, (y, inverse_TK, None))
    w_ = w.detach()  # the backward op itself has no autograd formula (no double backward)
    torch.library.opcheck(ops.combine_routes_backward.default, (g, y.detach(), inverse_TK, w_))
    torch.library.opcheck(ops.combine_routes_backward.default, (g, None, inverse_TK, w_))


@pytest.mark.gpu
@gpu
def test_triton_ops_under_torch_compile_fullgraph():
    order_N, inverse_TK = make_routes(512, 8, seed=4, device="cuda")

    def layer(x, w_in, weights):
        rows = gather.gather_routes(x, order_N, inverse_TK)
        y = torch.nn.functional.silu(rows @ w_in)
        return gather.combine_routes(y, order_N, inverse_TK, weights) * 2.0

    def run(fn):  # fp32, so that eager and Inductor's fused elementwise code agree closely
        x = randn(512, 256, seed=1, device="cuda").requires_grad_()
        w_in = (randn(256, 256, seed=2, device="cuda") / 16).requires_grad_()
        weights = torch.rand(512, 8, device="cuda").softmax(-1).requires_grad_()
        out = fn(x, w_in, weights)
        out.square().sum().backward()
        return out, x.grad, w_in.grad, weights.grad

    assert_compiled_matches_eager(layer, run)
