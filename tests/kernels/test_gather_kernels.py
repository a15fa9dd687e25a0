"""Route gather / sum: the torch references against loops and float64 autograd (CPU), and the
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
from moetrain.kernels.gather import gather_routes_backward_reference, gather_routes_reference

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
def test_references_match_loops_and_naive_autograd(top_k, dim):
    """float64: the gather and its explicit backward against a loop over the rows and autograd
    of the obvious x[order // K]."""
    T = 37
    order_N, inverse_TK = make_routes(T, top_k, seed=top_k + dim)
    assert torch.equal(inverse_TK.reshape(-1)[order_N], torch.arange(T * top_k))
    x = randn(T, dim, dtype=torch.float64, seed=1).requires_grad_()
    g_rows = randn(T * top_k, dim, dtype=torch.float64, seed=4)
    rows = gather_routes_reference(x, order_N, inverse_TK)
    grad_x = gather_routes_backward_reference(g_rows, inverse_TK)
    for n in range(T * top_k):
        assert torch.equal(rows[n], x[order_N[n].item() // top_k])
    for t in range(T):
        assert torch.allclose(grad_x[t], sum(g_rows[inverse_TK[t, k]] for k in range(top_k)))
    naive_rows = x[order_N // top_k]
    (naive_gx,) = torch.autograd.grad(naive_rows, x, g_rows)
    torch.testing.assert_close(rows, naive_rows, rtol=0, atol=0)
    torch.testing.assert_close(torch.autograd.grad(rows, x, g_rows)[0], naive_gx)
    torch.testing.assert_close(grad_x, naive_gx)


def test_public_gather_on_cpu_is_the_reference_and_passes_gradcheck():
    order_N, inverse_TK = make_routes(5, 3, seed=11)
    x = randn(5, 4, dtype=torch.float64).requires_grad_()
    assert torch.equal(gather.gather_routes(x, order_N, inverse_TK), x[order_N // 3])
    assert torch.autograd.gradcheck(lambda x: gather.gather_routes(x, order_N, inverse_TK), x)


# --- Triton ops == references ------------------------------------------------------------------


def check_triton_ops(T, K, D, dtype, device, seed=0):
    """Forward and gradient of the two Triton ops, through autograd, against float64 values of
    the references on the same (rounded) inputs."""
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
    g = randn(T, D, dtype=dtype, seed=seed + 5, device=device)
    # the sum (rows the experts weighted): the gather's backward, and its backward is the gather
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
    torch.library.opcheck(torch.ops.moetrain.gather_routes.default, (x, inverse_TK))
    torch.library.opcheck(torch.ops.moetrain.sum_routes.default, (y, inverse_TK))


@pytest.mark.gpu
@gpu
def test_triton_ops_under_torch_compile_fullgraph():
    order_N, inverse_TK = make_routes(512, 8, seed=4, device="cuda")

    def layer(x, w_in, weights_N):
        rows = gather.gather_routes(x, order_N, inverse_TK)
        y = torch.nn.functional.silu(rows @ w_in) * weights_N[:, None]
        return gather.sum_routes(y, order_N, inverse_TK) * 2.0

    def run(fn):  # fp32, so that eager and Inductor's fused elementwise code agree closely
        x = randn(512, 256, seed=1, device="cuda").requires_grad_()
        w_in = (randn(256, 256, seed=2, device="cuda") / 16).requires_grad_()
        weights = randn(512 * 8, seed=3, device="cuda").sigmoid().detach().requires_grad_()
        out = fn(x, w_in, weights)
        out.square().sum().backward()
        return out, x.grad, w_in.grad, weights.grad

    assert_compiled_matches_eager(layer, run)
