"""A whole training step as one CUDA graph: capture it once, then replay it every step.

Why: nothing in moetrain's step waits for the host (no `.item()`, no data-dependent shapes or
branches), so the whole step (forward, backward, clip, optimizer, MoE bias update, metric sums) is
a fixed sequence of kernels. Replaying it as one graph removes the host's launch work, which on
small models is longer than the GPU's: the GPU no longer waits for Python to launch the next
kernel.

What changes between steps travels through memory the graph reads, never through launch
arguments: the micro-batches are copied into static input buffers and the learning rate into a
device scalar (the Triton AdamW reads it from there). The first `warmup` steps run eagerly, on a
side stream as torch.cuda.graph asks, so compilation, autotuning and the optimizer state happen
before capture; the step at which the graph is captured then runs as its first replay.

`StepGraph.unsupported_reason` says why a configuration cannot be graphed: random routing; fp32
expert GEMMs (torch's `_grouped_mm` runs fp32 on CUDA as a loop over the experts that reads the
offsets on the host); an optimizer other than the replicated AdamW with the Triton kernel;
several processes (see below).

Several processes (world size > 1): NCCL (>= 2.9.6) collectives can be captured, and the graph
then holds every collective of the step: the NoSync dispatcher's all-to-alls and counts
all-gather (functional collectives inside the compiled blocks, or eager ones), GradientSync's
bucket all-reduces (launched by gradient hooks, waited in `finish`: host logic that runs once,
at capture, and issues the same fixed sequence of collectives on every rank), the gradient
norm's and the statistics' all-reduces. torch's NCCL process group keeps work captured in a
graph away from its watchdog and waits for the watchdog's pending event queries before a capture
begins; the warm-up steps create the communicators, which cannot be created during capture.
What cannot be captured is refused by `multi_process_reason`: gloo (it stages CUDA tensors
through the host), the all_to_all dispatcher (it reads split sizes on the host), FSDP and the
pipeline schedules (host-side bookkeeping and point-to-point, not verified), and
TORCH_NCCL_BLOCKING_WAIT (its wait polls an event on the host). It is never on by default at
world size > 1: it has not run on several GPUs yet (README), so `train.cuda_graph=true` turns
it on, and a failed capture then raises on that rank (a rank that went on eagerly would issue
collectives that its peers replay inside a graph).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator

import torch

from moetrain.parallel.expert import resolve_dispatcher

Batch = tuple[torch.Tensor, torch.Tensor]
StepFn = Callable[[Iterator[Batch], torch.Tensor], torch.Tensor]


class StepGraph:
    def __init__(
        self,
        step_fn: StepFn,
        accum_steps: int,
        device: torch.device,
        *,
        strict: bool,
        warmup: int = 2,
    ) -> None:
        """strict: a failed capture raises; otherwise it warns and the run continues eagerly."""
        self.step_fn, self.accum_steps, self.device = step_fn, accum_steps, device
        self.strict, self.warmup, self.failed = strict, warmup, False
        self.lr = torch.zeros((), dtype=torch.float64, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_batches: list[Batch] = []
        self.static_loss: torch.Tensor | None = None
        self.eager_steps = 0

    @staticmethod
    def unsupported_reason(
        config, dims, device: torch.device, adamw_kernel: str, backend: str | None = None
    ) -> str | None:
        """Why this run cannot be graphed, or None. `backend`: the process group's (world > 1)."""
        if device.type != "cuda":
            return "it needs a CUDA device"
        if dims.world_size > 1:
            reason = multi_process_reason(config, dims, backend)
            if reason is not None:
                return reason
        if config.moe.routing != "learned":
            return "random routing reseeds its generator on the host at every draw"
        if config.precision.param_dtype == "fp32" and config.model.num_dense_layers < (
            config.model.num_layers
        ):
            return (
                "fp32 expert GEMMs (precision.param_dtype=fp32): torch._grouped_mm has a CUDA "
                "kernel for bf16 only and runs other dtypes as a loop over the experts that "
                "copies the offsets to the host, which a capture refuses"
            )
        if config.train.optimizer != "adamw" or adamw_kernel != "triton":
            return "it needs train.optimizer=adamw with the Triton kernel (a device learning rate)"
        return None

    def run(self, batches: Iterator[Batch], lr: float) -> torch.Tensor:
        """One step on the next `accum_steps` micro-batches; returns the loss (a device tensor
        that the next replay overwrites: clone it to keep it)."""
        micro = [next(batches) for _ in range(self.accum_steps)]
        self.lr.fill_(lr)
        if self.failed:
            return self.step_fn(iter(micro), self.lr)
        if self.graph is None and self.eager_steps < self.warmup:
            self.eager_steps += 1
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                loss = self.step_fn(iter(micro), self.lr)
            torch.cuda.current_stream(self.device).wait_stream(side)
            return loss
        if self.graph is None:
            try:
                self._capture(micro)
            except Exception as exc:
                if self.strict:
                    raise
                self.failed, self.static_batches = True, []
                warnings.warn(
                    f"capturing the training step as a CUDA graph failed ({exc!r}); continuing "
                    "without (set train.cuda_graph=false to skip the attempt)",
                    stacklevel=2,
                )
                return self.step_fn(iter(micro), self.lr)
        for static, batch in zip(self.static_batches, micro, strict=True):
            for dst, src in zip(static, batch, strict=True):
                dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return self.static_loss

    def _capture(self, micro: list[Batch]) -> None:
        self.static_batches = [tuple(t.clone() for t in batch) for batch in micro]
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # hand the eager warm-up's cached blocks back before the graph
        graph = torch.cuda.CUDAGraph()
        # thread_local: NCCL's watchdog thread may query events of work launched before the
        # capture; only this thread's calls are checked
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.static_loss = self.step_fn(iter(self.static_batches), self.lr)
        self.graph = graph


NCCL_CAPTURE_VERSION = (2, 9, 6)  # the first NCCL whose collectives a CUDA graph can capture


def multi_process_reason(config, dims, backend: str | None) -> str | None:
    """Why a multi-process step cannot be captured, or None (module docstring)."""
    if backend != "nccl":
        return (
            f"parallel.backend is {backend}: a CUDA graph captures NCCL collectives only (gloo "
            "stages CUDA tensors through the host); use nccl, one GPU per rank"
        )
    if config.parallel.pp > 1:
        return "the pipeline schedules (parallel.pp > 1) are not graphed"
    if config.parallel.data_parallel == "fsdp":
        return "FSDP (parallel.data_parallel=fsdp) is not graphed; use ddp"
    dispatcher = resolve_dispatcher(config, dims)
    if dispatcher == "all_to_all":
        return (
            f"moe.dispatcher ({config.moe.dispatcher}) is all_to_all, which reads its split sizes "
            "on the host in every MoE layer; use no_sync (capacity mode: moe.capacity_factor)"
        )
    if os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0") not in ("", "0"):
        return "TORCH_NCCL_BLOCKING_WAIT is set: its waits poll the GPU from the host"
    if torch.cuda.nccl.version() < NCCL_CAPTURE_VERSION:
        found = ".".join(map(str, torch.cuda.nccl.version()))
        return f"NCCL {found} cannot be captured (needs 2.9.6 or later)"
    return None
