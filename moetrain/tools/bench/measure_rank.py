"""`moetrain bench --project`: resident experts against FSDP2 on N GPUs, from one rank's compute
measured on the local GPU (docs/plan.md, "Compute") and the rest from the arithmetic of
moetrain.tools.plan.compare. Rows are projected on the measuring GPU and on B300s.
"""

from __future__ import annotations

import dataclasses
import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moetrain.config import RunConfig
from moetrain.tools.bench import dispatch_cost, harness
from moetrain.tools.bench.balanced import BalancedDispatcher
from moetrain.tools.bench.gpu_state import gpu_key
from moetrain.tools.dry_run import keep_local_experts
from moetrain.tools.plan import compare_report as report
from moetrain.tools.plan.compare import best, sweep
from moetrain.tools.plan.layout import GIB, GPUS, Cluster
from moetrain.tools.plan.memory import block_activation_bytes, precision_bytes
from moetrain.tools.plan.overlap import ASSUMED, Overlap
from moetrain.tools.plan.rank_compute import (
    FSDP,
    KINDS,
    RESIDENT,
    RankCompute,
    Setting,
    global_batch_tokens,
    rank_experts,
    rank_model_params,
)

FIT_SHARE = 0.75  # time the whole depth when the eager bound is below this share of the GPU
PHASE_KINDS = {"expert GEMMs": "experts", "dense GEMMs": "products", "attention": "products"}


def rank_transform(num_local: int) -> Callable[[Any], None]:
    """The Trainer's `model_transform` that keeps experts [0, num_local) of every MoE layer and
    gives each layer a BalancedDispatcher: one expert-parallel rank's share, on one device. It
    wraps the layer's local dispatcher, as the precision plan set it up (payload, FP8 rows)."""

    def transform(model) -> None:
        for layer in model.moe_layers():
            if layer.experts.num_experts != num_local:
                keep_local_experts(layer.experts, range(num_local))
            layer.dispatcher = BalancedDispatcher(num_local, layer.dispatcher)

    return transform


def fresh_compile() -> None:
    """Forget what torch.compile traced for earlier models of this process (past its recompile
    limit dynamo would run blocks eagerly, and after a shape change trace dynamic shapes)."""
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
    results, fb, opt, peak, kinds = [], [], [], [], []
    for depth in depths:
        transform = rank_transform(num_local) if partial else None
        fresh_compile()
        r = harness.bench_moetrain(
            with_layers(config, depth),
            optimizer=optimizer,
            steps=steps,
            warmup=warmup,
            device=str(dev),
            mm_tflops=mm_tflops,
            profile=dev.type == "cuda",
            model_transform=transform,
        )
        split = r.split_ms
        step_s = r.stats["median_ms"] / 1e3
        share = split["forward_backward_ms"] / sum(split.values()) if split else 1.0
        fb.append(step_s * share)
        opt.append(step_s * (1 - share))
        peak.append(r.peak_mem_gib * GIB)
        kinds.append(kind_ms(r))
        results.append(r)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    L = config.model.num_layers
    per_kind = {k: max(0.0, extrapolate(depths, [x[k] for x in kinds], L)) for k in KINDS}
    total = sum(per_kind.values())
    measured = RankCompute(
        forward_backward_s=extrapolate(depths, fb, L),
        optimizer_s=extrapolate(depths, opt, L),
        peak_bytes=extrapolate(depths, peak, L),
        depths=tuple(depths),
        shares={k: v / total for k, v in per_kind.items()} if total else {},
        tokens=config.train.micro_batch_size * config.train.seq_len,
        gpu=gpu_key(dev) if dev.type == "cuda" else "h200",  # h200: the CPU's smoke runs
    )
    return measured, results


def kind_ms(result: harness.BenchResult) -> dict[str, float]:
    """A profiled step's forward + backward GPU time by kind: the products (experts' and the
    others'), the rest of the kernels but the optimizer's (memory-bound), and the GPU's idle
    time; zeros without a profile."""
    out = dict.fromkeys(KINDS, 0.0)
    for phase, ms in result.phases_ms.items():
        if phase == "optimizer":
            continue
        out[next((k for p, k in PHASE_KINDS.items() if phase.startswith(p)), "memory")] += ms
    if result.phases_ms:
        out["idle"] = max(0.0, result.profile["step_ms"] - sum(result.phases_ms.values()))
    return out


def extrapolate(depths: tuple[int, ...], values: list[float], num_layers: int) -> float:
    """The value at `num_layers` of a quantity linear in the layer count (blocks are identical),
    from its values at one depth (which must be `num_layers`) or at two."""
    if len(depths) != len(values) or not 1 <= len(depths) <= 2:
        raise ValueError(f"need one or two depths with a value each, got {depths} / {values}")
    if len(depths) == 1:
        if depths[0] != num_layers:
            raise ValueError(f"one depth ({depths[0]}) must be the model's ({num_layers})")
        return values[0]
    (l1, l2), (v1, v2) = depths, values
    if l1 == l2:
        raise ValueError(f"the two depths must differ, got {depths}")
    return v1 + (v2 - v1) / (l2 - l1) * (num_layers - l1)


def eager_peak_bytes(config: RunConfig, num_local: int) -> float:
    """An upper bound of the timed model's peak (one process, replicated AdamW): its state plus
    what eager autograd saves in every block, for choosing the depths to time."""
    b = precision_bytes(config)
    T = config.train.micro_batch_size * config.train.seq_len
    saved = sum(block_activation_bytes(config, T, moe=True, ep=1))
    per_param = 2 * b.param + b.master + b.moments  # autograd's gradients: the parameters' dtype
    return per_param * sum(rank_model_params(config, num_local)) + config.model.num_layers * saved


def measure_preset(
    config: RunConfig,
    gpus: int,
    *,
    fsdp: bool = True,
    optimizer: str = "mixed",
    print_fn: Callable[[str], None] = print,
    **bench_kw: Any,
) -> tuple[dict[str, RankCompute], dict[str, Any]]:
    """The dispatcher's costs at the rank's shapes, the resident rank's and (with `fsdp`) the
    whole model's compute, each printed as it is measured. Returns ({"resident", "fsdp"}:
    RankCompute, the record)."""
    device = torch.device(bench_kw.get("device") or "cuda")
    local, no_sync = dispatch_cost.index_work_s(config, gpus, 1.25, device)
    costs = {"balanced_s": local, "no_sync_s": no_sync, "compiled": device.type == "cuda"}
    record = {"dispatcher": costs | {"host_sync_s": dispatch_cost.host_sync_s(config, device)}}
    print_fn(f"{config.name} dispatcher at ep {gpus}: {record['dispatcher']}")
    measured = {}
    kinds = {"resident": False, "fsdp": True} if fsdp else {"resident": False}
    for key, whole in kinds.items():
        num_local = rank_experts(config, gpus, whole)
        m, results = measure_rank(config, num_local, optimizer=optimizer, **bench_kw)
        measured[key] = m
        record[f"{config.name} {num_local} experts/layer"] = {
            "rank_compute": dataclasses.asdict(m),
            "runs": [dataclasses.asdict(r) for r in results],
        }
        print_fn(f"{config.name} {key} rank ({num_local} experts a layer): {m}")
    return measured, record


def settings(
    config: RunConfig,
    measured: dict[str, RankCompute],
    record: dict[str, Any],
    gpus: int,
    efficiency: float,
    **kw: Any,
) -> dict[str, Setting]:
    """The rows' settings: N of the measuring GPU and N B300s, links at `efficiency`; `kw`:
    the other fields of Setting."""
    costs = record["dispatcher"]
    index = max(0.0, costs["no_sync_s"] - costs["balanced_s"])
    out = {}
    for gpu in dict.fromkeys((measured["resident"].gpu, "b300")):
        cluster = Cluster(gpu=GPUS[gpu], num_gpus=gpus, link_efficiency=efficiency)
        out[gpu] = Setting(
            cluster=cluster,
            global_batch_tokens=global_batch_tokens(config),
            measured=measured,
            index_work_s=index,
            host_sync_s=costs["host_sync_s"],
            **kw,
        )
    return out


def run_projection(
    presets: list[RunConfig],
    *,
    gpus: int = 8,
    optimizer: str = "mixed",
    out_dir: str | None = None,
    efficiency: float = 0.8,
    overlap: Overlap | None = None,
    expert_load: float = 1.25,
    load_source: str = "stated capacity factor (--expert-load)",
    compute_scale: float | None = None,
    print_fn: Callable[[str], None] = print,
    **bench_kw: Any,
) -> dict[str, Any]:
    """Measure and project every preset (the scale-E series with resident experts only), print
    the tables as they arrive; with `out_dir`, write projection.json and projection.md there
    after each preset, so an interrupted run keeps what it measured."""
    record: dict[str, Any] = {"environment": harness.environment(), "presets": {}}
    text: list[str] = []

    def say(line: str) -> None:
        print_fn(line)
        text.append(line)

    extra = {"expert_load": expert_load, "load_source": load_source}
    extra |= {"compute_scale": compute_scale, "overlap": overlap or ASSUMED}
    for config in presets:
        scale_series = config.name.startswith("scale-E")
        measured, rec = measure_preset(
            config, gpus, fsdp=not scale_series, optimizer=optimizer, print_fn=say, **bench_kw
        )
        entry = record["presets"][config.name] = {"measurements": rec, "rows": {}}
        variants = RESIDENT[:1] if scale_series else (*RESIDENT, *FSDP)
        for gpu, setting in settings(config, measured, rec, gpus, efficiency, **extra).items():
            rows = sweep(config, setting, variants, pp=1, ep=gpus)
            chosen = best(rows)
            say(f"\n{config.name} on {gpus} x {gpu}:")
            table = report.markdown(list(chosen.values()))
            for line in [*report.assumptions(config, setting), table, *report.answer(chosen)]:
                say(line)
            entry["rows"][gpu] = report.to_json(config, setting, rows)
            if gpu == "b300" and not scale_series:
                lines, _ = report.reference(config, setting)
                for line in [*lines, "compute scale sweep (8 B300 links):"]:
                    say(line)
                for line in report.scale_sweep(config, setting):
                    say(line)
        if out_dir is not None:
            path = Path(out_dir)
            path.mkdir(parents=True, exist_ok=True)
            (path / "projection.json").write_text(json.dumps(record, indent=1, default=str))
            (path / "projection.md").write_text("\n".join(text) + "\n")
    for line in expert_scaling(record):
        say(line)
    return record


def expert_scaling(record: dict[str, Any]) -> list[str]:
    """scale-E8 -> scale-E128 at ep N, tokens/s per GPU (the reference: under 5% loss)."""
    out = []
    presets = record["presets"]
    if "scale-E8" in presets and "scale-E128" in presets:
        for gpu, rows in presets["scale-E8"]["rows"].items():
            e8 = rows["best"]["resident"]["tokens_per_s_per_gpu"]
            e128 = presets["scale-E128"]["rows"][gpu]["best"]["resident"]["tokens_per_s_per_gpu"]
            out.append(
                f"scale-E8 -> scale-E128, {gpu}: {100 * (e128 / e8 - 1):+.1f}% tokens/s per GPU "
                "(the reference: under 5% loss, 8 -> 128 experts at top-4)"
            )
    return out
