"""`moetrain bench --project`: an N-GPU layout's step on paper, from one rank's compute measured
on the local GPU and the communication of the layout from a link model.

What is measured (`measure_rank`): the model one rank runs, built and stepped by the Trainer as
`moetrain bench` does (compiled blocks, the step a CUDA graph where supported, uniform random
token ids, learned routing over all E experts): under expert parallelism the model with E / N
experts a layer, whose `BalancedDispatcher` hands them the T K rows uniform routing would send
the rank (bench/balanced.py); under FSDP2 the whole model. The step splits into forward + backward
and clip + optimizer by the eager phase events of the harness (`split_ms`), in proportion. A model
too large for the GPU is timed at 1 and 2 layers and extrapolated linearly to its depth (its
blocks are identical); `RankCompute.depths` says which. What the measurement lacks, the
communication and the layout's own state, comes from moetrain.plan.compare (its docstring
states the model and the overlap assumed).
"""

from __future__ import annotations

import dataclasses
import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moetrain.bench import harness
from moetrain.bench.balanced import BalancedDispatcher
from moetrain.config import RunConfig
from moetrain.dry_run import keep_local_experts
from moetrain.plan.compare import (
    LAYOUTS,
    Projection,
    RankCompute,
    eager_peak_bytes,
    extrapolate,
    local_experts,
    project,
)
from moetrain.plan.layout import GIB, GPUS
from moetrain.plan.links import Links

REFERENCE = {
    "ratio": "2.7x (47B MoE, 8 B300: 52,000 vs 19,400 tokens/s/GPU)",
    "scaling": "under 5% (8 -> 128 experts, top-4)",
}
FIT_SHARE = 0.75  # time the whole depth when the eager bound is below this share of the GPU


def rank_transform(num_local: int, payload: str = "bf16") -> Callable[[Any], None]:
    """The Trainer's `model_transform` that keeps experts [0, num_local) of every MoE layer and
    gives each layer a BalancedDispatcher: one expert-parallel rank's share, on one device."""

    def transform(model) -> None:
        for layer in model.moe_layers():
            if layer.experts.num_experts != num_local:
                keep_local_experts(layer.experts, range(num_local))
            layer.dispatcher = BalancedDispatcher(num_local, payload)

    return transform


def fresh_compile() -> None:
    """Forget what torch.compile traced for earlier models of this process: past its recompile
    limit dynamo would run a block eagerly, and after a shape change it would trace dynamic
    shapes; each model here is compiled as in a process of its own (Inductor's on-disk cache
    still serves graphs it has seen)."""
    torch._dynamo.reset()


def with_layers(config: RunConfig, num_layers: int) -> RunConfig:
    model = dataclasses.replace(config.model, num_layers=num_layers)
    return dataclasses.replace(config, model=model)


def choose_depths(config: RunConfig, num_local: int, device: torch.device) -> tuple[int, ...]:
    """The model's own depth where an eager upper bound of its peak fits FIT_SHARE of the GPU,
    else (1, 2)."""
    if device.type != "cuda":
        return (config.model.num_layers,)
    total = torch.cuda.get_device_properties(device).total_memory
    if eager_peak_bytes(config, num_local) < FIT_SHARE * total:
        return (config.model.num_layers,)
    return (1, 2)


def measure_rank(
    config: RunConfig,
    num_local: int,
    *,
    optimizer: str = "mixed",
    depths: tuple[int, ...] | None = None,
    steps: int = 5,
    warmup: int = 3,
    device: str | None = None,
    mm_tflops: float | None = None,
) -> tuple[RankCompute, list[harness.BenchResult]]:
    """Time the model one rank runs (`num_local` experts a MoE layer; all of them: the whole
    model) at each depth and extrapolate to the config's. Returns the extrapolation and the
    bench result of every depth."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    depths = depths or choose_depths(config, num_local, dev)
    partial = num_local < config.moe.num_experts
    results, fb, opt, peak = [], [], [], []
    for depth in depths:
        run = with_layers(config, depth)
        transform = rank_transform(num_local, config.precision.dispatch) if partial else None
        fresh_compile()
        r = harness.bench_moetrain(
            run,
            optimizer=optimizer,
            steps=steps,
            warmup=warmup,
            device=str(dev),
            mm_tflops=mm_tflops,
            model_transform=transform,
        )
        step_s = r.stats["median_ms"] / 1e3
        split = r.split_ms
        share = (
            split["forward_backward_ms"]
            / (split["forward_backward_ms"] + split["clip_and_optimizer_ms"])
            if split
            else 1.0
        )
        fb.append(step_s * share)
        opt.append(step_s * (1 - share))
        peak.append(r.peak_mem_gib * GIB)
        results.append(r)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    L = config.model.num_layers
    measured = RankCompute(
        forward_backward_s=extrapolate(depths, fb, L),
        optimizer_s=extrapolate(depths, opt, L),
        peak_bytes=extrapolate(depths, peak, L),
        depths=tuple(depths),
    )
    return measured, results


def link_models(gpus_per_node: int = 8, efficiency: float = 1.0) -> dict[str, Links]:
    """The datasheet links of the H200 and the B300 (plan.layout.GPUS), per direction."""
    return {
        name: Links(
            nvlink_gbps=GPUS[name].nvlink_gbps,
            internode_gbps=GPUS[name].internode_gbps,
            gpus_per_node=gpus_per_node,
            efficiency=efficiency,
        )
        for name in ("h200", "b300")
    }


def project_preset(
    config: RunConfig,
    layouts: tuple[str, ...],
    gpus: int,
    links: dict[str, Links],
    *,
    optimizer: str = "mixed",
    microbatches: int = 1,
    depths: tuple[int, ...] | None = None,
    **bench_kw: Any,
) -> tuple[list[tuple[str, Projection]], dict[str, Any]]:
    """Measure each distinct rank model of `layouts` once (ep-replicated and ep-sharded run the
    same model) and project every layout under every link model. Returns ((links name,
    projection) rows, the measurements for the record)."""
    measured: dict[int, RankCompute] = {}
    record: dict[str, Any] = {}
    rows = []
    for layout in layouts:
        num_local = local_experts(config, layout, gpus)
        if num_local not in measured:
            m, results = measure_rank(
                config, num_local, optimizer=optimizer, depths=depths, **bench_kw
            )
            measured[num_local] = m
            record[f"{config.name} {num_local} experts/layer"] = {
                "rank_compute": dataclasses.asdict(m),
                "runs": [dataclasses.asdict(r) for r in results],
            }
        for name, link in links.items():
            rows.append(
                (name, project(config, layout, gpus, measured[num_local], link, microbatches))
            )
    return rows, record


def markdown(rows: list[tuple[str, Projection]], memory_gib: dict[str, float]) -> str:
    """The projection table: one row per (config, layout, link model)."""
    head = [
        "preset",
        "layout",
        "GPUs",
        "links",
        "tok/s/GPU (overlap as built / none)",
        "TFLOP/s/GPU",
        "step ms = compute + exposed comm",
        "comm ms (all)",
        "peak GiB",
        "fits",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for link, p in rows:
        exposed = p.overlapped_s - p.compute_s
        fits = [gpu for gpu, gib in memory_gib.items() if p.peak_bytes <= gib * GIB]
        lines.append(
            "| "
            + " | ".join(
                [
                    p.config,
                    p.layout,
                    str(p.gpus),
                    link,
                    f"{p.tokens_per_s():,.0f} / {p.tokens_per_s(False):,.0f}",
                    f"{p.tflops():,.0f}",
                    f"{1e3 * p.overlapped_s:.1f} = {1e3 * p.compute_s:.1f} + {1e3 * exposed:.1f}",
                    f"{1e3 * p.comm_s:.1f}",
                    f"{p.peak_bytes / GIB:.1f}",
                    ", ".join(fits) or "no",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def ratios(rows: list[tuple[str, Projection]]) -> list[str]:
    """Resident experts against FSDP2 per preset and link model, and the expert-scaling drop
    of the scale-E series, next to the reference's figures."""
    out = []
    by = {(link, p.config, p.layout): p for link, p in rows}
    for (link, name, layout), p in by.items():
        fsdp = by.get((link, name, "fsdp2"))
        if layout.startswith("ep") and fsdp is not None:
            out.append(
                f"{name}, {link} links: {layout} / fsdp2 = "
                f"{p.tokens_per_s() / fsdp.tokens_per_s():.2f}x tokens/s overlapped "
                f"({p.tokens_per_s(False) / fsdp.tokens_per_s(False):.2f}x without overlap); "
                f"reference {REFERENCE['ratio']}"
            )
    for link in sorted({link for link, _ in rows}):
        e8 = by.get((link, "scale-E8", "ep-replicated"))
        e128 = by.get((link, "scale-E128", "ep-replicated"))
        if e8 and e128:
            drop = 100 * (e128.tokens_per_s() / e8.tokens_per_s() - 1)
            out.append(
                f"scale-E8 -> scale-E128 at ep {e8.gpus}, {link} links: {drop:+.1f}% tokens/s "
                f"per GPU (reference: {REFERENCE['scaling']})"
            )
    return out


def comm_breakdown(rows: list[tuple[str, Projection]]) -> list[str]:
    return [
        f"{p.config} {p.layout} ({link}): "
        + ", ".join(f"{c.name} {1e3 * c.seconds:.2f} ms (hidden by {c.hidden_by})" for c in p.comm)
        for link, p in rows
    ]


def run_projection(
    presets: list[RunConfig],
    *,
    gpus: int = 8,
    optimizer: str = "mixed",
    microbatches: int = 1,
    layouts: tuple[str, ...] = LAYOUTS,
    scale_layouts: tuple[str, ...] = ("ep-replicated",),
    out_dir: str | None = None,
    efficiency: float = 1.0,
    depths: tuple[int, ...] | None = None,
    print_fn: Callable[[str], None] = print,
    **bench_kw: Any,
) -> tuple[list[tuple[str, Projection]], dict[str, Any]]:
    """Project every preset (the scale-E series with `scale_layouts` only) and print the table
    as rows arrive; with `out_dir`, write projection.json and projection.md there after each
    preset, so an interrupted run keeps what it measured."""
    links = link_models(efficiency=efficiency)
    memory = {name: GPUS[name].memory_gb * 1e9 / GIB for name in links}
    rows: list[tuple[str, Projection]] = []
    record: dict[str, Any] = {"environment": harness.environment(), "measurements": {}}
    for config in presets:
        chosen = scale_layouts if config.name.startswith("scale-E") else layouts
        new, measured = project_preset(
            config,
            chosen,
            gpus,
            links,
            optimizer=optimizer,
            microbatches=microbatches,
            depths=depths,
            **bench_kw,
        )
        rows += new
        record["measurements"].update(measured)
        print_fn(markdown(new, memory))
        if out_dir is not None:
            write(out_dir, rows, record, memory)
    return rows, record


def write(out_dir: str, rows, record: dict[str, Any], memory: dict[str, float]) -> None:
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    payload = record | {
        "rows": [
            {"links": link}
            | dataclasses.asdict(p)
            | {
                "tokens_per_s_overlapped": p.tokens_per_s(),
                "tokens_per_s_no_overlap": p.tokens_per_s(False),
                "tflops_overlapped": p.tflops(),
                "peak_gib": p.peak_bytes / GIB,
            }
            for link, p in rows
        ]
    }
    (path / "projection.json").write_text(json.dumps(payload, indent=1, default=str))
    text = [markdown(rows, memory), "", *ratios(rows), "", *comm_breakdown(rows)]
    (path / "projection.md").write_text("\n".join(text) + "\n")
