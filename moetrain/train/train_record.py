"""The train record, one per log step: what the step sums and each MoE layer's statistics hold,
reduced over the ranks so that every rank logs the same (`collect_log_values`), read with one
copy to the host, with the interval's throughput, the bad-step totals (train/bad_steps.py), the
routing statistics (train/routing_stats.py) and the data's epochs (`TrainRecords`). It also
notes what a person should hear of: a new pass over the data, a gamed balance loss.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from moetrain.config import RunConfig
from moetrain.data import MixedLoader, source_labels
from moetrain.model.flops import flops_per_token
from moetrain.model.transformer import Transformer
from moetrain.optim.schedule import lr_at
from moetrain.parallel.data import all_reduce_stats
from moetrain.parallel.expert import read_dispatch_stats
from moetrain.parallel.mesh import ParallelDims
from moetrain.parallel.pipeline import Pipeline
from moetrain.train.bad_steps import BadSteps
from moetrain.train.routing_stats import StepLoadPeak, TokenGamingDetector, summarize_moe_stats
from moetrain.train.throughput import Throughput, peak_memory_gib

ROUTER_MEANS = ("lb_loss", "z_loss", "entropy")  # means over the dp ranks, like the loss


def collect_log_values(
    acc: dict[str, torch.Tensor],
    model: Transformer,
    moe_names: list[str],
    pipeline: Pipeline | None,
    dims: ParallelDims,
    load_peak: StepLoadPeak,
) -> tuple[dict[str, torch.Tensor], list[dict], dict[int, torch.Tensor]]:
    """(accumulator values, each MoE layer's statistics, receive-buffer rows used / allocated by
    layer index: NoSync's, this rank's value, without a pipeline). The accumulators are zeroed
    in place after the read: a captured step graph adds into these very tensors. Over several
    ranks the loss and the good-step count are means over dp, the router's losses and entropy
    too, the token and drop counts are sums, and the worst step's load (`load_peak`) a max."""
    values = {k: v.clone() for k, v in acc.items()}
    for v in acc.values():
        v.zero_()
    stats = [layer.read_stats() for layer in model.moe_layers()]
    for s, peak in zip(stats, load_peak.read(), strict=True):
        s["max_mean_peak"] = peak
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
        if stats and dims.dp_group is not None:
            peak_L = torch.stack([s["max_mean_peak"] for s in stats])
            dist.all_reduce(peak_L, op=dist.ReduceOp.MAX, group=dims.dp_group)
            for s, peak in zip(stats, peak_L, strict=True):
                s["max_mean_peak"] = peak
        values["loss"], values["good"] = scalars[0] / dims.dp, scalars[1] / dims.dp
        for s, row in zip(stats, means_L3 / dims.dp, strict=True):
            s.update(zip(ROUTER_MEANS, row, strict=True))
    return values, stats, utilization


class TrainRecords:
    """The `kind: train` records of a run (train/metrics_jsonl.py); `throughput` counts the
    tokens of each step. `note` prints a message for people (the console)."""

    def __init__(
        self,
        config: RunConfig,
        model: Transformer,
        pipeline: Pipeline | None,
        dims: ParallelDims,
        train_loader: Any,
        note: Callable[[str], None],
    ) -> None:
        self.config, self.model, self.pipeline, self.dims = config, model, pipeline, dims
        self.train_loader, self.note = train_loader, note
        moe_layers = set(model.moe_layers())
        self.moe_names = [n for n, m in model.named_modules() if m in moe_layers]
        self.throughput = Throughput(flops_per_token(config), dims.device)
        self.gaming = TokenGamingDetector()
        self.load_peak = StepLoadPeak(len(self.moe_names), dims.device)  # updated by each step
        self.labels = source_labels(config.data) if config.data.sources else None
        self.passes = train_loader.passes()  # completed passes over the data (per source)

    def record(
        self, step: int, sums: dict[str, torch.Tensor], bad_steps: BadSteps
    ) -> tuple[dict[str, float], dict[str, Any]]:
        """(`sums` read on the host, the train record) after `step`; `sums` (the step's device
        sums and `bad_steps.sums`) are zeroed, and the skips added to `bad_steps`' totals."""
        t = self.config.train
        values, stats, utilization = collect_log_values(
            sums, self.model, self.moe_names, self.pipeline, self.dims, self.load_peak
        )
        host = {k: v.item() for k, v in values.items()}
        good = max(host["good"], 1.0)
        record: dict[str, Any] = {
            "kind": "train",
            "step": step,
            "loss": host["loss"] / good if host["good"] else math.nan,
            "lr": lr_at(step - 1, t),
            "grad_norm": host["grad_norm"] / good if host["good"] else math.nan,
            **self.throughput.measure(),
            "peak_mem_gib": peak_memory_gib(self.dims.device),
            **bad_steps.tally(host),
            "time": time.time(),
            "moe": summarize_moe_stats(
                dict(enumerate(stats)),
                lb_weight=self.config.moe.lb_loss_weight,
                z_weight=self.config.moe.z_loss_weight,
            ),
        }
        for i, value in utilization.items():
            record["moe"][i]["buffer_utilization"] = float(value)
        loader = self.train_loader
        if isinstance(loader, MixedLoader):  # the counts are global, equal on all ranks
            counts = loader.tokens_per_source()
            record["tokens_per_source"] = dict(zip(self.labels, counts, strict=True))
        record.update(self._epochs(loader.passes(), step))
        for key in ("lb_loss", "z_loss"):
            layers = [layer[key] for layer in record["moe"]]
            record[key] = sum(layers) / len(layers) if layers else None
        for layer in record["moe"]:
            warning = self.gaming.update(step, layer["layer"], layer["lb_loss"], layer["max_mean"])
            if warning:
                self.note(f"warning: {warning}")
        return host, record

    def _epochs(self, passes: list[int], step: int) -> dict[str, Any]:
        """The record's "epoch" (a mix's "epoch_per_source"), and a note when a new pass over
        the data begins (the same sequences again)."""
        for i, (before, now) in enumerate(zip(self.passes, passes, strict=True)):
            if now > before:
                what = f"source {self.labels[i]}" if self.labels else "the training data"
                self.note(
                    f"note: {what} ran out by step {step}: epoch {now} began (the same "
                    "sequences again, reshuffled)"
                )
        self.passes = passes
        if not passes:  # random tokens
            return {}
        if self.labels:
            return {"epoch_per_source": dict(zip(self.labels, passes, strict=True))}
        return {"epoch": passes[0]}
