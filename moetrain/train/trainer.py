"""The training loop: build, train with log/eval/checkpoint cadences, stop cleanly, resume exactly.

One step: forward/backward (train/step.py) -> gradient sync -> global-norm clip -> optimizer
step, skipped on the device for a non-finite loss or gradient or a loss spike (train/spike.py)
-> MoE end-of-step; metrics stay on the device until the log cadence. SIGTERM / Ctrl-C finish
the step, save and return; `train.max_bad_steps` consecutive skipped steps save and stop with an
error. The run directory is locked for the run (train/run_lock.py).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moetrain import faults
from moetrain.checkpoint import manager
from moetrain.config import RunConfig
from moetrain.data import (
    check_same_data,
    data_fingerprint,
    resolve_data_paths,
    resolve_eos_id,
    resolve_vocab_size,
    source_labels,
)
from moetrain.data.tokenizer_files import describe, tokenizer_files
from moetrain.model.flops import flops_per_token
from moetrain.model.transformer import Transformer
from moetrain.optim.adamw import AdamW
from moetrain.optim.muon import Muon
from moetrain.optim.schedule import lr_at
from moetrain.parallel.data import all_reduce_stats
from moetrain.parallel.expert import globalize_experts
from moetrain.parallel.mesh import ParallelDims, destroy_distributed, init_distributed
from moetrain.parallel.parallelize import parallelize
from moetrain.parallel.pipeline import Pipeline
from moetrain.train import step as train_step
from moetrain.train.build import (
    apply_precision,
    build_loaders,
    build_optimizer,
    claim_run_dir,
    resolve_param_dtype,
)
from moetrain.train.evaluate import Evaluator
from moetrain.train.graph import StepGraph
from moetrain.train.log_stats import train_record
from moetrain.train.metrics import Console, EpochLog, MetricsSink, Throughput
from moetrain.train.observe import TokenGamingDetector
from moetrain.train.resume import check_resume
from moetrain.train.run_lock import RunDirLocked, RunLock
from moetrain.train.spike import LossSpikeDetector
from moetrain.train.wandb_log import WandbWriter, import_wandb


class TrainingStopped(RuntimeError):
    """Raised on every rank when training cannot continue: too many non-finite steps (after
    saving), or another run took the run directory over (without saving)."""


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
        with FSDP after), as tools/bench/measure_rank.py does. `allow_lr_increase` lets a resume whose
        changed schedule raises the LR go on (`optim.schedule.lr_change`)."""
        # data paths made absolute; unset vocab_size and eos_id: from the tokenizer
        config = resolve_eos_id(resolve_vocab_size(resolve_data_paths(config)))
        self.allow_lr_increase = allow_lr_increase
        if config.train.wandb_project is not None:  # a missing package fails now, not at step 1
            import_wandb(config.train.wandb_project)
        self.config = config
        self.dims: ParallelDims = init_distributed(config, device)
        self.device = self.dims.device
        self.is_main = self.dims.rank == 0
        self.run_dir = Path(run_dir or Path("runs") / config.name)
        self.checkpoint_root = self.run_dir / "checkpoints"
        manager.check_writable(self.checkpoint_root)  # fail now, not at the first save
        self.run_lock = RunLock(self.run_dir) if self.is_main else None
        self._hold_run_dir()  # before --overwrite may delete anything
        if not resume:
            claim_run_dir(self.run_dir, self.checkpoint_root, overwrite, self.is_main)
        self.accum_steps = config.grad_accum_steps(self.dims.dp)
        t = config.train
        self.tokens_per_step = t.micro_batch_size * t.seq_len * self.accum_steps * self.dims.dp

        # ---- model: meta -> parallelize -> materialize -> init -> cast ----
        self.param_dtype = resolve_param_dtype(config, self.device)
        with torch.device("meta"):
            model = Transformer(config)
        fsdp = config.parallel.data_parallel == "fsdp"
        if fsdp:  # the baseline shards materialized, initialized weights (see parallel/data.py)
            self._materialize(model)
        model = parallelize(model, config, self.dims)
        if model_transform is not None:
            model_transform(model)
        if not fsdp:
            self._materialize(model)
        apply_precision(model, config, self.device)
        model.train()
        self.model = model
        # pp > 1: this rank's stages and the schedule that replaces the micro-batch loop
        self.pipeline = Pipeline(model, config, self.dims) if self.dims.pp > 1 else None
        self._moe_names = [n for n, m in model.named_modules() if m in set(model.moe_layers())]

        # ---- optimizer (it owns gradient synchronization and clipping) ----
        self.optimizer = build_optimizer(model, config, self.dims)

        # ---- data ----
        self.train_loader, val, self.tokenizer = build_loaders(self.config, self.dims, self.device)
        self.evaluator = (  # the same sequences at every evaluation: nothing to checkpoint
            Evaluator(config, model, self.tokenizer, val, dims=self.dims, pipeline=self.pipeline)
            if t.eval_every
            else None
        )
        self.data_fingerprint = data_fingerprint(config.data)
        self._tokenizer_files = (  # every checkpoint carries them (data/tokenizer_files.py)
            tokenizer_files(self.tokenizer, t.seq_len) if self.tokenizer is not None else None
        )

        # ---- state that checkpoints carry ----
        self.step = 0
        self.skipped_total = 0
        self.spike_total = 0
        self.spikes = (
            LossSpikeDetector(t.spike_sigma, t.spike_window, self.device)
            if t.spike_sigma > 0
            else None
        )
        self._stop_requested = False
        self._bad_run = torch.zeros((), device=self.device)
        keys = ("loss", "grad_norm", "good", "bad", "spikes", "max_bad_run")
        self._acc = {k: torch.zeros((), device=self.device) for k in keys}
        self.phase_events: list | None = None
        self.step_graph = self._build_step_graph()
        self._control_group = dist.new_group(backend="gloo") if self.dims.world_size > 1 else None

        self.resumed_from: Path | None = None
        if resume:
            latest = manager.agree_on_latest(self.checkpoint_root)  # rank 0 picks and hashes
            if latest is not None:
                self.load_checkpoint(latest, verified=True)
                self.resumed_from = latest
            elif manager.unusable(self.checkpoint_root):
                names = ", ".join(p.name for p in manager.unusable(self.checkpoint_root))
                raise manager.CheckpointError(
                    f"--resume: no checkpoint under {self.checkpoint_root} verifies ({names}); "
                    "refusing to start over at step 0. Put an intact copy of a checkpoint "
                    "there, or train from the weights of one elsewhere in a new run "
                    "(another --run-dir, --init-from CHECKPOINT)"
                )
            elif progress and self.is_main:  # a first start under a requeue-safe --resume
                start = f" from the weights of {init_from}" if init_from is not None else ""
                print(
                    f"no complete checkpoint under {self.checkpoint_root}: starting at step 0{start}"
                )
        # a first start (a requeued job repeats --resume --init-from): the given weights; once
        # the run has a checkpoint, that checkpoint, not init_from
        if init_from is not None and self.resumed_from is None:
            self.load_weights(init_from)
        if self.is_main:  # after loading: a config the checkpoint rejects does not replace it
            self.run_dir.mkdir(parents=True, exist_ok=True)
            config.save_yaml(self.run_dir / "config.yaml")

        self.console = Console(t.steps, self.step, enabled=progress and self.is_main)
        wandb = None
        if self.is_main and t.wandb_project is not None:
            wandb = WandbWriter(
                self.run_dir,
                t.wandb_project,
                config.name,
                config.to_dict(),
                resumed=self.resumed_from is not None,
            )
        self.metrics = MetricsSink(self.run_dir, enabled=self.is_main, wandb=wandb)
        self.throughput = Throughput(flops_per_token(config), self.device)
        self.gaming = TokenGamingDetector()
        labels = source_labels(config.data) if config.data.sources else None
        self.epochs = EpochLog(self.train_loader.passes(), labels)

    def _hold_run_dir(self) -> None:
        """The main rank locks the run directory for the life of the run (train/run_lock.py);
        every rank raises the same error when another run holds it."""
        error = None
        if self.run_lock is not None:
            try:
                self.run_lock.acquire()
            except RunDirLocked as exc:
                error = str(exc)
        error = manager.first_error(error)
        if error is not None:
            raise RunDirLocked(error)

    def _build_step_graph(self) -> StepGraph | None:
        """train.cuda_graph: None graphs one process where supported; several processes only
        when set to true (NCCL capture has not run on several GPUs yet: train/graph.py)."""
        choice = self.config.train.cuda_graph
        multi = self.dims.world_size > 1
        if choice is False or (choice is None and multi):
            return None
        kernel = getattr(self.optimizer, "kernel", "torch")
        backend = dist.get_backend() if multi else None
        reason = StepGraph.unsupported_reason(self.config, self.dims, self.device, kernel, backend)
        if choice is None and reason is not None:
            return None
        if reason is not None:
            raise ValueError(f"train.cuda_graph (true): cannot graph this run: {reason}")
        return StepGraph(self._device_step, self.accum_steps, self.device, strict=choice is True)

    def _materialize(self, model: Transformer) -> None:
        model.to_empty(device=self.device)
        model.init_weights(self.config.train.seed)
        for param in model.parameters():
            param.data = param.data.to(self.param_dtype)

    # ------------------------------------------------------------------ loop
    def train(self) -> dict[str, Any]:
        t = self.config.train
        previous = {
            s: signal.signal(s, self._request_stop) for s in (signal.SIGTERM, signal.SIGINT)
        }
        train_iter = iter(self.train_loader)
        last_val: tuple[int, float] | None = None  # (step, val loss) of the latest evaluation
        last_loss: float | None = None
        saved_at: Path | None = None
        try:
            if self.resumed_from is not None:
                self.console.print(f"resumed from {self.resumed_from} at step {self.step}")
            self.throughput.reset()
            while self.step < t.steps:
                self.train_step(train_iter)
                faults.after_step(self.step, self.dims.rank)
                stop = self._agree_to_stop()
                last_step = self.step == t.steps
                if self.step % t.log_every == 0 or last_step or stop:
                    last_loss = self._log()
                if t.eval_every and (self.step % t.eval_every == 0 or last_step):
                    last_val = (self.step, self._evaluate())
                if (
                    last_step
                    or stop
                    or (t.checkpoint_every and self.step % t.checkpoint_every == 0)
                ):
                    saved_at = self.save_checkpoint()
                if stop:
                    self.console.print(
                        f"stopped at step {self.step}; checkpoint saved to {saved_at}"
                    )
                    break
                self.console.update(self.step)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.console.close()
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
            "skipped_steps": self.skipped_total,
        }

    def shutdown(self) -> None:
        """End of a run on every rank: wait for all, then tear the process groups down (ranks
        exiting with live groups can SIGABRT in gloo's destructors while a peer still talks)."""
        if dist.is_initialized():
            dist.barrier()
            destroy_distributed()
        if self.run_lock is not None:
            self.run_lock.release()

    def train_step(self, train_iter) -> torch.Tensor:
        """One optimizer step (also what `moetrain bench` times). Returns the loss on device.
        Replayed as a CUDA graph where supported, except while benchmarks split it into phases."""
        lr = lr_at(self.step, self.config.train)
        if self.step_graph is not None and self.phase_events is None:
            loss = self.step_graph.run(train_iter, lr)
        else:
            loss = self._device_step(train_iter, lr)
        self.step += 1
        self.throughput.add_tokens(self.tokens_per_step)
        return loss

    def _device_step(self, train_iter, lr: float | torch.Tensor) -> torch.Tensor:
        """The step's device work: nothing here reads a device value on the host, so it can be
        captured as a CUDA graph (moetrain.train.graph)."""
        t, acc = self.config.train, self._acc
        self._mark_phase(0)
        if self.pipeline is not None:  # the same loss on every stage
            loss = self.pipeline.forward_backward(train_iter, self.optimizer.no_sync)
        else:
            loss = train_step.forward_backward(
                self.model, train_iter, self.accum_steps, self.optimizer.no_sync
            )
        self.optimizer.finish_grad_sync()
        self._mark_phase(1)
        skip = ~torch.isfinite(loss)
        if self.spikes is not None:  # judged on the global batch's loss, so all ranks agree
            batch_loss = all_reduce_stats([loss.clone()], self.dims)[0] / self.dims.dp
            spike = self.spikes.is_spike(batch_loss)
            skip = skip | spike
        grad_norm = self.optimizer.step(lr, t.grad_clip, skip=skip)
        applied = ~skip & torch.isfinite(grad_norm)
        if self.spikes is not None:
            self.spikes.record(batch_loss, applied)
            acc["spikes"] += spike.float()
        self.optimizer.zero_grad()
        self._end_of_step_moe()
        self._mark_phase(2)
        with torch.no_grad():
            acc["loss"] += torch.where(applied, loss, 0.0)
            acc["grad_norm"] += torch.where(applied, grad_norm.float(), 0.0)
            acc["good"] += applied.float()
            acc["bad"] += (~applied).float()
            # consecutive skipped steps, and the longest such run since the last log
            self._bad_run.copy_((self._bad_run + 1) * (~applied).float())
            acc["max_bad_run"].copy_(torch.maximum(acc["max_bad_run"], self._bad_run))
        return loss

    def _mark_phase(self, index: int) -> None:
        """Benchmarks set `phase_events` to CUDA events to split a step into its phases."""
        if self.phase_events is not None:
            self.phase_events[index].record()

    def _end_of_step_moe(self) -> None:
        layers = self.model.moe_layers()
        if self.config.moe.bias_update_rate > 0 and self.dims.world_size > 1:
            all_reduce_stats([layer.step_tokens_per_expert_E for layer in layers], self.dims)
        for layer in layers:
            layer.end_of_step()

    def _request_stop(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self._stop_requested = True

    def _agree_to_stop(self) -> bool:
        """Every rank must stop after the same step: OR the local flags over a gloo (CPU) group.
        A run whose lock the heartbeat found lost raises here, on every rank, saving nothing."""
        lost = self.run_lock is not None and self.run_lock.lost is not None
        flags = torch.tensor([int(self._stop_requested), int(lost)])
        if self._control_group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._control_group)
        if flags[1]:
            raise self._lock_lost()
        return bool(flags[0])

    def _lock_lost(self) -> TrainingStopped:
        why = f" ({self.run_lock.lost})" if self.run_lock is not None else ""
        return TrainingStopped(
            f"this run lost the lock on its run directory {self.run_dir}{why}: another run took "
            f"the directory over. Stopped after step {self.step} without saving, so as not to "
            "write into a directory another run owns. Find which run should own it, stop the "
            "other, and restart that one with --resume"
        )

    # ------------------------------------------------------------------ logging and eval
    def _log(self) -> float | None:
        t = self.config.train
        host, record = train_record(self, self._acc)
        for layer in record["moe"]:
            warning = self.gaming.update(
                self.step, layer["layer"], layer["lb_loss"], layer["max_mean"]
            )
            if warning:
                self.console.print(f"warning: {warning}")
        if self.is_main:
            self.metrics.write(record)
            self.console.update(self.step, record)
        if host["max_bad_run"] >= t.max_bad_steps:
            path = self.save_checkpoint()
            why = "a non-finite loss or gradient"
            if host["spikes"]:
                why += f" or a loss spike ({int(host['spikes'])} since the last log)"
            raise TrainingStopped(
                f"{int(host['max_bad_run'])} consecutive steps were skipped for {why} "
                f"(train.max_bad_steps = {t.max_bad_steps}); saved {path} and stopped. Lower "
                f"train.lr or check the data."
            )
        return record["loss"]

    def _evaluate(self) -> float:
        """Score the validation set, eval sets and tasks (train/evaluate.py); log the record."""
        record = self.evaluator.run(self.step)
        if self.is_main:
            self.metrics.write(record)
            self.console.update(self.step, record)
        return record["val_loss"]

    # ------------------------------------------------------------------ checkpoints
    def tensor_state(self, optim: dict[str, Any] | None = None) -> dict[str, Any]:
        """What DCP saves and loads in place: every tensor under its global name and shape.
        `optim` is the optimizer's `state_dict()` (taken now when None). Expert slices become
        DTensors of the global experts that view the tensors they wrap (parallel/expert.py
        `global_expert_view`); FSDP2's DTensors of dense weights are global already; the sharded
        optimizer's state describes its own shards as chunks of the global tensors
        (optim/sharded_state.py)."""
        optim = self.optimizer.state_dict() if optim is None else optim
        if isinstance(self.optimizer, (AdamW, Muon)):  # local tensors, experts made global
            optim = globalize_experts(optim, self.dims)
        return {
            "model": globalize_experts(self.model.state_dict(), self.dims),
            "optim": optim,
            "rng": {"cpu": torch.get_rng_state()},
        }

    def trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "skipped_total": self.skipped_total,
            "spike_total": self.spike_total,
            "train_loader": self.train_loader.state_dict(),
            "world_size": self.dims.world_size,
            "tokens_per_step": self.tokens_per_step,
            "data_fingerprint": self.data_fingerprint,
            # every router draws once per forward, so one number restores them all
            "routing_draws": max((m.router.draws for m in self.model.moe_layers()), default=0),
            **({"loss_window": self.spikes.state_dict()} if self.spikes is not None else {}),
            **({"tokenizer": describe(self.tokenizer)} if self.tokenizer is not None else {}),
        }

    def save_checkpoint(self) -> Path:
        import yaml

        lost = self.run_lock.beat() if self.run_lock is not None else None
        if manager.first_error(lost) is not None:  # never save into another run's directory
            raise self._lock_lost()
        return manager.save(
            self.checkpoint_root,
            self.step,
            self.tensor_state(),
            self.trainer_state(),
            yaml.safe_dump(self.config.to_dict(), sort_keys=False),
            keep=self.config.train.keep_checkpoints,
            extra_files=self._tokenizer_files,
        )

    def load_checkpoint(self, path: str | Path, *, verified: bool = False) -> None:
        """Resume from `path` (its files' hashes checked unless `verified` already). Its
        config.yaml must agree with this run's on the architecture and the data
        (moetrain/train/resume_config.py); anything else may have changed."""
        check_resume(
            Path(path), self.config, self.allow_lr_increase, self.is_main, self.tokens_per_step
        )
        optim = self.optimizer.state_dict()
        state = self.tensor_state(optim)
        trainer_state = manager.load(path, state, check_hashes=not verified)
        if trainer_state.get("data_fingerprint") != self.data_fingerprint:
            check_same_data(self.config.data, trainer_state.get("data_fingerprint"), path)
        # DCP loaded in place: `optim`, unwrapped, holds the checkpoint's values
        self.optimizer.load_state_dict(optim)
        torch.set_rng_state(state["rng"]["cpu"])
        self.step = trainer_state["step"]
        self.skipped_total = trainer_state.get("skipped_total", 0)
        self.spike_total = trainer_state.get("spike_total", 0)
        if self.spikes is not None and "loss_window" in trainer_state:
            self.spikes.load_state_dict(trainer_state["loss_window"])
        self.train_loader.load_state_dict(trainer_state["train_loader"])
        for layer in self.model.moe_layers():
            layer.router.draws = trainer_state.get("routing_draws", 0)
        self.step_graph = self._build_step_graph()  # a captured graph would hold replaced tensors

    def load_weights(self, path: str | Path) -> None:
        """Model weights only (e.g. an imported Hugging Face model), for a fresh run."""
        manager.load(
            manager.resolve(path), {"model": globalize_experts(self.model.state_dict(), self.dims)}
        )
        self.optimizer.reset_masters()
