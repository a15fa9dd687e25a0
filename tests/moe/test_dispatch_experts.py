import pytest
import torch

from moetrain.moe.dispatch import LocalDispatcher, inverse_permutation, sort_routes
from moetrain.moe.experts import GroupedExperts, grouped_mm, grouped_mm_reference
from moetrain.moe.router import TopKRouter


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
    router = TopKRouter(16, 5, 3, renormalize=True)
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


@pytest.mark.parametrize("counts", [[5, 0, 7, 3], [0, 0, 15, 0], [4, 4, 4, 3]])
def test_grouped_mm_matches_loop_including_empty_experts(counts):
    torch.manual_seed(0)
    x = torch.randn(sum(counts), 8, requires_grad=True)
    w = torch.randn(4, 8, 6, requires_grad=True)
    offs = torch.tensor(counts).cumsum(0).int()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y, y_ref = grouped_mm(x, w, offs), grouped_mm_reference(x2, w2, offs)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-5)
    for e, c in enumerate(counts):
        if c == 0:
            assert w.grad[e].abs().max() == 0


def test_grouped_experts_vs_reference_backend():
    torch.manual_seed(0)
    fast = GroupedExperts(3, 8, 5)
    slow = GroupedExperts(3, 8, 5, gemm=grouped_mm_reference)
    for p in fast.parameters():
        p.data.normal_()
    slow.load_state_dict(fast.state_dict())
    rows = torch.randn(11, 8)
    offs = torch.tensor([4, 4, 11], dtype=torch.int32)
    torch.testing.assert_close(fast(rows, offs), slow(rows, offs), rtol=1e-5, atol=1e-5)
