"""A whole training step as one CUDA graph: capture it once, then replay it every step
(docs/design.md "The whole step is one CUDA graph where it can be").

Nothing in the step waits for the host, so it is a fixed kernel sequence; what changes between
steps travels through memory the graph reads (the micro-batches copied into static buffers, the
learning rate into a device scalar). The first `warmup` steps run eagerly on a side stream
(compilation, autotuning and optimizer state happen before capture). `unsupported_reason` and
`multi_process_reason` name what cannot be graphed; `build_step_graph` applies
`train.cuda_graph`. Several processes are graphed only with `train.cuda_graph=true`, and a
failed capture then raises on that rank: one that went on eagerly would issue collectives its
peers replay inside a graph.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from moetrain.config import RunConfig
from moetrain.parallel.expert import resolve_dispatcher
from moetrain.parallel.mesh import ParallelDims
from moetrain.parallel.precision import cuda_graph_blocker

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
        if config.moe.replay_routes is not None:
            return "replayed routing picks each forward's recorded routes on the host"
        reason = cuda_graph_blocker(config)  # the precision's (fp32 expert GEMMs)
        if reason is not None:
            return reason
        if config.train.optimizer not in ("adamw", "muon") or adamw_kernel != "triton":
            return (
                "it needs train.optimizer adamw or muon with the Triton kernel of AdamW (a device "
                "learning rate)"
            )
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


def build_step_graph(
    step_fn: StepFn, config: RunConfig, dims: ParallelDims, adamw_kernel: str
) -> StepGraph | None:
    """The step graph `train.cuda_graph` asks for: None graphs one process where supported;
    several processes only when set to true (NCCL capture has not run on several GPUs yet);
    true on a run that cannot be graphed is an error naming why."""
    choice = config.train.cuda_graph
    multi = dims.world_size > 1
    if choice is False or (choice is None and multi):
        return None
    backend = dist.get_backend() if multi else None
    reason = StepGraph.unsupported_reason(config, dims, dims.device, adamw_kernel, backend)
    if choice is None and reason is not None:
        return None
    if reason is not None:
        raise ValueError(f"train.cuda_graph (true): cannot graph this run: {reason}")
    accum_steps = config.grad_accum_steps(dims.dp)
    return StepGraph(step_fn, accum_steps, dims.device, strict=choice is True)


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
