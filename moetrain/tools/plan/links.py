"""The link model: seconds of a collective on one GPU from the bytes it moves over NVLink (inside
a node) and the network (between nodes), bandwidth-optimal and hierarchical (docs/plan.md,
"Communication model"). Bandwidths are per GPU and direction in GB/s (NVLink 4's datasheet
"900 GB/s" is 450). Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass


def members_per_node(group: int, stride: int, gpus_per_node: int) -> int:
    """How many members of a group (ranks `stride` apart) share one node."""
    return max(1, min(group, gpus_per_node // stride))


def split_collective(nbytes: float, group: int, stride: int, node: int) -> tuple[float, float]:
    """(bytes over NVLink, bytes over the network) one GPU sends in a reduce-scatter or an
    all-gather of an `nbytes` buffer, hierarchically (docs/plan.md)."""
    local = members_per_node(group, stride, node)
    nodes = -(-group // local)
    return nbytes * (local - 1) / local, nbytes / local * (nodes - 1) / nodes


def split_all_to_all(nbytes: float, group: int, node: int) -> tuple[float, float]:
    """(bytes over NVLink, bytes over the network) one GPU sends in an all-to-all over
    consecutive ranks, its `nbytes` spread evenly over the group (itself included)."""
    local = members_per_node(group, 1, node)
    return nbytes * (local - 1) / group, nbytes * (group - local) / group


@dataclass(frozen=True, kw_only=True)
class Links:
    """Bandwidths per GPU and direction (GB/s), the node size, a latency per collective."""

    nvlink_gbps: float
    internode_gbps: float
    gpus_per_node: int = 8
    latency_us: float = 10.0
    efficiency: float = 1.0
    half_rate_bytes: float = 2**20  # all-to-all message size at half the collectives' rate

    def __post_init__(self) -> None:
        for name in ("nvlink_gbps", "internode_gbps", "gpus_per_node", "efficiency"):
            if getattr(self, name) <= 0:
                raise ValueError(f"links {name} ({getattr(self, name)}) must be > 0")

    def transfer_s(self, intra: float, inter: float, *, concurrent: bool) -> float:
        """Seconds to send `intra` bytes over NVLink and `inter` over the network, both links at
        once (`concurrent`) or one after the other; no latency."""
        t_intra = intra / (self.nvlink_gbps * 1e9 * self.efficiency)
        t_inter = inter / (self.internode_gbps * 1e9 * self.efficiency)
        return max(t_intra, t_inter) if concurrent else t_intra + t_inter

    def reduce_scatter_s(self, nbytes: float, group: int, stride: int = 1) -> float:
        """A reduce-scatter of an `nbytes` input (also the time of an all-gather of an `nbytes`
        output) over `group` ranks `stride` apart."""
        if group == 1:
            return 0.0
        intra, inter = split_collective(nbytes, group, stride, self.gpus_per_node)
        return self.transfer_s(intra, inter, concurrent=False) + self.latency_us * 1e-6

    all_gather_s = reduce_scatter_s

    def all_reduce_s(self, nbytes: float, group: int, stride: int = 1) -> float:
        """A ring all-reduce: a reduce-scatter and an all-gather of the same buffer."""
        return 2 * self.reduce_scatter_s(nbytes, group, stride)

    def message_rate(self, message_bytes: float) -> float:
        """The share of the collectives' rate an all-to-all of `message_bytes` a peer reaches."""
        return message_bytes / (message_bytes + self.half_rate_bytes)

    def all_to_all_s(self, nbytes: float, group: int) -> float:
        """An all-to-all of a rank's `nbytes` payload over `group` consecutive ranks."""
        if group == 1:
            return 0.0
        intra, inter = split_all_to_all(nbytes, group, self.gpus_per_node)
        seconds = self.transfer_s(intra, inter, concurrent=True) / self.message_rate(nbytes / group)
        return seconds + self.latency_us * 1e-6
