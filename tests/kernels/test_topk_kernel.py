"""The router's top-k + routes-per-expert op: the reference against brute force (CPU), the Triton
op against the reference on CUDA and, on CPU, through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from conftest import interpreted, needs_cuda_and_triton, needs_interpreter, run_interpreted_tests

from moetrain.kernels.topk import route_topk, route_topk_reference

# (tokens, experts, k): power-of-two and ragged expert counts, one token, k = 1 and k = E
CASES = [(1, 8, 2), (100, 64, 8), (257, 60, 4), (64, 128, 4), (33, 5, 5), (50, 300, 1)]


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


def check_against_reference(T, E, k, device, seed=3):
    s = scores(T, E, seed, device)
    ids, counts = route_topk(s, k)
    ref_ids, ref_counts = route_topk_reference(s, k)
    assert ids.dtype == torch.int64 and counts.dtype == torch.int64
    assert torch.equal(ids.cpu(), ref_ids.cpu()) and torch.equal(counts.cpu(), ref_counts.cpu())


@needs_interpreter
def test_route_topk_under_interpreter():
    """Runs this file's `interpreted` tests in a fresh process with TRITON_INTERPRET=1."""
    run_interpreted_tests(__file__)


@interpreted
@pytest.mark.parametrize(("T", "E", "k"), CASES)
def test_triton_matches_reference_interpreted(T, E, k):
    check_against_reference(T, E, k, "cpu")


@pytest.mark.gpu
@needs_cuda_and_triton
@pytest.mark.parametrize(("T", "E", "k"), [*CASES, (16384, 64, 8), (32768, 128, 4)])
def test_triton_matches_reference_cuda(T, E, k):
    check_against_reference(T, E, k, "cuda")


@pytest.mark.gpu
@needs_cuda_and_triton
def test_route_topk_compiles_without_graph_break():
    s = scores(512, 64, seed=5, device="cuda")
    fn = torch.compile(lambda x: route_topk(x, 8), fullgraph=True)
    ids, counts = fn(s)
    ref_ids, ref_counts = route_topk_reference(s, 8)
    assert torch.equal(ids, ref_ids) and torch.equal(counts, ref_counts)
