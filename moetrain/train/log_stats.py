"""What a log step reads from the device: the step accumulators and each MoE layer's statistics,
reduced over the ranks (and gathered over pipeline stages) so that every rank logs the same.

Everything stays a device tensor here; the trainer copies to the host once, after this returns.
"""

from __future__ import annotations

import torch

from moetrain.model.transformer import Transformer
from moetrain.parallel.data import all_reduce_stats
from moetrain.parallel.expert import read_dispatch_stats
from moetrain.parallel.mesh import ParallelDims
from moetrain.parallel.pipeline import Pipeline

ROUTER_MEANS = ("lb_loss", "z_loss", "entropy")  # means over the dp ranks, like the loss


def collect_log_values(
    acc: dict[str, torch.Tensor],
    model: Transformer,
    moe_names: list[str],
    pipeline: Pipeline | None,
    dims: ParallelDims,
) -> tuple[dict[str, torch.Tensor], list[dict], dict[int, torch.Tensor]]:
    """(accumulator values, each MoE layer's statistics, receive-buffer rows used / allocated by
    layer index: NoSync's, this rank's value, without a pipeline). The accumulators are zeroed
    in place after the read: a captured step graph adds into these very tensors. Over several
    ranks the loss and the good-step count are means over dp, the router's losses and entropy
    too, and the token and drop counts are sums."""
    values = {k: v.clone() for k, v in acc.items()}
    for v in acc.values():
        v.zero_()
    stats = [layer.read_stats() for layer in model.moe_layers()]
    dispatch = read_dispatch_stats(model)
    utilization = {}
    for i, (name, s) in enumerate(zip(moe_names, stats, strict=True)):
        if f"{name}.dropped_routes" in dispatch:
            s["dropped"] = dispatch[f"{name}.dropped_routes"]
        if f"{name}.buffer_utilization" in dispatch and pipeline is None:
            utilization[i] = dispatch[f"{name}.buffer_utilization"]
    if pipeline is not None:  # every stage's layers, numbered as in one process
        stats = pipeline.gather_moe_stats(stats)
    if dims.world_size > 1:
        scalars = torch.stack([values["loss"], values["good"]])
        counts = [s[k] for s in stats for k in ("tokens_per_expert", "dropped") if k in s]
        means_L3 = scalars.new_zeros(len(stats), len(ROUTER_MEANS))  # no rows: all-dense model
        for s, row in zip(stats, means_L3, strict=True):
            row.copy_(torch.stack([s[k] for k in ROUTER_MEANS]))
        all_reduce_stats([scalars, means_L3, *counts], dims)
        values["loss"], values["good"] = scalars[0] / dims.dp, scalars[1] / dims.dp
        for s, row in zip(stats, means_L3 / dims.dp, strict=True):
            s.update(zip(ROUTER_MEANS, row, strict=True))
    return values, stats, utilization
