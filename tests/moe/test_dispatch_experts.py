import pytest
import torch

from moetrain.moe.dispatch import LocalDispatcher, inverse_permutation, sort_routes
from moetrain.moe.experts import (
    GroupedExperts,
    ReferenceGroupedGemm,
    grouped_mm,
    grouped_mm_reference,
)
from moetrain.moe.router import RouterConfig, TopKRouter


@pytest.mark.parametrize("num_experts", [1, 8, 256, 257, 5000])
def test_route_sort_is_the_stable_argsort_and_its_inverse(num_experts):
    """Narrowed keys (uint8, int16) must give the same stable order as the int64 ids."""
    ids_N = torch.randint(0, num_experts, (3001,))
    order_N = sort_routes(ids_N, num_experts)
    assert torch.equal(order_N, torch.argsort(ids_N, stable=True))
    inverse_N = inverse_permutation(order_N)
    assert torch.equal(inverse_N[order_N], torch.arange(3001))
    assert torch.equal(inverse_N, torch.argsort(order_N))


def test_dispatch_then_combine_with_identity_experts_is_exact():
    torch.manual_seed(0)
    router = TopKRouter(16, RouterConfig(num_experts=5, top_k=3, renormalize=True))
    x = torch.randn(40, 16)
    routing = router(x)
    d = LocalDispatcher()
    rows, offsets, handle = d.dispatch(x, routing)
    assert rows.shape == (40 * 3, 16)
    assert offsets[-1].item() == 120
    # rows are grouped by expert, in the order given by offsets
    start = 0
    for e, end in enumerate(offsets.tolist()):
        for row in rows[start:end]:
            token = (x == row).all(-1).nonzero()[0, 0]
            assert e in routing.expert_ids_TK[token].tolist()
        start = end
    # the local handle leaves the router weights to the experts: here, identity experts
    y = d.combine(rows * handle.row_weights_N[:, None], handle)
    torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[5, 0, 7, 3], [0, 0, 15, 0], [4, 4, 4, 3]])
def test_grouped_mm_matches_loop_including_empty_experts(counts, dtype):
    """torch._grouped_mm (16-byte rows: the widths a config allows) against the fp64 loop."""
    torch.manual_seed(0)
    x64, w64 = torch.randn(sum(counts), 16, dtype=torch.float64), torch.randn(4, 16, 24, dtype=torch.float64)  # fmt: skip
    x, w = x64.to(dtype).requires_grad_(), w64.to(dtype).requires_grad_()
    x2, w2 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    offs = torch.tensor(counts).cumsum(0).int()
    y, y_ref = grouped_mm(x, w, offs), grouped_mm_reference(x2, w2, offs)
    assert y.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(y.double(), y_ref, **tol)
    g = torch.randn_like(y_ref)
    y.backward(g.to(dtype))
    y_ref.backward(g)
    torch.testing.assert_close(x.grad.double(), x2.grad, **tol)
    torch.testing.assert_close(w.grad.double(), w2.grad, **tol)
    for e, c in enumerate(counts):
        if c == 0:
            assert w.grad[e].abs().max() == 0


def test_grouped_mm_rejects_what_the_kernel_cannot_run():
    """No silent host-synced loop: unaligned widths are a ValueError naming the fix."""
    offs = torch.tensor([2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"output width \(6\) must be multiples of 4"):
        grouped_mm(torch.randn(5, 8), torch.randn(2, 8, 6), offs)
    with pytest.raises(ValueError, match=r"multiples of 8 in torch.bfloat16"):
        grouped_mm(torch.randn(5, 12).bfloat16(), torch.randn(2, 12, 16).bfloat16(), offs)


def test_grouped_experts_vs_reference_backend():
    torch.manual_seed(0)
    fast = GroupedExperts(3, 16, 8)
    slow = GroupedExperts(3, 16, 8, gemm=ReferenceGroupedGemm())
    for p in fast.parameters():
        p.data.normal_()
    slow.load_state_dict(fast.state_dict())
    rows = torch.randn(11, 16)
    offs = torch.tensor([4, 4, 11], dtype=torch.int32)
    y_fast, y_slow = fast(rows, offs), slow(rows, offs)
    torch.testing.assert_close(y_fast, y_slow, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y_fast)
    y_fast.backward(g)
    y_slow.backward(g)
    for p, q in zip(fast.parameters(), slow.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
