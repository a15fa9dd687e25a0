"""What a log step reads from the device: the step accumulators and each MoE layer's statistics,
reduced over the ranks so that every rank logs the same (`collect_log_values`), and the train
record built from them after one copy to the host (`train_record`).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from moetrain.data import MixedLoader, source_labels
from moetrain.model.transformer import Transformer
from moetrain.optim.schedule import lr_at
from moetrain.parallel.data import all_reduce_stats
from moetrain.parallel.expert import read_dispatch_stats
from moetrain.parallel.mesh import ParallelDims
from moetrain.parallel.pipeline import Pipeline
from moetrain.train.metrics import peak_memory_gib
from moetrain.train.observe import summarize_moe_stats

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


def train_record(trainer: Any, acc: dict[str, torch.Tensor]) -> tuple[dict[str, float], dict]:
    """(the accumulators on the host, the `kind: train` record of metrics.jsonl) at a log step of
    `trainer` (a moetrain.train.trainer.Trainer); adds the skipped and spike steps to its
    totals."""
    t = trainer.config.train
    values, stats, utilization = collect_log_values(
        acc, trainer.model, trainer._moe_names, trainer.pipeline, trainer.dims
    )
    host = {k: v.item() for k, v in values.items()}
    good = max(host["good"], 1.0)
    trainer.skipped_total += int(round(host["bad"]))
    trainer.spike_total += int(round(host["spikes"]))
    record: dict[str, Any] = {
        "kind": "train",
        "step": trainer.step,
        "loss": host["loss"] / good if host["good"] else math.nan,
        "lr": lr_at(trainer.step - 1, t),
        "grad_norm": host["grad_norm"] / good if host["good"] else math.nan,
        **trainer.throughput.measure(),
        "peak_mem_gib": peak_memory_gib(trainer.device),
        "skipped_steps": trainer.skipped_total,
        "spike_steps": trainer.spike_total,
        "time": time.time(),
        "moe": summarize_moe_stats(
            dict(enumerate(stats)),
            lb_weight=trainer.config.moe.lb_loss_weight,
            z_weight=trainer.config.moe.z_loss_weight,
        ),
    }
    for i, value in utilization.items():
        record["moe"][i]["buffer_utilization"] = float(value)
    loader = trainer.train_loader
    if isinstance(loader, MixedLoader):  # the counts are global, equal on all ranks
        labels = source_labels(trainer.config.data)
        record["tokens_per_source"] = dict(zip(labels, loader.tokens_per_source(), strict=True))
    record.update(trainer.epochs.fields(loader.passes(), trainer.step, trainer.console))
    for key in ("lb_loss", "z_loss"):
        layers = [layer[key] for layer in record["moe"]]
        record[key] = sum(layers) / len(layers) if layers else None
    return host, record
