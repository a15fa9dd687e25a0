"""`moetrain bench`: time full training steps, exactly as `moetrain train` builds and runs them.

The model, optimizer and step are the Trainer's own (`Trainer.train_step`), fed uniform random
token ids. Reported per system: step time (median and spread), tokens/s per GPU, model TFLOP/s
(model/flops.py, the same count for every system), MFU against the datasheet peak and the matmul
rate measured in the same process, peak allocated memory, and the forward+backward vs optimizer
split.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib
import json
import platform
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median_high
from typing import Any

import torch

from moetrain.config import RunConfig
from moetrain.model.flops import flops_per_token, param_counts
from moetrain.tools.bench.gpu_state import GpuStateSampler, nvml_reader
from moetrain.tools.bench.timing import summarize, time_steps
from moetrain.train.throughput import peak_memory_gib, peak_tflops


@dataclass
class BenchResult:
    system: str
    preset: str
    routing: str
    optimizer: str
    tokens_per_step: int
    times_ms: list[float]
    stats: dict[str, float]
    tokens_per_s: float
    tflops: float
    mfu_datasheet: float | None
    mfu_measured: float | None
    peak_mem_gib: float
    mfu_sustained: float | None = None  # against the matmul sustained at the power limit
    split_ms: dict[str, float] = field(default_factory=dict)
    phases_ms: dict[str, float] = field(default_factory=dict)
    profile: dict[str, Any] = field(default_factory=dict)  # step_ms under the profiler, top kernels
    cuda_graph: bool = False  # the timed steps were replays of a captured CUDA graph
    gpu_state: dict[str, Any] | None = None  # SM clock and power during the timed steps (NVML)

    def row(self) -> list[str]:
        mfus = (self.mfu_datasheet, self.mfu_measured, self.mfu_sustained)
        return [
            self.system,
            self.preset,
            self.routing,
            self.optimizer,
            f"{self.tokens_per_s:,.0f}",
            f"{self.tflops:.0f}",
            *("-" if mfu is None else f"{100 * mfu:.1f}%" for mfu in mfus),
            f"{self.stats['median_ms']:.1f} ({self.stats['p10_ms']:.1f}-{self.stats['p90_ms']:.1f})",
            f"{self.peak_mem_gib:.1f}",
        ]


HEADER = [
    "system",
    "preset",
    "routing",
    "optimizer",
    "tokens/s/GPU",
    "TFLOP/s",
    "MFU (datasheet)",
    "MFU (measured mm)",
    "MFU (sustained mm)",
    "step ms median (p10-p90)",
    "peak GiB",
]


def _result(
    system: str,
    config: RunConfig,
    routing: str,
    optimizer: str,
    times: list[float],
    device: torch.device,
    mm_tflops: float | None,
) -> BenchResult:
    t = config.train
    tokens = t.micro_batch_size * t.seq_len * config.grad_accum_steps(1)
    stats = summarize(times)
    tokens_per_s = tokens / (stats["median_ms"] / 1e3)
    tflops = tokens_per_s * flops_per_token(config) / 1e12
    peak = peak_tflops(device)
    return BenchResult(
        system=system,
        preset=config.name,
        routing=routing,
        optimizer=optimizer,
        tokens_per_step=tokens,
        times_ms=times,
        stats=stats,
        tokens_per_s=tokens_per_s,
        tflops=tflops,
        mfu_datasheet=tflops / peak if peak else None,
        mfu_measured=tflops / mm_tflops if mm_tflops else None,
        peak_mem_gib=peak_memory_gib(device),
    )


def bench_config(
    config: RunConfig, routing: str, optimizer: str, micro_batches: int = 1
) -> RunConfig:
    """The benchmark variant of a run config: random token ids, `micro_batches` micro-batches
    per step (1, the peers' comparison, unless a gradient accumulation is what is measured),
    `routing` learned, random or a routes file to replay."""
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
    t = config.train
    batch = micro_batches * t.micro_batch_size * t.seq_len if micro_batches > 1 else None
    replay = routing not in ("learned", "random")  # a routes file (moe.replay_routes)
    overrides = [
        "data.random_tokens=true",
        "moe.routing=learned" if replay else f"moe.routing={routing}",
        *([f"moe.replay_routes={routing}"] if replay else []),
        "train.eval_every=0",
        f"train.global_batch_tokens={'null' if batch is None else batch}",
        "train.log_every=1000000",
    ]
    if optimizer == "bf16-adamw":  # the peers' setting: bf16 params and states, no fp32 master
        overrides += ["precision.param_dtype=bf16", "precision.master_weights=false"]
    return config.with_overrides(overrides)


def timed_steps(
    step, warmup: int, steps: int, device: torch.device
) -> tuple[list[float], dict[str, Any] | None]:
    """(ms per timed step, the GPU's clock and power over the timed steps): `warmup` untimed
    steps first (compilation, graph capture), which the GPU-state sampler does not see."""
    time_steps(step, warmup, 0, device)
    with GpuStateSampler(nvml_reader(device)) as gpu:
        times = time_steps(step, 0, steps, device)
    return times, gpu.summary()


@contextlib.contextmanager
def warmed_trainer(
    config: RunConfig,
    optimizer: str,
    warmup: int = 3,
    routing: str = "learned",
    device: str = "cuda",
    micro_batches: int = 1,
) -> Iterator[tuple[Any, Iterator]]:
    """(trainer, its batch iterator) as `moetrain bench` builds them, in a temporary run
    directory, after `warmup` steps (3: a step graph is captured by then), for the benchmark
    scripts that look inside a step."""
    from moetrain.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(
            bench_config(config, routing, optimizer, micro_batches),
            run_dir,
            device=device,
            progress=False,
        )
        it = iter(trainer.train_loader)
        for _ in range(warmup):
            trainer.train_step(it)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)
        yield trainer, it


def bench_moetrain(
    config: RunConfig,
    *,
    routing: str = "learned",
    optimizer: str = "mixed",
    steps: int = 6,
    warmup: int = 3,
    device: str | None = None,
    mm_tflops: float | None = None,
    profile: bool = False,
    micro_batches: int = 1,
    model_transform=None,
) -> BenchResult:
    """`model_transform`: the Trainer's (a change to the meta model, e.g. one rank's share)."""
    from moetrain.train.trainer import Trainer

    config = bench_config(config, routing, optimizer, micro_batches)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(
            config, run_dir, device=device, progress=False, model_transform=model_transform
        )
        dev = trainer.device
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        it = iter(trainer.train_loader)
        times, gpu_state = timed_steps(lambda: trainer.train_step(it), warmup, steps, dev)
        result = _result("moetrain", config, routing, optimizer, times, dev, mm_tflops)
        result.gpu_state = gpu_state
        graph = trainer.step_graph
        result.cuda_graph = graph is not None and graph.graph is not None
        result.split_ms = split_step(trainer, it, dev)
        if profile and dev.type == "cuda":
            from moetrain.tools.bench.phases import profile_phases

            prof = profile_phases(lambda: trainer.train_step(it), top=100)
            result.phases_ms = prof.pop("phases")
            result.profile = prof
        trainer.metrics.close()
        release(trainer)
    return result


def release(trainer) -> None:
    """Free a benchmarked trainer's GPU memory (its CUDA graph's private pool included) before
    the next system is measured: the trainer lets go of everything it holds (its parts hold
    the model and the optimizer too)."""
    graph = trainer.step_graph.graph if trainer.step_graph is not None else None
    if graph is not None:
        graph.reset()
    vars(trainer).clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def split_step(trainer, it, device: torch.device, repeats: int = 3) -> dict[str, float]:
    """Forward+backward vs gradient clip + optimizer, in ms (median over `repeats` steps). The
    phase events need the eager step, so a graphed trainer runs these steps eagerly."""
    if device.type != "cuda":
        return {}
    fb, opt = [], []
    for _ in range(repeats):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        trainer.phase_events = events
        trainer.train_step(it)
        events[-1].synchronize()
        fb.append(events[0].elapsed_time(events[1]))
        opt.append(events[1].elapsed_time(events[2]))
    trainer.phase_events = None
    return {"forward_backward_ms": median_high(fb), "clip_and_optimizer_ms": median_high(opt)}


def bench_hf(
    config: RunConfig,
    *,
    steps: int = 6,
    warmup: int = 3,
    device: str | None = None,
    mm_tflops: float | None = None,
    compile_model: bool = False,
) -> BenchResult:
    from moetrain.tools.bench.peers import build_hf_olmoe

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    step, model = build_hf_olmoe(config, dev, compile_model=compile_model)
    times, gpu_state = timed_steps(step, warmup, steps, dev)
    name = "hf-olmoe" + ("-compiled" if compile_model else "")
    result = _result(name, config, "learned", "bf16-adamw", times, dev, mm_tflops)
    result.gpu_state = gpu_state
    del model, step
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return result


def optimizer_floor_ms(config: RunConfig, optimizer: str, bandwidth_tb_s: float = 4.2) -> float:
    """Memory-traffic floor of the optimizer step: bytes read+written per parameter over the
    measured copy bandwidth. mixed: bf16 grad read, fp32 grad write+read, fp32 master, m, v
    read+write, bf16 param write (2+4+4+24+2 = 36 B); bf16-adamw: param, grad, m, v in bf16
    (8 read + 6 written = 14 B)."""
    per_param = 36 if optimizer == "mixed" else 14
    return param_counts(config).total * per_param / (bandwidth_tb_s * 1e12) * 1e3


def environment() -> dict[str, Any]:
    info = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    for name in ("triton", "transformers"):
        with contextlib.suppress(ImportError):
            info[name] = importlib.import_module(name).__version__
    return info


def markdown_table(results: list[BenchResult]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r.row()) + " |" for r in results]
    return "\n".join(lines)


def write_outputs(
    results: list[BenchResult],
    command: str,
    json_path: str | None,
    results_md: str | None,
    extra: dict[str, Any] | None = None,
) -> None:
    env = environment()
    payload = {
        "environment": env,
        "command": command,
        "extra": extra or {},
        "results": [asdict(r) for r in results],
    }
    if json_path:
        Path(json_path).write_text(json.dumps(payload, indent=1))
    if results_md:
        block = [
            f"\n### {env['date']} · {env.get('gpu', 'cpu')} · torch {env['torch']}"
            f"{' · transformers ' + env['transformers'] if 'transformers' in env else ''}",
            f"\n`{command}`\n",
            markdown_table(results),
        ]
        for key, value in (extra or {}).items():
            block.append(f"\n{key}: {value}")
        with open(results_md, "a") as f:
            f.write("\n".join(block) + "\n")
