"""`moetrain bench --calibrate`: measure on the local GPU the rates `moetrain plan` uses, at
each config's own shapes (docs/plan.md, "Calibration from measured kernels"), write the
calibration file, and check the planner's step time and peak memory against `moetrain bench`
on the same presets.
"""

from __future__ import annotations

import dataclasses
import datetime

import torch
import torch.nn.functional as F

from moetrain.config import RunConfig
from moetrain.model.flops import flops_per_token
from moetrain.tools.bench.gpu_state import gpu_key
from moetrain.tools.bench.measure_rank import fresh_compile
from moetrain.tools.bench.timing import kernel_ms, matmul_tflops, sustained_matmul
from moetrain.tools.plan import calibration as cal
from moetrain.tools.plan.layout import GIB, GPUS, Cluster, Layout
from moetrain.tools.plan.memory import LOSS_CHUNK_TOKENS, block_activation_bytes
from moetrain.tools.plan.search import estimate


def dense_tflops(config: RunConfig, device: torch.device) -> float:
    """Forward, input- and weight-gradient products of the dense layers, FLOP-weighted."""
    m, T = config.model, config.train.micro_batch_size * config.train.seq_len
    H = m.dim_per_head
    q, kv = m.num_heads * H, m.kv_heads * H
    chunk = min(T, LOSS_CHUNK_TOKENS)
    shapes = [  # (rows, in, out, repeats per step)
        (T, m.d_model, q + 2 * kv, 1),
        (T, q, m.d_model, 1),
        (T, m.d_model, config.moe.num_experts, 1),
        (chunk, m.d_model, m.vocab_size, T / chunk),
    ]
    flops = seconds = 0.0
    for rows, k, n, repeats in shapes:
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        dy = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
        fns = [lambda x=x, w=w: x @ w, lambda dy=dy, w=w: dy @ w.T, lambda x=x, dy=dy: x.T @ dy]
        ms = sum(kernel_ms(fn) for fn in fns)
        flops += repeats * 6 * rows * k * n
        seconds += repeats * ms * 1e-3
    return flops / seconds / 1e12


def grouped_tflops(config: RunConfig, device: torch.device) -> float:
    """The experts' six grouped products on T K rows in E equal groups."""
    moe, D = config.moe, config.model.d_model
    E, Fh = moe.num_experts, moe.expert_hidden
    rows = config.train.micro_batch_size * config.train.seq_len * moe.top_k
    offsets = torch.arange(1, E + 1, device=device, dtype=torch.int32) * (rows // E)
    rows = rows // E * E
    total = 0.0
    for k, n in ((D, 2 * Fh), (Fh, D)):
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(E, k, n, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(rows, n, device=device, dtype=torch.bfloat16)

        def step(x=x, w=w, dy=dy) -> None:  # forward, input and weight gradients
            torch._grouped_mm(x, w, offs=offsets).backward(dy)

        def clear(x=x, w=w) -> None:
            x.grad = w.grad = None

        total += kernel_ms(step, prep=clear)
    return 6 * rows * 3 * D * Fh / (total * 1e-3) / 1e12


def attention_tflops(config: RunConfig, device: torch.device) -> float:
    """Causal SDPA forward + backward, in model FLOPs (6 D S a token) per second."""
    from moetrain.nn.attention import _BACKENDS

    m, t = config.model, config.train
    B, S, H = t.micro_batch_size, t.seq_len, m.dim_per_head
    backend = "cudnn" if m.attention_backend == "auto" else m.attention_backend
    q = torch.randn(B, m.num_heads, S, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, m.kv_heads, S, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    grad = torch.randn_like(q)

    def clear() -> None:
        q.grad = k.grad = v.grad = None

    def step() -> None:
        with torch.nn.attention.sdpa_kernel(_BACKENDS[backend], set_priority=True):
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=m.kv_heads != m.num_heads
            )
        out.backward(grad)

    return 6 * m.d_model * S * B * S / (kernel_ms(step, prep=clear) * 1e-3) / 1e12


def activation_factor(config: RunConfig, device: torch.device) -> float:
    """Bytes a compiled block keeps for backward over plan.memory's count of them."""
    from moetrain.model.transformer import Transformer
    from moetrain.tools.bench.measure_rank import with_layers

    one = with_layers(config, 1)
    with torch.device("meta"):
        model = Transformer(one)
    model.to_empty(device=device)
    model.init_weights(0)
    for param in model.parameters():  # as the trainer casts: parameters only, not the buffers
        param.data = param.data.to(torch.bfloat16)
    fresh_compile()
    block = model.blocks["0"]
    block.compile()
    t = config.train
    x = torch.randn(
        t.micro_batch_size, t.seq_len, config.model.d_model, device=device, dtype=torch.bfloat16
    ).requires_grad_()
    block(x).sum().backward()  # compile forward and backward
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    y = block(x)
    torch.cuda.synchronize(device)
    # the block's output is the next block's to count; its input, which attn_norm keeps, is
    # this block's (plan.memory counts it there) though it was allocated before the forward
    kept = torch.cuda.memory_allocated(device) - before - y.numel() * y.element_size()
    kept += x.numel() * x.element_size()
    del y, model, block
    counted = sum(block_activation_bytes(one, t.micro_batch_size * t.seq_len, moe=True))
    return kept / counted


def copy_tbps(device: torch.device, nbytes: int = 2 * GIB) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (kernel_ms(lambda: dst.copy_(src)) * 1e-3) / 1e12


def calibrate(configs: list[RunConfig], device: torch.device) -> cal.Calibration:
    """Measure everything the calibration file holds, for `configs`."""
    sustained = sustained_matmul(device)
    shapes = {}
    for config in configs:
        shapes[config.name] = cal.ShapeRates(
            dense_tflops=dense_tflops(config, device),
            grouped_tflops=grouped_tflops(config, device),
            attention_tflops=attention_tflops(config, device),
            activation_factor=activation_factor(config, device),
        )
        torch.cuda.empty_cache()
    return cal.Calibration(
        gpu=gpu_key(device),
        device_name=torch.cuda.get_device_name(device),
        date=datetime.date.today().isoformat(),
        matmul_tflops=matmul_tflops(device),
        sustained_tflops=sustained["tflops_second_half"] if sustained else None,
        hbm_tbps=copy_tbps(device),
        shapes=shapes,
    )


@dataclasses.dataclass(frozen=True)
class Check:
    """The calibrated planner against a measured `moetrain bench` run of one preset."""

    preset: str
    predicted_ms: float
    measured_ms: float
    predicted_gib: float  # the plan's peak less its overhead: what max_memory_allocated sees
    measured_gib: float
    floor_ms: float  # model FLOPs at the sustained matmul rate + the optimizer's traffic floor

    def row(self) -> str:
        if not self.measured_gib:  # off CUDA nothing is allocated on a device
            return f"| {self.preset} | {self.predicted_ms:.1f} | {self.measured_ms:.1f} | (CPU) |"
        time_error = self.predicted_ms / self.measured_ms - 1
        memory_error = self.predicted_gib / self.measured_gib - 1
        return (
            f"| {self.preset} | {self.predicted_ms:.1f} | {self.measured_ms:.1f} | "
            f"{100 * time_error:+.1f}% | {self.predicted_gib:.1f} | {self.measured_gib:.1f} | "
            f"{100 * memory_error:+.1f}% | {self.floor_ms:.1f} | "
            f"{self.measured_ms / self.floor_ms:.2f}x |"
        )


CHECK_HEADER = (
    "| preset | predicted step ms | measured | error | predicted GiB (allocated) | measured | "
    "error | floor ms at the sustained rate | step / floor |\n|---|---|---|---|---|---|---|---|---|"
)


CHECK_OPTIMIZER = "mixed"  # bf16 parameters, fp32 master weights and moments


def check(config: RunConfig, calibration: cal.Calibration, **bench_kw) -> Check:
    """Plan `config` on one GPU with `calibration` and measure it with `moetrain bench`
    (`bench_kw`: steps, warmup, device) in mixed precision: memory with ShardedAdamW (what the
    planner's memory model holds), time with the replicated AdamW, whose CUDA-graphed step
    matches the time model's lack of a host launch term."""
    from moetrain.tools.bench import harness

    optimizer = CHECK_OPTIMIZER
    config = config.with_overrides(["train.optimizer=sharded"])
    run = harness.bench_config(config, "learned", optimizer)
    cluster = cal.calibrated_cluster(
        Cluster(gpu=GPUS[calibration.gpu], num_gpus=1), calibration, config.name
    )
    layout = Layout(pp=1, dp=1, ep=1, micro_batch_size=run.train.micro_batch_size)
    tokens = run.train.micro_batch_size * run.train.seq_len
    e = estimate(run, cluster, layout, tokens)
    fresh_compile()
    sharded = harness.bench_moetrain(config, optimizer=optimizer, **bench_kw)
    fresh_compile()
    replicated = harness.bench_moetrain(
        config.with_overrides(["train.optimizer=adamw"]), optimizer=optimizer, **bench_kw
    )
    rate = (calibration.sustained_tflops or calibration.matmul_tflops) * 1e12
    floor = tokens * flops_per_token(run) / rate * 1e3
    floor += harness.optimizer_floor_ms(run, optimizer, calibration.hbm_tbps)
    return Check(
        preset=config.name,
        predicted_ms=e.step_s * 1e3,
        measured_ms=replicated.stats["median_ms"],
        predicted_gib=(e.peak_memory - cluster.overhead_gib * GIB) / GIB,
        measured_gib=sharded.peak_mem_gib,
        floor_ms=floor,
    )


def sustained_line(result: dict, short: float | None) -> str:
    from moetrain.tools.bench.gpu_state import describe

    ratio = f" ({result['tflops_second_half'] / short:.0%} of the short one)" if short else ""
    return (
        f"{result['tflops']:.0f} TFLOP/s over {result['seconds']:.1f} s, "
        f"{result['tflops_second_half']:.0f} in its second half{ratio}; "
        + describe(result["gpu_state"])
    )
