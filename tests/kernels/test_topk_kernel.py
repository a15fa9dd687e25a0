"""The router's top-k + routes-per-expert op: the reference against brute force (CPU), the Triton
op against the reference on CUDA and, on CPU, through Triton's interpreter; also on the masked
scores of group-limited routing (-inf outside each token's best groups, moe/group_limit.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import interpreted, needs_cuda_and_triton, needs_interpreter, run_interpreted_tests

from moetrain.kernels.topk import route_topk, route_topk_reference
from moetrain.moe.group_limit import group_limited_scores

# (tokens, experts, k): power-of-two and ragged expert counts, one token, k = 1 and k = E
CASES = [(1, 8, 2), (100, 64, 8), (257, 60, 4), (64, 128, 4), (33, 5, 5), (50, 300, 1)]
# (tokens, experts, k, groups, groups kept): ragged E (-inf padding past E and -inf masks both),
# k = every kept expert, one group kept, DeepSeek-V3's 256 experts in 8 groups (4 kept, top-8)
MASKED_CASES = [(100, 64, 8, 8, 3), (257, 60, 20, 6, 2), (33, 16, 4, 8, 2), (1, 12, 3, 4, 1)]


def scores(T, E, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T, E, generator=gen).softmax(-1).to(device)


def test_reference_against_brute_force():
    s = scores(40, 16, seed=1)
    ids, counts = route_topk_reference(s, 3)
    for t in range(40):
        assert ids[t].tolist() == sorted(range(16), key=lambda e: -s[t, e].item())[:3]
    assert counts.tolist() == [int((ids == e).sum()) for e in range(16)]
    assert counts.dtype == torch.int64 and int(counts.sum()) == 40 * 3


def test_bad_k_is_an_error():
    with pytest.raises(ValueError, match="k must be in"):
        route_topk(scores(4, 8, 0), 9)


def check_against_reference(T, E, k, device, seed=3, groups=None):
    s = scores(T, E, seed, device)
    if groups is not None:  # selection scores below 0 too, as a negative bias gives them
        s = group_limited_scores(s - 0.5 * s.mean(), *groups)
        assert s.isinf().any()
    ids, counts = route_topk(s, k)
    ref_ids, ref_counts = route_topk_reference(s, k)
    assert ids.dtype == torch.int64 and counts.dtype == torch.int64
    assert torch.equal(ids.cpu(), ref_ids.cpu()) and torch.equal(counts.cpu(), ref_counts.cpu())
    if groups is not None:  # never a masked expert
        assert s.gather(1, ids).isfinite().all()


def test_reference_never_chooses_a_masked_expert():
    check_against_reference(100, 64, 8, "cpu", groups=(8, 3))


@needs_interpreter
def test_route_topk_under_interpreter():
    """Runs this file's `interpreted` tests in a fresh process with TRITON_INTERPRET=1."""
    run_interpreted_tests(__file__)


@interpreted
@pytest.mark.parametrize(("T", "E", "k"), CASES)
def test_triton_matches_reference_interpreted(T, E, k):
    check_against_reference(T, E, k, "cpu")


@interpreted
@pytest.mark.parametrize(("T", "E", "k", "n_groups", "topk_groups"), MASKED_CASES)
def test_triton_takes_masked_scores_interpreted(T, E, k, n_groups, topk_groups):
    check_against_reference(T, E, k, "cpu", groups=(n_groups, topk_groups))


@pytest.mark.gpu
@needs_cuda_and_triton
@pytest.mark.parametrize(("T", "E", "k"), [*CASES, (16384, 64, 8), (32768, 128, 4)])
def test_triton_matches_reference_cuda(T, E, k):
    check_against_reference(T, E, k, "cuda")


@pytest.mark.gpu
@needs_cuda_and_triton
@pytest.mark.parametrize(
    ("T", "E", "k", "n_groups", "topk_groups"), [*MASKED_CASES, (16384, 256, 8, 8, 4)]
)
def test_triton_takes_masked_scores_cuda(T, E, k, n_groups, topk_groups):
    check_against_reference(T, E, k, "cuda", groups=(n_groups, topk_groups))


@pytest.mark.gpu
@needs_cuda_and_triton
def test_route_topk_compiles_without_graph_break():
    s = scores(512, 64, seed=5, device="cuda")
    fn = torch.compile(lambda x: route_topk(x, 8), fullgraph=True)
    ids, counts = fn(s)
    ref_ids, ref_counts = route_topk_reference(s, 8)
    assert torch.equal(ids, ref_ids) and torch.equal(counts, ref_counts)
    # group-limited: the masking compiles into the same graph
    grouped = torch.compile(lambda x: route_topk(group_limited_scores(x, 8, 2), 8), fullgraph=True)
    ids, counts = grouped(s)
    ref_ids, ref_counts = route_topk_reference(group_limited_scores(s, 8, 2), 8)
    assert torch.equal(ids, ref_ids) and torch.equal(counts, ref_counts)
