"""Masked row movements of the EP dispatchers (index -1 = no row): the Triton ops against the
sink-row torch references on fresh random indices with drops and padding, forward and gradients,
in bf16 and fp32 (CPU: through Triton's interpreter; CUDA: the `gpu` test)."""

from __future__ import annotations

import pytest
import torch
from conftest import interpreted, needs_cuda_and_triton, needs_interpreter, run_interpreted_tests

from moetrain.kernels import masked_rows


def random_layout(T, K, R, seed, device):
    """A NoSync-like layout: each route kept with prob 0.7 into a distinct row of R (>= T K
    rows: the rest are padding), -1 where dropped; and the inverse maps."""
    gen = torch.Generator().manual_seed(seed)
    keep_N = torch.rand(T * K, generator=gen) < 0.7
    rows_N = torch.randperm(R, generator=gen)[: T * K]
    send_row_N = torch.where(keep_N, rows_N, -1)
    row_route_R = torch.full((R,), -1, dtype=torch.int64)
    row_route_R[send_row_N[keep_N]] = torch.arange(T * K)[keep_N]
    token_of_row_R = torch.where(row_route_R >= 0, row_route_R // K, -1)
    return [t.to(device) for t in (send_row_N.view(T, K), row_route_R, token_of_row_R)]


def run_all(fns, T, K, D, R, dtype, device, seed):
    send_row_TK, row_route_R, token_of_row_R = random_layout(T, K, R, seed, device)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, D, generator=gen).to(device, dtype).requires_grad_()
    src = torch.randn(R, D, generator=gen).to(device, dtype).requires_grad_()
    w = torch.rand(T, K, generator=gen).to(device).requires_grad_()
    g_rows = torch.randn(R, D, generator=gen).to(device, dtype)
    g_tokens = torch.randn(T, D, generator=gen).to(device, dtype)
    # a gather by a permutation-with-holes and its inverse
    index_M = token_of_row_R.clone()
    index_M[row_route_R >= 0] = send_row_TK.reshape(-1)[row_route_R[row_route_R >= 0]]
    back_R = torch.full((R,), -1, dtype=torch.int64, device=device)
    valid = index_M >= 0
    back_R[index_M[valid]] = torch.arange(R, device=device)[valid]
    out = {}
    out["gather"] = fns["masked_gather"](src, index_M, back_R)
    (out["gather_grad"],) = torch.autograd.grad(out["gather"], src, g_rows)
    out["tokens"] = fns["gather_tokens"](x, token_of_row_R, send_row_TK)
    (out["tokens_grad"],) = torch.autograd.grad(out["tokens"], x, g_rows)
    out["sum"] = fns["weighted_route_sum"](src, send_row_TK, w, row_route_R)
    out["sum_grad_src"], out["sum_grad_w"] = torch.autograd.grad(out["sum"], (src, w), g_tokens)
    return out


EXACT = ("gather", "gather_grad", "tokens")  # copies


def check(T, K, D, dtype, device, seed):
    R = int(T * K * 1.3) + 1
    fast_fns = {
        "masked_gather": masked_rows.masked_gather,
        "gather_tokens": masked_rows.gather_tokens,
        "weighted_route_sum": masked_rows.weighted_route_sum,
    }
    fast = run_all(fast_fns, T, K, D, R, dtype, device, seed)
    ref = run_all(masked_rows.references(), T, K, D, R, dtype, device, seed)
    assert masked_rows._use_triton(fast["gather"])
    for name in EXACT:
        assert torch.equal(fast[name], ref[name]), name
    # w * g rounded once to the rows' dtype: exact in fp32; in bf16 the interpreter's rounding
    # may differ from torch's by one ulp. The sums: fp32 additions in another order.
    if dtype == torch.float32:
        assert torch.equal(fast["sum_grad_src"], ref["sum_grad_src"])
    for name in ("tokens_grad", "sum", "sum_grad_w", "sum_grad_src"):
        tol = 1e-5 if dtype == torch.float32 else 2.0**-7
        torch.testing.assert_close(fast[name], ref[name], rtol=tol, atol=tol * 2, msg=name)


@needs_interpreter
def test_masked_rows_under_interpreter():
    run_interpreted_tests(__file__)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,K,D", [(37, 2, 64), (19, 8, 100), (3, 4, 4100)])
def test_masked_rows_match_references_interpreted(T, K, D, dtype):
    check(T, K, D, dtype, "cpu", seed=T + K + D)


@pytest.mark.gpu
@needs_cuda_and_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,K,D", [(4096, 4, 4096), (4096, 8, 2048), (300, 2, 8192)])
def test_masked_rows_match_references_cuda(T, K, D, dtype):
    check(T, K, D, dtype, "cuda", seed=T + K + D)


def test_references_zero_rows_for_minus_one():
    """The reference itself: -1 reads the appended zero row, not the last real row."""
    src = torch.randn(4, 3, dtype=torch.float64)
    out = masked_rows.references()["masked_gather"](
        src, torch.tensor([2, -1, 0]), torch.tensor([2, -1, 0, -1])
    )
    assert torch.equal(out[0], src[2]) and torch.equal(out[1], torch.zeros(3))


def no_sync_step(dtype, device, seed, fast: bool):
    """A NoSync dispatch + combine at ep 1, capacity factor 0.5 (routes dropped), with the
    kernels (`fast`) or with the references."""
    from unittest import mock

    from moetrain.parallel.ep_dispatch import NoSyncDispatcher
    from moetrain.tools.bench.dispatch_cost import _routing

    torch.manual_seed(seed)
    T, K, E, D = 64, 4, 8, 96
    x = torch.randn(T, D, device=device, dtype=dtype, requires_grad=True)
    routing = _routing(T, K, E, device)
    routing.weights_TK.requires_grad_()
    dispatcher = NoSyncDispatcher(E, None, 0, 0.5, device=device)
    use = masked_rows._use_triton if fast else (lambda t: False)
    with mock.patch.object(masked_rows, "_use_triton", use):
        rows, _, handle = dispatcher.dispatch(x, routing)
        y = dispatcher.combine(rows * 1.5, handle)
        y.backward(torch.randn_like(y))
    assert dispatcher.read_stats()["dropped_routes"] > 0
    return y, x.grad, routing.weights_TK.grad


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_no_sync_dispatcher_kernels_match_reference_interpreted(dtype):
    fast, ref = (no_sync_step(dtype, "cpu", 5, f) for f in (True, False))
    tol = 1e-5 if dtype == torch.float32 else 2.0**-7
    for a, b in zip(fast, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=2 * tol)
