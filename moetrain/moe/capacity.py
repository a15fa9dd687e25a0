"""Dropless or capacity mode: which dispatcher `moe.dispatcher: auto` picks, and how many rows a
rank's expert buffers hold. Host integer arithmetic, shared by the expert-parallel dispatchers
(`moetrain.parallel`) and the planner (`moetrain.tools.plan`, which must not import torch).

Letters: T tokens of one rank's micro-batch, K top-k, E global experts, G ranks of the
expert-parallel group, e = E / G local experts, cf = moe.capacity_factor.
- Dropless (cf None): under expert parallelism the exact-split `AllToAllDispatcher`, one host
  sync per MoE layer forward; a rank's buffers hold exactly its routed rows (T*K on average).
- Capacity mode (cf set): `NoSyncDispatcher`, static shapes, no host sync. Each (source ->
  destination) block has B = min(ceil(cf T K / G), T min(K, e)) rows, about cf T K a rank;
  routes beyond expert or block capacity are dropped and counted. Without a factor the blocks
  would need the worst case, G T min(K, e) rows a rank (up to G times T*K): NoSync requires one.
  (cf >= E / K reaches both worst cases: nothing is dropped.)
"""

from __future__ import annotations

import math


def auto_dispatcher(ep: int, cuda: bool, capacity_factor: float | None) -> str:
    """What `moe.dispatcher: auto` resolves to: local without expert parallelism; at ep > 1
    no_sync on CUDA with a capacity factor, else all_to_all (dropless; what gloo runs)."""
    if ep == 1:
        return "local"
    return "no_sync" if cuda and capacity_factor is not None else "all_to_all"


def keeps_every_route(capacity_factor: float, top_k: int, num_experts: int) -> bool:
    """cf >= E / K: NoSync's expert and block capacities reach their worst cases at any T, so it
    drops nothing, on a whole micro-batch or on any part of it."""
    return capacity_factor * top_k >= num_experts


def no_sync_capacities(
    num_tokens: int, top_k: int, num_ranks: int, num_experts: int, capacity_factor: float | None
) -> tuple[int, int]:
    """(expert_capacity, block_rows) of NoSyncDispatcher: expert capacity ceil(cf G T K / E) and
    block rows B = min(ceil(cf T K / G), T min(K, e)). A token routes to an expert at most once,
    so one source sends at most T min(K, e) rows to one rank: no block is larger than that."""
    if capacity_factor is None or capacity_factor <= 0:
        raise ValueError(
            f"moe.capacity_factor ({capacity_factor!r}) must be > 0 for the no_sync dispatcher"
        )
    G, T, K, cf = num_ranks, num_tokens, top_k, capacity_factor
    worst_block = T * min(K, num_experts // G)
    expert_capacity = math.ceil(round(cf * G * T * K / num_experts, 6))
    return expert_capacity, min(math.ceil(round(cf * T * K / G, 6)), worst_block)


def expert_buffer_rows(
    dispatcher: str,
    num_tokens: int,
    top_k: int,
    num_ranks: int,
    num_experts: int,
    capacity_factor: float | None,
) -> int:
    """Rows a rank's experts take in one MoE layer for a micro-batch of `num_tokens` tokens
    (local / all_to_all: the T*K routes, exact for local and the expectation under uniform
    routing for all_to_all; no_sync: the G B rows its receive buffer allocates)."""
    if dispatcher == "no_sync":
        _, block_rows = no_sync_capacities(
            num_tokens, top_k, num_ranks, num_experts, capacity_factor
        )
        return num_ranks * block_rows
    return num_tokens * top_k
