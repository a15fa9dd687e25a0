"""Expert-parallel dispatchers against one-process references written as plain loops.

Experts in these tests are "scale by (global expert id + 1)", so every output names the expert
that produced it. Every rank builds the whole group's inputs from one seed, so each rank can run
the reference for all ranks without communication. NoSyncDispatcher runs in capacity mode only;
`NEVER_DROPS` (E / K) reaches both of its worst cases, so it computes every route.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed

from moetrain.config import MoEConfig, ParallelConfig, RunConfig
from moetrain.dist_compat import all_gather_flat_name
from moetrain.moe.balance import count_tokens_per_expert
from moetrain.moe.dispatch import LocalDispatcher
from moetrain.moe.experts import GroupedExperts
from moetrain.moe.payload import BF16_PAYLOAD, FP8_PAYLOAD, fp8_round_trip_reference
from moetrain.moe.router import RoutingResult
from moetrain.parallel import ep_dispatch
from moetrain.parallel.ep_dispatch import AllToAllDispatcher, NoSyncDispatcher, keep_counts
from moetrain.parallel.expert import make_dispatcher, resolve_dispatcher

T, K, D, E = 12, 2, 8, 8
NEVER_DROPS = E / K  # expert capacity G T and blocks of T min(K, e): the worst cases


def make_routing(ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> RoutingResult:
    zero = torch.zeros(())
    return RoutingResult(
        expert_ids_TK=ids_TK,
        weights_TK=weights_TK,
        tokens_per_expert_E=count_tokens_per_expert(ids_TK, E),
        probs_TE=torch.full((ids_TK.shape[0], E), 1.0 / E),
        lb_loss=zero,
        z_loss=zero,
    )


def group_inputs(num_ranks: int, seed: int, skew: float = 0.0):
    """x [G, T, D], distinct expert ids [G, T, K] (skew > 0 favours low expert ids), weights
    [G, T, K] summing to one per token."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_ranks, T, D, generator=generator)
    probs_E = torch.exp(-skew * torch.arange(E, dtype=torch.float32))
    ids = torch.multinomial(probs_E.expand(num_ranks * T, E), K, generator=generator)
    weights = torch.rand(num_ranks, T, K, generator=generator) + 0.1
    return x, ids.view(num_ranks, T, K), weights / weights.sum(-1, keepdim=True)


def scale_experts(rows_ND: torch.Tensor, offsets_e: torch.Tensor, expert_offset: int):
    """Expert g multiplies its rows by g + 1 (rows past the last offset are padding)."""
    local_N = torch.searchsorted(offsets_e, torch.arange(rows_ND.shape[0]), right=True)
    return rows_ND * (expert_offset + local_N + 1).to(rows_ND.dtype)[:, None]


def reference_keep(ids: torch.Tensor, num_ranks: int, expert_capacity: int, block_rows: int):
    """The tail-drop rule as loops: expert capacity (sources in rank order, then tokens), then
    block capacity per (source, destination) (experts in order, then tokens). Returns the routes
    within their expert's capacity and the routes finally kept, both [G, T, K]."""
    e = E // num_ranks
    fits = torch.zeros(ids.shape, dtype=torch.bool)
    taken = [0] * E
    for s in range(num_ranks):
        for t in range(T):
            for k in range(K):
                g = int(ids[s, t, k])
                if taken[g] < expert_capacity:
                    fits[s, t, k] = True
                    taken[g] += 1
    keep = torch.zeros(ids.shape, dtype=torch.bool)
    for s in range(num_ranks):
        for d in range(num_ranks):
            used = 0
            for g in range(d * e, (d + 1) * e):
                for t in range(T):
                    for k in range(K):
                        if ids[s, t, k] == g and fits[s, t, k] and used < block_rows:
                            keep[s, t, k] = True
                            used += 1
    return fits, keep


def test_keep_counts_matches_the_loop_rule():
    generator = torch.Generator().manual_seed(0)
    for num_ranks, cap, block in ((2, 5, 7), (4, 3, 4), (2, 100, 3), (1, 2, 5)):
        x, ids, w = group_inputs(
            num_ranks, seed=int(torch.randint(100, (1,), generator=generator)), skew=0.5
        )
        _, keep = reference_keep(ids, num_ranks, cap, block)
        e = E // num_ranks
        counts_sdx = torch.stack([count_tokens_per_expert(ids[s], E) for s in range(num_ranks)])
        kept = keep_counts(counts_sdx.view(num_ranks, num_ranks, e), cap, block)
        expected = torch.stack(
            [count_tokens_per_expert(ids[s][keep[s]], E) for s in range(num_ranks)]
        )
        assert torch.equal(kept.view(num_ranks, E), expected)


def _dims(ep: int, device: str) -> SimpleNamespace:
    """What resolve_dispatcher and make_dispatcher read of a ParallelDims."""
    return SimpleNamespace(ep=ep, device=torch.device(device), ep_group=None, ep_rank=0)


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "ep", "num_experts", "cf", "expected"),
    [
        # (expert capacity ceil(cf ep T K / E), block rows min(ceil(cf T K / ep), T min(K, e)))
        (16384, 8, 8, 64, None, None),  # olmoe-1b-7b's micro-batch at ep 8: dropless
        (16384, 8, 8, 64, 1.25, (20480, 20480)),
        (16384, 8, 8, 64, 2.0, (32768, 32768)),
        (12, 2, 4, 8, None, None),
        (12, 2, 4, 8, 2.0, (24, 12)),
        (7, 3, 4, 12, 1.1, (8, 6)),  # rounds up: 7.7 and 5.775
        (10, 8, 16, 16, 2.0, (160, 10)),  # one expert a rank: blocks capped at T min(K, e)
        (12, 2, 1, 8, 1.0, (3, 24)),  # ep 1 (NoSync chosen explicitly)
    ],
)
def test_expert_buffers_hold_about_cf_T_K_rows_and_dropless_is_exact_splits(
    monkeypatch, num_tokens, top_k, ep, num_experts, cf, expected
):
    """On CUDA at ep > 1, a capacity factor gives NoSync blocks of B rows, G B <= cf T K + G; no
    capacity factor gives the exact-split AllToAll (T K rows on average), never NoSync's worst
    case of G T min(K, e) rows a rank (8 T K for olmoe-1b-7b at ep 8)."""
    monkeypatch.setattr(ep_dispatch, "group_size", lambda group: ep)
    # the dims say CUDA (the auto rule reads it); this machine may have none for the counters
    monkeypatch.setattr(NoSyncDispatcher, "_new_stats", staticmethod(lambda device: None))
    dispatcher_choice = "auto" if ep > 1 else "no_sync"
    moe = MoEConfig(
        num_experts=num_experts, top_k=top_k, capacity_factor=cf, dispatcher=dispatcher_choice
    )
    config = RunConfig(moe=moe, parallel=ParallelConfig(ep=ep))
    dispatcher = make_dispatcher(config, _dims(ep, "cuda"))
    if cf is None:
        assert isinstance(dispatcher, AllToAllDispatcher)
        return
    assert isinstance(dispatcher, NoSyncDispatcher)
    expert_capacity, block_rows = dispatcher.capacities(num_tokens, top_k)
    assert (expert_capacity, block_rows) == expected
    routes = num_tokens * top_k
    assert ep * block_rows <= cf * routes + ep
    assert block_rows <= num_tokens * min(top_k, num_experts // ep)
    if cf <= 2:
        assert ep * block_rows <= 2 * routes


@pytest.mark.parametrize("cf", [None, 0.0, -1.0])
def test_no_sync_refuses_to_run_without_a_capacity_factor(cf):
    """No silent worst-case allocation: NoSync is capacity mode."""
    with pytest.raises(ValueError, match="capacity.factor"):
        NoSyncDispatcher(E, None, 0, cf)


def test_auto_picks_no_sync_only_with_a_capacity_factor_on_cuda():
    cases = {
        # (ep, device, capacity factor, moe.dispatcher): resolved
        (1, "cuda", None, "auto"): "local",
        (1, "cuda", 1.25, "auto"): "local",
        (4, "cuda", None, "auto"): "all_to_all",
        (4, "cuda", 1.25, "auto"): "no_sync",
        (4, "cpu", 1.25, "auto"): "all_to_all",
        (4, "cuda", None, "all_to_all"): "all_to_all",
        (4, "cuda", 1.25, "all_to_all"): "all_to_all",
        (4, "cpu", 2.0, "no_sync"): "no_sync",
        (1, "cpu", 2.0, "no_sync"): "no_sync",
    }
    for (ep, device, cf, choice), expected in cases.items():
        config = RunConfig(
            moe=MoEConfig(num_experts=E, top_k=K, capacity_factor=cf, dispatcher=choice),
            parallel=ParallelConfig(ep=ep),
        )
        assert resolve_dispatcher(config, _dims(ep, device)) == expected, (ep, device, cf, choice)


def test_no_sync_at_ep1_matches_local_dispatch_without_host_syncs(monkeypatch):
    """The real NoSync code path at ep=1 (transport = identity): same outputs and gradients as
    LocalDispatcher with real grouped experts, and not one host read of device data."""
    x, ids, w = group_inputs(1, seed=1)
    experts = GroupedExperts(E, D, 16)
    torch.nn.init.normal_(experts.w_up_eD2F, std=0.2)
    torch.nn.init.normal_(experts.w_down_eFD, std=0.2)
    grad_TD = torch.randn(T, D)

    def run(dispatcher):
        x_TD, w_TK = x[0].clone().requires_grad_(), w[0].clone().requires_grad_()
        rows, offsets, handle = dispatcher.dispatch(x_TD, make_routing(ids[0], w_TK))
        y_TD = dispatcher.combine(experts(rows, offsets, handle.row_weights_N), handle)
        y_TD.backward(grad_TD)
        return y_TD.detach(), x_TD.grad, w_TK.grad

    expected = run(LocalDispatcher())

    def no_host_sync(*args, **kwargs):
        raise AssertionError("host sync in NoSyncDispatcher")

    for name in ("item", "tolist", "nonzero", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, no_host_sync)
    actual = run(NoSyncDispatcher(E, None, 0, NEVER_DROPS))
    monkeypatch.undo()
    for a, b in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


class CountCalls:
    """Counts calls of torch.distributed collectives and Tensor.tolist while active."""

    NAMES = ("all_to_all_single", all_gather_flat_name())

    def __enter__(self):
        self.counts = dict.fromkeys((*self.NAMES, "tolist"), 0)
        self.saved = {name: getattr(dist, name) for name in self.NAMES}
        self.saved_tolist = torch.Tensor.tolist
        for name in self.NAMES:
            setattr(dist, name, self._wrap(name, self.saved[name]))
        torch.Tensor.tolist = self._wrap("tolist", self.saved_tolist)
        return self

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.counts[name] += 1
            return fn(*args, **kwargs)

        return counted

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)
        torch.Tensor.tolist = self.saved_tolist
        return False


def _dispatch_world2(rank, world_size):
    group = dist.new_group([0, 1])
    G, e = world_size, E // world_size
    make = {
        "all_to_all": lambda cf: AllToAllDispatcher(E, group),
        "no_sync": lambda cf: NoSyncDispatcher(E, group, rank, capacity_factor=cf),
    }
    # 1. Identity experts and weights summing to one: combine(dispatch(x)) == x. The rows each
    #    rank receives are, expert by expert, source by source, in token order, the routed tokens.
    x, ids, w = group_inputs(G, seed=7)
    for kind in ("all_to_all", "no_sync"):
        dispatcher = make[kind](NEVER_DROPS)
        rows, offsets, handle = dispatcher.dispatch(x[rank], make_routing(ids[rank], w[rank]))
        expected_rows = [
            x[s, t]
            for g in range(rank * e, (rank + 1) * e)
            for s in range(G)
            for t in range(T)
            if g in ids[s, t]
        ]
        routes_E = count_tokens_per_expert(ids.view(-1, K), E)
        assert torch.equal(offsets.long(), routes_E[rank * e : (rank + 1) * e].cumsum(0)), kind
        torch.testing.assert_close(rows[: len(expected_rows)], torch.stack(expected_rows))
        torch.testing.assert_close(dispatcher.combine(rows, handle), x[rank], rtol=1e-6, atol=1e-6)

    # 2. Scaling experts, forward and backward, against the loop reference, dropless and with
    #    capacity factors small enough that both the expert and the block limits drop routes.
    for kind, cf, skew in (
        ("all_to_all", None, 0.6),
        ("no_sync", NEVER_DROPS, 0.6),
        ("no_sync", 1.0, 0.6),
        ("no_sync", 0.5, 0.3),
    ):
        x, ids, w = group_inputs(G, seed=11, skew=skew)
        dispatcher = make[kind](cf)
        x_TD, w_TK = x[rank].clone().requires_grad_(), w[rank].clone().requires_grad_()
        grad_TD = torch.randn(T, D, generator=torch.Generator().manual_seed(rank))
        with CountCalls() as calls:
            rows, offsets, handle = dispatcher.dispatch(x_TD, make_routing(ids[rank], w_TK))
            y_TD = dispatcher.combine(scale_experts(rows, offsets, rank * e), handle)
            y_TD.backward(grad_TD)
        if kind == "no_sync":
            assert calls.counts == {"all_to_all_single": 4, all_gather_flat_name(): 1, "tolist": 0}
            expert_capacity, block_rows = dispatcher.capacities(T, K)
            fits, keep = reference_keep(ids, G, expert_capacity, block_rows)
            if cf < NEVER_DROPS:  # both limits drop routes somewhere in the group
                assert (~fits).any() and (fits & ~keep).any(), f"cf={cf} does not exercise both"
            else:
                assert keep.all()
        else:  # one counts exchange, rows there and back, the same twice in backward
            assert calls.counts == {"all_to_all_single": 5, all_gather_flat_name(): 0, "tolist": 1}
            keep = torch.ones(ids.shape, dtype=torch.bool)
        x_ref, w_ref = x[rank].clone().requires_grad_(), w[rank].clone().requires_grad_()
        scale_TK = (ids[rank] + 1).float() * keep[rank]
        y_ref = ((w_ref * scale_TK).sum(-1, keepdim=True)) * x_ref
        y_ref.backward(grad_TD)
        what = f"{kind} cf={cf}"
        torch.testing.assert_close(y_TD.detach(), y_ref.detach(), msg=what)
        torch.testing.assert_close(x_TD.grad, x_ref.grad, msg=what)
        torch.testing.assert_close(w_TK.grad, w_ref.grad, msg=what)
        if kind == "no_sync":
            stats = dispatcher.read_stats()
            assert int(stats["dropped_routes"]) == int((~keep[rank]).sum()), what
            rows_used = sum(int((ids[s][keep[s]] // e == rank).sum()) for s in range(G))
            assert float(stats["buffer_utilization"]) == pytest.approx(rows_used / (G * block_rows))
    return True


@pytest.mark.distributed
def test_dispatchers_world2():
    assert run_distributed(_dispatch_world2, 2) == [True, True]


def _fp8_payload_world2(rank, world_size):
    """precision.dispatch=fp8: the rows cross ranks as uint8 (e4m3 + scale), arrive as the
    FP8-rounded tokens, and the gradient is that of the bf16 path (straight-through)."""
    group = dist.new_group([0, 1])
    e = E // world_size
    for kind in ("all_to_all", "no_sync"):
        x, ids, w = group_inputs(world_size, seed=5, skew=0.3)
        routing = make_routing(ids[rank], w[rank])
        grad_TD = torch.randn(T, D, generator=torch.Generator().manual_seed(rank))
        results = []
        for payload, x_in in (
            (FP8_PAYLOAD, x[rank]),
            (BF16_PAYLOAD, fp8_round_trip_reference(x[rank])),
        ):
            if kind == "all_to_all":
                dispatcher = AllToAllDispatcher(E, group, payload)
            else:
                dispatcher = NoSyncDispatcher(E, group, rank, NEVER_DROPS, payload=payload)
            x_TD = x_in.clone().requires_grad_()
            sent = []
            original = dist.all_to_all_single

            def recording(out, inp, *args, sent=sent, original=original, **kwargs):
                sent.append((inp.dtype, tuple(inp.shape[1:])))
                return original(out, inp, *args, **kwargs)

            dist.all_to_all_single = recording
            try:
                rows, offsets, handle = dispatcher.dispatch(x_TD, routing)
                y_TD = dispatcher.combine(scale_experts(rows, offsets, rank * e), handle)
                y_TD.backward(grad_TD)
            finally:
                dist.all_to_all_single = original
            results.append((rows.detach(), y_TD.detach(), x_TD.grad, sent))
        (rows8, y8, g8, sent8), (rows16, y16, g16, sent16) = results
        assert torch.equal(rows8, rows16), kind
        assert torch.equal(y8, y16) and torch.equal(g8, g16), kind
        rows_sent = [s for s in sent8 if s[1]]  # the counts exchange sends 1-D tensors
        assert rows_sent[0] == (torch.uint8, (D + 4,)), (kind, sent8)
        assert all(s == (torch.float32, (D,)) for s in rows_sent[1:]), (kind, sent8)
        assert [s for s in sent16 if s[1]][1:] == rows_sent[1:], kind
    return True


@pytest.mark.distributed
def test_fp8_payload_world2():
    assert run_distributed(_fp8_payload_world2, 2) == [True, True]
