"""A whole training step as one CUDA graph: capture it once, then replay it every step.

Why: nothing in moetrain's step waits for the host (no `.item()`, no data-dependent shapes or
branches), so the whole step (forward, backward, clip, optimizer, MoE bias update, metric sums) is
a fixed sequence of kernels. Replaying it as one graph removes the host's launch work, which on
small models is longer than the GPU's: on the H200 `small` went from 58.1 to 54.6 ms a step
(same job), the GPU no longer waiting for Python to launch the next kernel.

What changes between steps travels through memory the graph reads, never through launch
arguments: the micro-batches are copied into static input buffers and the learning rate into a
device scalar (the Triton AdamW reads it from there). The first `warmup` steps run eagerly, on a
side stream as torch.cuda.graph asks, so compilation, autotuning and the optimizer state happen
before capture; the step at which the graph is captured then runs as its first replay.

`StepGraph.unsupported_reason` says why a configuration cannot be graphed (one process only;
learned routing; BF16 expert GEMMs; the replicated AdamW with the Triton kernel).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import torch

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
    def unsupported_reason(config, dims, device: torch.device, adamw_kernel: str) -> str | None:
        """Why this run cannot be graphed, or None."""
        if device.type != "cuda":
            return "it needs a CUDA device"
        if dims.world_size > 1:
            return "multi-process runs are not graphed yet (collectives, gloo control group)"
        if config.moe.routing != "learned":
            return "random routing reseeds its generator on the host at every draw"
        if config.precision.experts != "bf16":
            return "the FP8 expert GEMMs keep a host-side cache of quantized weights"
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
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.static_loss = self.step_fn(iter(self.static_batches), self.lr)
        self.graph = graph
