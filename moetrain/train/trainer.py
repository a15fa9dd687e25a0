"""The training loop and the step.

One step (`_device_step`): forward/backward (train/step.py) -> gradient sync -> global-norm clip
-> optimizer step, skipped on the device for a non-finite loss or gradient or a loss spike
(train/bad_steps.py) -> MoE end-of-step; metrics stay on the device until the log cadence. The
loop runs steps and, at their cadences, writes a train record (train/train_record.py) to the
metrics hub (train/metrics.py), evaluates (train/evaluate.py) and saves a checkpoint
(train/checkpointing.py). SIGTERM / Ctrl-C finish the step, save and return
(train/stopping.py); `train.max_bad_steps` consecutive skipped steps save and stop with an
error. The run directory is claimed and locked for the run (train/run_dir.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moetrain import faults
from moetrain.config import RunConfig
from moetrain.data import resolve_data_paths, resolve_eos_id, resolve_vocab_size
from moetrain.model.transformer import Transformer
from moetrain.optim.schedule import lr_at
from moetrain.parallel.data import all_reduce_stats
from moetrain.parallel.mesh import ParallelDims, destroy_distributed, init_distributed
from moetrain.parallel.pipeline import Pipeline
from moetrain.train import step as train_step
from moetrain.train.bad_steps import BadSteps
from moetrain.train.checkpointing import Checkpointer
from moetrain.train.evaluate import Evaluator
from moetrain.train.graph import build_step_graph
from moetrain.train.loaders import build_loaders
from moetrain.train.metrics import open_metrics
from moetrain.train.model_build import build_model
from moetrain.train.optimizer_build import build_optimizer
from moetrain.train.routes import route_recorder
from moetrain.train.run_dir import RunDir
from moetrain.train.stopping import StopRequests, TrainingStopped
from moetrain.train.train_record import TrainRecords
from moetrain.train.wandb_log import import_wandb

__all__ = ["Trainer", "TrainingStopped"]


class Trainer:
    def __init__(
        self,
        config: RunConfig,
        run_dir: str | Path | None = None,
        *,
        resume: bool = False,
        init_from: str | Path | None = None,
        device: str | None = None,
        progress: bool = True,
        overwrite: bool = False,
        model_transform: Callable[[Transformer], None] | None = None,
        allow_lr_increase: bool = False,
    ) -> None:
        """`model_transform` changes the parallelized model before it is materialized (on meta;
        with FSDP after), as tools/bench/measure_rank.py does. `allow_lr_increase` lets a resume
        whose changed schedule raises the LR go on (`optim.schedule.lr_change`)."""
        # data paths made absolute; unset vocab_size and eos_id: from the tokenizer
        config = resolve_eos_id(resolve_vocab_size(resolve_data_paths(config)))
        if config.train.wandb_project is not None:  # a missing package fails now, not at step 1
            import_wandb(config.train.wandb_project)
        self.config, t = config, config.train
        self.dims: ParallelDims = init_distributed(config, device)
        self.device = self.dims.device
        self.is_main = self.dims.rank == 0
        self.run_dir = RunDir(run_dir or Path("runs") / config.name, is_main=self.is_main)
        self.run_dir.claim(resume=resume, overwrite=overwrite)
        self.accum_steps = config.grad_accum_steps(self.dims.dp)
        self.tokens_per_step = t.micro_batch_size * t.seq_len * self.accum_steps * self.dims.dp

        # ---- model (meta -> parallelize -> materialize -> init -> cast), optimizer, data ----
        self.model = model = build_model(config, self.dims, model_transform)
        # pp > 1: this rank's stages and the schedule that replaces the micro-batch loop
        self.pipeline = Pipeline(model, config, self.dims) if self.dims.pp > 1 else None
        self.optimizer = build_optimizer(model, config, self.dims)  # it syncs and clips grads
        self.train_loader, val, self.tokenizer = build_loaders(config, self.dims, self.device)
        self.evaluator = (  # the same sequences at every evaluation: nothing to checkpoint
            Evaluator(config, model, self.tokenizer, val, dims=self.dims, pipeline=self.pipeline)
            if t.eval_every
            else None
        )

        # ---- the step's state: the step sums on the device, read at the log cadence ----
        self.bad_steps = BadSteps(t, self.dims)
        self._sums = {k: torch.zeros((), device=self.device) for k in ("loss", "grad_norm", "good")}
        self.phase_events: list | None = None  # benchmarks: CUDA events between the phases
        kernel = getattr(self.optimizer, "kernel", "torch")  # captured at the first steps
        self.step_graph = build_step_graph(self._device_step, config, self.dims, kernel)
        self.stops = StopRequests(self.dims)

        # ---- where the run starts: its newest checkpoint, given weights, or step 0 ----
        self.checkpoints = Checkpointer(
            config,
            self.run_dir,
            self.dims,
            model=model,
            optimizer=self.optimizer,
            train_loader=self.train_loader,
            bad_steps=self.bad_steps,
            tokenizer=self.tokenizer,
            tokens_per_step=self.tokens_per_step,
            allow_lr_increase=allow_lr_increase,
        )
        report = progress and self.is_main
        self.resumed_from, self.step = self.checkpoints.start(resume, init_from, report=report)
        self.run_dir.save_config(config)  # after loading: a rejected config replaces nothing

        self.metrics = open_metrics(
            self.run_dir.path,
            config,
            is_main=self.is_main,
            console=progress,
            start_step=self.step,
            resumed=self.resumed_from is not None,
        )
        self.records = TrainRecords(
            config, model, self.pipeline, self.dims, self.train_loader, self.metrics.note
        )
        path = self.run_dir.path  # moe.record_routes: expert ids to RUN/routes/ (train/routes.py)
        self.routes = route_recorder(model, config, path, self.dims, self.accum_steps, self.step)

    # ------------------------------------------------------------------ loop
    def train(self) -> dict[str, Any]:
        t = self.config.train
        train_iter = iter(self.train_loader)
        last_val: tuple[int, float] | None = None  # (step, val loss) of the latest evaluation
        last_loss: float | None = None
        saved_at: Path | None = None
        try:
            with self.stops.caught():
                if self.resumed_from is not None:
                    self.metrics.note(f"resumed from {self.resumed_from} at step {self.step}")
                self.records.throughput.reset()
                while self.step < t.steps:
                    self.train_step(train_iter)
                    faults.after_step(self.step, self.dims.rank)
                    stop, lost = self.stops.agree(self.run_dir.lost is not None)
                    if lost:  # another run took the directory over: every rank stops, unsaved
                        raise self.run_dir.lost_error(self.step)
                    last_step = self.step == t.steps
                    if self.step % t.log_every == 0 or last_step or stop:
                        last_loss = self._log()
                    if t.eval_every and (self.step % t.eval_every == 0 or last_step):
                        last_val = (self.step, self._evaluate())
                    if self.checkpoints.due(self.step, final=last_step or stop):
                        saved_at = self.checkpoints.save(self.step)
                    if stop:
                        self.metrics.note(
                            f"stopped at step {self.step}; checkpoint saved to {saved_at}"
                        )
                        break
                    self.metrics.progress(self.step)
        finally:
            self.metrics.close()
        return {
            "steps": self.step,
            "final_loss": last_loss,
            # None unless evaluated at the final step (a run stopped between evaluations)
            "final_val_loss": last_val[1] if last_val and last_val[0] == self.step else None,
            "last_val_loss": last_val and last_val[1],
            "last_val_step": last_val and last_val[0],
            "checkpoint": str(saved_at) if saved_at else None,
            "stopped_early": self.step < t.steps,
            "skipped_steps": self.bad_steps.skipped_total,
        }

    def shutdown(self) -> None:
        """End of a run on every rank: wait for all, then tear the process groups down (ranks
        exiting with live groups can SIGABRT in gloo's destructors while a peer still talks)."""
        if dist.is_initialized():
            dist.barrier()
            destroy_distributed()
        self.run_dir.release()

    # ------------------------------------------------------------------ the step
    def train_step(self, train_iter) -> torch.Tensor:
        """One optimizer step (also what `moetrain bench` times). Returns the loss on device.
        Replayed as a CUDA graph where supported, except while benchmarks split it into phases."""
        lr = lr_at(self.step, self.config.train)
        if self.step_graph is not None and self.phase_events is None:
            loss = self.step_graph.run(train_iter, lr)
        else:
            loss = self._device_step(train_iter, lr)
        self.routes.end_of_step()  # outside the graph: a copy into the recording's ring
        self.step += 1
        self.records.throughput.add_tokens(self.tokens_per_step)
        return loss

    def _device_step(self, train_iter, lr: float | torch.Tensor) -> torch.Tensor:
        """The step's device work: nothing here reads a device value on the host, so it can be
        captured as a CUDA graph (moetrain.train.graph)."""
        self._mark_phase(0)
        if self.pipeline is not None:  # the same loss on every stage
            loss = self.pipeline.forward_backward(train_iter, self.optimizer.no_sync)
        else:
            loss = train_step.forward_backward(
                self.model, train_iter, self.accum_steps, self.optimizer.no_sync
            )
        self.optimizer.finish_grad_sync()
        self._mark_phase(1)
        verdict = self.bad_steps.judge(loss)
        grad_norm = self.optimizer.step(lr, self.config.train.grad_clip, skip=verdict.skip)
        applied = self.bad_steps.settle(verdict, grad_norm)
        self.optimizer.zero_grad()
        self._end_of_step_moe()
        self._mark_phase(2)
        with torch.no_grad():
            sums = self._sums
            sums["loss"] += torch.where(applied, loss, 0.0)
            sums["grad_norm"] += torch.where(applied, grad_norm.float(), 0.0)
            sums["good"] += applied.float()
            self.bad_steps.count(applied)
        return loss

    def _mark_phase(self, index: int) -> None:
        """Benchmarks set `phase_events` to CUDA events to split a step into its phases."""
        if self.phase_events is not None:
            self.phase_events[index].record()

    def _end_of_step_moe(self) -> None:
        layers = self.model.moe_layers()
        # the step's worst load, from this rank's routes (before the bias update sums them)
        self.records.load_peak.update([layer.step_tokens_per_expert_E for layer in layers])
        if self.config.moe.bias_update_rate > 0 and self.dims.world_size > 1:
            all_reduce_stats([layer.step_tokens_per_expert_E for layer in layers], self.dims)
        for layer in layers:
            layer.end_of_step()

    # ------------------------------------------------------------------ logging and eval
    def _log(self) -> float | None:
        """Write the train record; stop (after saving) on `train.max_bad_steps` bad steps."""
        sums = {**self._sums, **self.bad_steps.sums}
        host, record = self.records.record(self.step, sums, self.bad_steps)
        self.metrics.write(record)
        self.routes.flush()
        self.bad_steps.check(host, lambda: self.checkpoints.save(self.step))
        return record["loss"]

    def _evaluate(self) -> float:
        """Score the validation set, eval sets and tasks (train/evaluate.py); log the record."""
        record = self.evaluator.run(self.step)
        self.metrics.write(record)
        return record["val_loss"]
