"""Expert-parallel dispatchers: send each (token, k) route to the rank that owns its expert.

Letters: T tokens, K top-k, N = T*K routes, D model dim, E global experts, G ranks of the
expert-parallel group, e = E / G local experts; in count tensors s = source rank, d = destination
rank, x = local expert (global expert = d * e + x). Rank g owns experts [g*e, (g+1)*e).

Both implement `moe.dispatch.Dispatcher` (rows grouped by LOCAL expert, int32 cumulative end
offsets; `combine` returns y_TD = sum_k w_tk * y(route tk); differentiable).
- `AllToAllDispatcher` (dropless): exact variable splits; its one host sync reads the split
  sizes (`_sync_split_sizes`).
- `NoSyncDispatcher` (capacity mode): every shape is fixed by (T, K, G, capacity factor) before
  the step, every decision is made on the device, fixed blocks move. Dropped routes contribute
  zero (moe/capacity.py says why a capacity factor is required).
Both are phases around one exchange each way (`ExpertParallel`); `launch` starts an exchange
without waiting for it, which parallel/overlap.py runs under other compute (moe.overlap).
`payload` (moe/payload.py; precision.dispatch, installed by the precision plan) is what the
dispatched rows travel as; the combine and all gradients travel in the activations' dtype.
Statistics count training forwards only (not under no_grad nor in recomputation), so each route
counts once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch.distributed import ProcessGroup

from moetrain.dist_compat import group_size
from moetrain.kernels.masked_rows import gather_tokens, masked_gather, weighted_route_sum
from moetrain.moe.balance import count_tokens_per_expert
from moetrain.moe.capacity import no_sync_capacities
from moetrain.moe.dispatch import inverse_permutation, sort_routes
from moetrain.moe.experts import NO_FP8_ROWS, FP8Rows
from moetrain.moe.payload import BF16_PAYLOAD, Payload
from moetrain.moe.recompute import is_recomputing
from moetrain.moe.router import RoutingResult
from moetrain.parallel.comm import (
    AsyncExchange,
    all_gather_counts,
    all_to_all,
    all_to_all_counts,
    exchange_blocks,
    traceable,
)


def _positions_within_expert(ids_N: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """For each route, how many earlier routes (in token order) chose the same expert. A stable
    sort keeps token order inside each expert; no data-dependent shapes."""
    sorted_rank_N = inverse_permutation(sort_routes(ids_N, counts_E.shape[0]))
    first_E = counts_E.cumsum(0) - counts_E
    return sorted_rank_N - first_E[ids_N]


def _expert_major_index(
    counts_Ge: torch.Tensor, start_Ge: torch.Tensor, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Received rows arrive source-major: the rows from source s for local expert x start at row
    start_Ge[s, x] and number counts_Ge[s, x]. Returns, for each of `num_rows` expert-major
    positions (expert x, then source s, then arrival order), the received row to read, plus the
    cumulative end offsets per local expert. Positions past the last offset read -1 (nothing)."""
    G, e = counts_Ge.shape
    len_eG = counts_Ge.T.reshape(-1)
    end_eG = len_eG.cumsum(0)
    m_M = torch.arange(num_rows, device=counts_Ge.device)
    segment_M = torch.searchsorted(end_eG, m_M, right=True)
    valid_M = segment_M < e * G
    segment_M = segment_M.clamp(max=e * G - 1)
    x_M, s_M = segment_M // G, segment_M % G
    row_M = start_Ge[s_M, x_M] + m_M - (end_eG - len_eG)[segment_M]
    offsets_e = counts_Ge.sum(0).cumsum(0).to(torch.int32)
    return torch.where(valid_M, row_M, -1), offsets_e


def _inverse_index(
    index_M: torch.Tensor, valid_M: torch.Tensor | None, size: int, fill: int = -1
) -> torch.Tensor:
    """inverse[index_M[m]] = m for valid m; rows nobody points at get `fill`. Unique scatter
    targets (invalid m go to private slots past `size`), so the result is deterministic."""
    m_M = torch.arange(index_M.numel(), device=index_M.device)
    if valid_M is not None:
        index_M = torch.where(valid_M, index_M, size + m_M)
    inverse = torch.full((size + index_M.numel(),), fill, dtype=torch.int64, device=index_M.device)
    return inverse.scatter_(0, index_M, m_M)[:size]


# ---- what both dispatchers share ------------------------------------------------------------


@dataclass
class ExchangeHandle:
    """What `combine` needs of a dispatch. Every index is -1 where there is nothing: a gather
    reads a zero row, a sum skips it (moetrain.kernels.masked_rows). Rows leave in `route_row_TK`
    order (each route's row in the buffer that goes out and comes back; dropped routes: -1) and
    arrive source-major; `arrive_R` gathers them expert-major (padding: -1), `depart_R` gathers
    the experts' outputs back into arrival order (rows no expert read: -1, they go back zero)."""

    route_row_TK: torch.Tensor
    row_route_R: torch.Tensor  # route (t * K + k) of each row that goes out; unused rows: -1
    weights_TK: torch.Tensor
    arrive_R: torch.Tensor  # received row of each expert-major position
    arrive_back_R: torch.Tensor  # expert-major position of each received row
    depart_R: torch.Tensor  # expert-major position of each received row, for the return trip
    recv_splits: list[int] | None = None  # None: equal blocks (NoSync)
    send_splits: list[int] | None = None
    row_weights_N: None = None  # combine weights the routes (rows cross ranks without them)
    rows_fp8: FP8Rows = NO_FP8_ROWS  # the experts quantize the rows they receive


class ExpertParallel:
    """The dispatcher protocol from phases around one exchange each way:

        dispatch = plan -> exchange -> arrive        combine = depart -> exchange -> weighted_sum

    `plan(x_TD, routing)` -> (rows to send, handle, offsets_e); `exchange(rows, handle, forward)`
    moves rows (forward: the dispatch; else the combine's way back); `launch(rows, handle,
    forward)` starts the same exchange and returns it in flight (`comm.AsyncExchange`: its `end()`
    waits on the device and returns what `exchange` does). Subclasses define `plan`, `exchange`
    and `launch`."""

    payload: Payload

    def dispatch(self, x_TD: torch.Tensor, routing: RoutingResult):
        send_RD, handle, offsets_e = self.plan(x_TD, routing)
        return self.arrive(self.exchange(send_RD, handle, True), handle, offsets_e)

    def combine(self, y_RD: torch.Tensor, handle: ExchangeHandle) -> torch.Tensor:
        return self.weighted_sum(self.exchange(self.depart(y_RD, handle), handle, False), handle)

    def _payload(self, forward: bool) -> Payload:
        """The dispatched rows travel in `payload`; the combine's in the activations' dtype."""
        return self.payload if forward else BF16_PAYLOAD

    # Every gather's backward is a gather by the inverse index (moetrain.kernels.masked_rows).
    @staticmethod
    def arrive(recv_RD, handle: ExchangeHandle, offsets_e):
        """The received rows in expert-major order: what `dispatch` returns."""
        return masked_gather(recv_RD, handle.arrive_R, handle.arrive_back_R), offsets_e, handle

    @staticmethod
    def depart(y_RD: torch.Tensor, handle: ExchangeHandle) -> torch.Tensor:
        """The experts' outputs in arrival order, to go back."""
        return masked_gather(y_RD, handle.depart_R, handle.arrive_R)

    @staticmethod
    def weighted_sum(back_RD: torch.Tensor, handle: ExchangeHandle) -> torch.Tensor:
        """Each token's K returned routes weighted and summed in one pass: what `combine`
        returns (a dropped route, index -1, adds nothing)."""
        return weighted_route_sum(
            back_RD, handle.route_row_TK, handle.weights_TK, handle.row_route_R
        )


# ---- AllToAllDispatcher ---------------------------------------------------------------------


def _sync_split_sizes(
    send_counts_G: torch.Tensor, recv_counts_G: torch.Tensor
) -> tuple[list[int], list[int]]:
    """THE host sync of the baseline: a variable-split all-to-all needs its sizes on the host."""
    sizes = torch.cat([send_counts_G, recv_counts_G]).tolist()
    return sizes[: len(sizes) // 2], sizes[len(sizes) // 2 :]


class AllToAllDispatcher(ExpertParallel):
    """Sort routes by global expert (grouping them by destination rank), exchange counts, sync
    split sizes to the host, move exactly the routed rows, reorder them expert-major. Dropless
    (`moe.capacity_factor` does not apply). The sizes are read on the host in `plan`, so a
    launched exchange overlaps only the rows' movement."""

    def __init__(
        self, num_experts: int, group: ProcessGroup | None, payload: Payload = BF16_PAYLOAD
    ) -> None:
        self.group, self.num_experts = group, num_experts
        self.payload = payload
        self.num_ranks = group_size(group)
        assert num_experts % self.num_ranks == 0
        self.num_local = num_experts // self.num_ranks

    def plan(self, x_TD: torch.Tensor, routing: RoutingResult):
        G, e = self.num_ranks, self.num_local
        T, K = routing.expert_ids_TK.shape
        ids_N = routing.expert_ids_TK.reshape(-1)
        # 1. Sort routes by global expert: rank d's rows are contiguous, in local-expert order.
        order_N = sort_routes(ids_N, self.num_experts)
        inverse_order_N = inverse_permutation(order_N)
        send_ND = gather_tokens(x_TD, order_N // K, inverse_order_N.view(T, K))
        # 2. Exchange counts: recv_counts_Ge[s, x] = routes from rank s to my local expert x.
        send_counts_E = count_tokens_per_expert(ids_N, self.num_experts)
        recv_counts_Ge = all_to_all_counts(send_counts_E, self.group)
        # 3. The host sync (4. the rows move in `exchange`).
        send_splits, recv_splits = _sync_split_sizes(
            send_counts_E.view(G, e).sum(1), recv_counts_Ge.sum(1)
        )
        # 5. Source-major -> expert-major (a permutation: nothing is padding).
        num_recv = sum(recv_splits)
        start_Ge = (recv_counts_Ge.reshape(-1).cumsum(0) - recv_counts_Ge.reshape(-1)).view(G, e)
        recv_row_R, offsets_e = _expert_major_index(recv_counts_Ge, start_Ge, num_recv)
        arrive_back_R = _inverse_index(recv_row_R, None, num_recv)
        handle = ExchangeHandle(
            route_row_TK=inverse_order_N.view(T, K),
            row_route_R=order_N,
            weights_TK=routing.weights_TK,
            arrive_R=recv_row_R,
            arrive_back_R=arrive_back_R,
            depart_R=arrive_back_R,
            recv_splits=recv_splits,
            send_splits=send_splits,
        )
        return send_ND, handle, offsets_e

    def exchange(self, rows_RD: torch.Tensor, handle: ExchangeHandle, forward: bool):
        recv, send = self._splits(handle, forward)
        return all_to_all(rows_RD, self.group, recv, send, payload=self._payload(forward))

    def launch(self, rows_RD: torch.Tensor, handle: ExchangeHandle, forward: bool):
        recv, send = self._splits(handle, forward)
        return AsyncExchange(self.group, recv, send, payload=self._payload(forward)).begin(rows_RD)

    @staticmethod
    def _splits(handle: ExchangeHandle, forward: bool) -> tuple[list[int], list[int]]:
        recv, send = handle.recv_splits, handle.send_splits
        return (recv, send) if forward else (send, recv)

    def read_stats(self, reset: bool = True) -> dict[str, torch.Tensor]:
        return {}  # dropless, no padding: nothing to report


# ---- NoSyncDispatcher -----------------------------------------------------------------------


class Transport(Protocol):
    def exchange(self, send_RD: torch.Tensor, payload: Payload = BF16_PAYLOAD) -> torch.Tensor:
        """`send_RD` is G equal blocks, block g bound for rank g. Returns the G received blocks
        (block g from rank g), nothing appended. Differentiable. The blocks travel as `payload`
        (see moetrain.moe.payload)."""
        ...

    def begin(self, send_RD: torch.Tensor, payload: Payload = BF16_PAYLOAD) -> AsyncExchange:
        """The same exchange, launched; its `end()` returns what `exchange` does."""
        ...


class AllToAllTransport:
    """Fixed blocks over an equal-split all_to_all_single (portable: NCCL and gloo), traceable by
    torch.compile (moetrain.parallel.comm.exchange_blocks). A group of one returns the blocks as
    they are."""

    def __init__(self, group: ProcessGroup | None, traced: bool = True) -> None:
        self.group, self.traced = group, traced

    def exchange(self, send_RD: torch.Tensor, payload: Payload = BF16_PAYLOAD) -> torch.Tensor:
        return exchange_blocks(send_RD, self.group, 0, payload, self.traced)

    def begin(self, send_RD: torch.Tensor, payload: Payload = BF16_PAYLOAD) -> AsyncExchange:
        return AsyncExchange(self.group, payload=payload).begin(send_RD)


def keep_counts(counts_sdx: torch.Tensor, expert_capacity: int, block_rows: int) -> torch.Tensor:
    """The keep rule, identical on every rank. counts_sdx[s, d, x] routes go from source s to
    local expert x of rank d; returns how many of them are kept (the first ones in token order).
    (a) Expert capacity: expert (d, x) takes routes source by source in rank order, then token
        order, up to `expert_capacity`.
    (b) Block capacity: the (s -> d) block takes the survivors of (a) expert by expert, then in
        token order, up to `block_rows`.
    Tail-dropping in this fixed order (expert, source rank, token position) is a pure function
    of the shared count matrix: static shapes, no host sync."""
    before_sdx = counts_sdx.cumsum(0) - counts_sdx
    fits_expert_sdx = (expert_capacity - before_sdx).clamp(min=0).minimum(counts_sdx)
    before_in_block_sdx = fits_expert_sdx.cumsum(2) - fits_expert_sdx
    return (block_rows - before_in_block_sdx).clamp(min=0).minimum(fits_expert_sdx)


class NoSyncDispatcher(ExpertParallel):
    """GPU-resident dispatch: count, share counts, decide, move fixed blocks, compute, return.
    Every rank must call it with the same T (training micro-batches do; ragged evaluation batches
    take AllToAllDispatcher). A rank's receive buffer is G blocks of
    B = min(ceil(cf T K / G), T min(K, e)) rows; a dropless variant would need G T min(K, e)."""

    def __init__(
        self,
        num_experts: int,
        group: ProcessGroup | None,
        ep_rank: int,
        capacity_factor: float,
        transport: Transport | None = None,
        payload: Payload = BF16_PAYLOAD,
        device: torch.device | str | None = None,
    ) -> None:
        if capacity_factor is None or capacity_factor <= 0:
            raise ValueError(
                f"NoSyncDispatcher needs a capacity factor > 0, got {capacity_factor!r}: set "
                "moe.capacity_factor (e.g. 1.25-2.0), or use the dropless all_to_all dispatcher"
            )
        self.group, self.num_experts, self.ep_rank = group, num_experts, ep_rank
        self.num_ranks = group_size(group)
        assert num_experts % self.num_ranks == 0 and 0 <= ep_rank < self.num_ranks
        self.num_local = num_experts // self.num_ranks
        self.capacity_factor = capacity_factor
        self.payload = payload
        # gloo with CUDA tensors: eager collectives even under compile (comm.traceable)
        self.traced = traceable(group, device)
        self.transport = (
            transport if transport is not None else AllToAllTransport(group, self.traced)
        )
        # Since the last read: dropped routes, receive rows used, routes, receive rows allocated.
        # Device counters: a compiled forward would recompile for every new host int, and a
        # CUDA-graph replay would not advance one.
        self._stats = None if device is None else self._new_stats(device)

    def capacities(self, num_tokens: int, top_k: int) -> tuple[int, int]:
        """(expert_capacity, block_rows), host integers fixed by the shapes
        (`moetrain.moe.capacity.no_sync_capacities`)."""
        return no_sync_capacities(
            num_tokens, top_k, self.num_ranks, self.num_experts, self.capacity_factor
        )

    def plan(self, x_TD: torch.Tensor, routing: RoutingResult):
        G, e, me = self.num_ranks, self.num_local, self.ep_rank
        T, K = routing.expert_ids_TK.shape
        expert_capacity, B = self.capacities(T, K)
        R = G * B  # rows of the send and of the receive buffer
        ids_N = routing.expert_ids_TK.reshape(-1)
        device = ids_N.device

        # 1. Count this rank's routes per global expert.
        counts_E = count_tokens_per_expert(ids_N, self.num_experts)
        # 2. Share: every rank gets the same [G, E] matrix.
        counts_sdx = all_gather_counts(counts_E, self.group, self.traced).view(G, G, e)
        # 3. Decide: kept counts, block layout, then each of my routes' destination row.
        kept_sdx = keep_counts(counts_sdx, expert_capacity, B)
        block_start_sdx = kept_sdx.cumsum(2) - kept_sdx
        pos_N = _positions_within_expert(ids_N, counts_E)
        keep_N = pos_N < kept_sdx[me].reshape(-1)[ids_N]
        send_row_N = (ids_N // e) * B + block_start_sdx[me].reshape(-1)[ids_N] + pos_N
        send_row_N = torch.where(keep_N, send_row_N, -1)
        # 4. Write routes into their blocks (padding rows are zero; nobody reads them and their
        #    gradient is zero); `exchange` moves the fixed blocks.
        route_of_row_R = _inverse_index(send_row_N, keep_N, R)
        token_of_row_R = torch.where(route_of_row_R >= 0, route_of_row_R // K, -1)
        send_RD = gather_tokens(x_TD, token_of_row_R, send_row_N.view(T, K))
        # 5. One gather into expert-major order; positions past the last offset read nothing.
        start_sx = torch.arange(G, device=device)[:, None] * B + block_start_sdx[:, me, :]
        recv_row_R, offsets_e = _expert_major_index(kept_sdx[:, me, :], start_sx, R)
        arrive_back_R = _inverse_index(recv_row_R, recv_row_R >= 0, R)
        handle = ExchangeHandle(
            route_row_TK=send_row_N.view(T, K),
            row_route_R=route_of_row_R,
            weights_TK=routing.weights_TK,
            arrive_R=recv_row_R,
            arrive_back_R=arrive_back_R,
            depart_R=arrive_back_R,
        )
        if torch.is_grad_enabled() and not is_recomputing():  # training forwards, once each
            self._record(keep_N, offsets_e, R)
        return send_RD, handle, offsets_e

    # 6. (combine) the reverse movement; the weighted sum skips dropped routes
    def exchange(self, rows_RD: torch.Tensor, handle: ExchangeHandle, forward: bool):
        return self.transport.exchange(rows_RD, self._payload(forward))

    def launch(self, rows_RD: torch.Tensor, handle: ExchangeHandle, forward: bool):
        return self.transport.begin(rows_RD, self._payload(forward))

    @staticmethod
    def _new_stats(device: torch.device | str) -> torch.Tensor:
        return torch.zeros(4, dtype=torch.int64, device=device)

    @torch.no_grad()
    def _record(self, keep_N: torch.Tensor, offsets_e: torch.Tensor, rows_allocated: int) -> None:
        if self._stats is None:
            self._stats = self._new_stats(keep_N.device)
        routes = keep_N.numel()
        dropped = routes - keep_N.sum()
        used = offsets_e[-1].to(torch.int64)
        # the host totals enter as fills (kernel arguments), not as copies from the host
        totals = [torch.full_like(used, routes), torch.full_like(used, rows_allocated)]
        self._stats += torch.stack([dropped, used, *totals])

    @torch.no_grad()
    def read_stats(self, reset: bool = True) -> dict[str, torch.Tensor]:
        """Device tensors since the last read: `dropped_routes` (this rank's routes), their
        fraction `drop_fraction`, and `buffer_utilization` (receive rows used / allocated)."""
        if self._stats is None:
            return {}
        dropped, used, routes, allocated = self._stats.clone()
        stats = {
            "dropped_routes": dropped,
            "drop_fraction": dropped.double() / routes.clamp(min=1),
            "buffer_utilization": used.double() / allocated.clamp(min=1),
        }
        if reset:
            self._stats.zero_()
        return stats
