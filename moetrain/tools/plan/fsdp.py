"""FSDP2 (`parallel.data_parallel=fsdp`, ep 1, pp 1) on paper: what a rank holds and what it sends,
per micro-batch, for each `parallel.fsdp_reshard` mode, reduce dtype and HSDP (docs/plan.md,
"FSDP2 and HSDP"). Every block is one FSDP2 group over n ranks (all N, or a node under HSDP),
the root (embedding, final norm, head) another; at n = 1 FSDP2 is not applied and nothing is
gathered. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config import RunConfig
from moetrain.tools.plan.layout import Layout
from moetrain.tools.plan.links import Links
from moetrain.tools.plan.memory import Memory, layer_params, precision_bytes, stage_activation_bytes

RESHARD = ("forward", "backward", "step")
PREFETCHED_BLOCKS = 2  # `forward`: the running block's parameters and the next one's


@dataclass(frozen=True)
class FsdpTransfers:
    """Seconds of a rank's FSDP2 transfers, each over every group of its kind once."""

    reshard: str
    root_gather: float  # exposed: nothing runs before it
    block_gathers: float  # prefetched under the forward (and for `forward` the backward)
    block_reductions: float  # reduce-scatters (+ HSDP all-reduces) under the backward
    root_reduction: float  # after the backward: exposed

    def of_microbatch(self, i: int, m: int) -> tuple[float, float, float, float, float]:
        """Micro-batch i of m: (root gather, forward gathers, backward gathers, block
        reductions, root reduction)."""
        gathers = self.reshard != "step" or i == 0
        reduces = self.reshard != "step" or i == m - 1
        again = self.reshard == "forward"
        return (
            self.root_gather * gathers,
            self.block_gathers * gathers,
            self.block_gathers * again,
            self.block_reductions * reduces,
            self.root_reduction * reduces,
        )


def _shards(config: RunConfig, num_gpus: int, shard: int | None) -> tuple[int, int]:
    n = shard or num_gpus
    if num_gpus % n:
        raise ValueError(f"the FSDP shard group ({n}) must divide the number of GPUs ({num_gpus})")
    if config.model.num_dense:
        raise ValueError(
            "the FSDP2 model counts MoE blocks only (model.num_dense_layers 0, no dense_layers)"
        )
    return n, num_gpus // n


def fsdp_transfers(
    config: RunConfig,
    links: Links,
    num_gpus: int,
    *,
    reshard: str,
    reduce_bytes: int,
    shard: int | None = None,
) -> FsdpTransfers:
    """The transfers of a rank (docs/plan.md); `shard`: HSDP's group."""
    if reshard not in RESHARD:
        raise ValueError(f"parallel.fsdp_reshard ({reshard!r}) must be one of {', '.join(RESHARD)}")
    n, replicas = _shards(config, num_gpus, shard)
    lp, a = layer_params(config), precision_bytes(config).param
    L, block, root = config.model.num_layers, lp.moe_layer.total, lp.outside.total

    def reduce(numel: int) -> float:
        scatter = links.reduce_scatter_s(numel * reduce_bytes, n)
        return scatter + links.all_reduce_s(numel * reduce_bytes / n, replicas, n)

    return FsdpTransfers(
        reshard=reshard,
        root_gather=links.all_gather_s(root * a, n),
        block_gathers=L * links.all_gather_s(block * a, n),
        block_reductions=L * reduce(block),
        root_reduction=reduce(root),
    )


def fsdp_memory(
    config: RunConfig,
    layout: Layout,
    num_gpus: int,
    *,
    reshard: str,
    reduce_bytes: int,
    shard: int | None = None,
    overhead: int = 0,
    activation_factor: float = 1.0,
) -> Memory:
    """Bytes a rank holds at its peak (docs/plan.md). `layout` gives the micro-batch and
    the checkpointing (pp 1, ep 1)."""
    n, _ = _shards(config, num_gpus, shard)
    b, lp = precision_bytes(config), layer_params(config)
    L, block, root = config.model.num_layers, lp.moe_layer.total, lp.outside.total
    total = L * block + root
    gathered = grads = 0
    if n > 1:
        blocks = {"forward": PREFETCHED_BLOCKS, "backward": L, "step": L}[reshard]
        gathered = b.param * (min(blocks, L) * block + root)
        in_flight = block * (b.param + reduce_bytes)  # a block's gradients, the last's scatter
        grads = reduce_bytes * total if reshard == "step" else in_flight
    tokens = layout.micro_batch_size * config.train.seq_len
    kept, transient = stage_activation_bytes(config, layout, 0, tokens)
    shard_numel = -(-total // n)
    return Memory(
        params=b.param * shard_numel + gathered,
        grads=b.param * shard_numel + grads,
        optimizer=(b.master + b.moments) * shard_numel,
        activations=int(kept * activation_factor),
        transient=int(transient * activation_factor),
        overhead=overhead,
    )
