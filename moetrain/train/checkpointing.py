"""A run's checkpoints: what one holds, when one is due, and where a run starts from.

A checkpoint (checkpoint/manager.py: atomic, hashed, rotated) holds the tensors DCP saves and
loads in place (`tensor_state`: weights, optimizer state, CPU RNG) and the trainer state, plain
JSON (`trainer_state`: the step, the bad-step totals and loss-spike window, the loader's
position, the data fingerprint, the tokenizer; random routers keep their draws in the model's
state), plus the config and
the tokenizer files. Restored, they continue the run bit for bit. A resume loads the newest
checkpoint that verifies; a first start may take the weights of another (`init_from`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

from moetrain.checkpoint import manager
from moetrain.config import RunConfig
from moetrain.data import check_same_data, data_fingerprint
from moetrain.data.tokenizer_files import describe, tokenizer_files
from moetrain.model.transformer import Transformer
from moetrain.moe.random_router import RandomRouter
from moetrain.optim.adamw import AdamW
from moetrain.optim.muon import Muon
from moetrain.parallel.expert import globalize_experts
from moetrain.parallel.mesh import ParallelDims
from moetrain.train.bad_steps import BadSteps
from moetrain.train.resume import check_resume
from moetrain.train.run_dir import RunDir


class Checkpointer:
    """The checkpoints of one run: it saves and restores the objects given here in place."""

    def __init__(
        self,
        config: RunConfig,
        run_dir: RunDir,
        dims: ParallelDims,
        *,
        model: Transformer,
        optimizer: Any,
        train_loader: Any,
        bad_steps: BadSteps,
        tokenizer: Any,
        tokens_per_step: int,
        allow_lr_increase: bool = False,
    ) -> None:
        self.config, self.run_dir, self.root, self.dims = (
            config,
            run_dir,
            run_dir.checkpoint_root,
            dims,
        )
        self.model, self.optimizer, self.train_loader = model, optimizer, train_loader
        self.bad_steps, self.tokenizer = bad_steps, tokenizer
        self.allow_lr_increase, self.tokens_per_step = allow_lr_increase, tokens_per_step
        self.data_fingerprint = data_fingerprint(config.data)
        self.tokenizer_files = (  # every checkpoint carries them (data/tokenizer_files.py)
            tokenizer_files(tokenizer, config.train.seq_len) if tokenizer is not None else None
        )

    def due(self, step: int, *, final: bool) -> bool:
        """Save after this step: at `train.checkpoint_every`, and at a `final` one (the last
        step, a stop)."""
        every = self.config.train.checkpoint_every
        return final or bool(every and step % every == 0)

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

    def trainer_state(self, step: int) -> dict[str, Any]:
        """The checkpoint's trainer.json: everything `load` restores besides the tensors."""
        bad = self.bad_steps
        return {
            "step": step,
            "skipped_total": bad.skipped_total,
            "spike_total": bad.spike_total,
            "train_loader": self.train_loader.state_dict(),
            "world_size": self.dims.world_size,
            "tokens_per_step": self.tokens_per_step,
            "data_fingerprint": self.data_fingerprint,
            **({"loss_window": bad.spikes.state_dict()} if bad.spikes is not None else {}),
            **({"tokenizer": describe(self.tokenizer)} if self.tokenizer is not None else {}),
        }

    def save(self, step: int) -> Path:
        self.run_dir.check_owned(step)  # never save into another run's directory
        return manager.save(
            self.root,
            step,
            self.tensor_state(),
            self.trainer_state(step),
            yaml.safe_dump(self.config.to_dict(), sort_keys=False),
            keep=self.config.train.keep_checkpoints,
            extra_files=self.tokenizer_files,
        )

    def load(self, path: str | Path, *, verified: bool = False) -> int:
        """Restore the run from `path` (its files' hashes checked unless `verified` already);
        returns its step. Its config.yaml must agree with this run's on the architecture and the
        data (moetrain/train/resume_config.py); anything else may have changed."""
        check_resume(
            Path(path),
            self.config,
            self.allow_lr_increase,
            self.run_dir.is_main,
            self.tokens_per_step,
        )
        optim = self.optimizer.state_dict()
        state = self.tensor_state(optim)
        trainer_state = manager.load(path, state, check_hashes=not verified)
        if trainer_state.get("data_fingerprint") != self.data_fingerprint:
            check_same_data(self.config.data, trainer_state.get("data_fingerprint"), path)
        # DCP loaded in place: `optim`, unwrapped, holds the checkpoint's values
        self.optimizer.load_state_dict(optim)
        torch.set_rng_state(state["rng"]["cpu"])
        bad = self.bad_steps
        bad.skipped_total = trainer_state.get("skipped_total", 0)
        bad.spike_total = trainer_state.get("spike_total", 0)
        if bad.spikes is not None and "loss_window" in trainer_state:
            bad.spikes.load_state_dict(trainer_state["loss_window"])
        self.train_loader.load_state_dict(trainer_state["train_loader"])
        for layer in self.model.moe_layers():  # before random routers kept their own draws
            if isinstance(layer.router, RandomRouter) and "routing_draws" in trainer_state:
                layer.router.draws = trainer_state["routing_draws"]
        return trainer_state["step"]

    def load_weights(self, path: str | Path) -> None:
        """Model weights only (e.g. an imported Hugging Face model), for a fresh run."""
        manager.load(
            manager.resolve(path), {"model": globalize_experts(self.model.state_dict(), self.dims)}
        )
        self.optimizer.reset_masters()

    def start(
        self, resume: bool, init_from: str | Path | None, *, report: bool
    ) -> tuple[Path | None, int]:
        """(the checkpoint the run resumed from, or None; the step it starts at): with `resume`
        the newest checkpoint (`latest`); else, or at a first start, the weights of `init_from`
        when given (a requeued job repeats --resume --init-from: once the run has a checkpoint,
        that checkpoint), else nothing."""
        latest = self.latest(init_from=init_from, report=report) if resume else None
        if latest is not None:
            return latest, self.load(latest, verified=True)
        if init_from is not None:
            self.load_weights(init_from)
        return None, 0

    def latest(self, *, init_from: str | Path | None, report: bool) -> Path | None:
        """What --resume loads: the newest checkpoint that verifies (the ranks agree on it), or
        None at a first start (`report`: say so). Checkpoints that exist but none verifies are
        an error, never a silent start over."""
        latest = manager.agree_on_latest(self.root)  # rank 0 picks and hashes
        if latest is not None:
            return latest
        if manager.unusable(self.root):
            names = ", ".join(p.name for p in manager.unusable(self.root))
            raise manager.CheckpointError(
                f"--resume: no checkpoint under {self.root} verifies ({names}); "
                "refusing to start over at step 0. Put an intact copy of a checkpoint "
                "there, or train from the weights of one elsewhere in a new run "
                "(another --run-dir, --init-from CHECKPOINT)"
            )
        if report:  # a first start under a requeue-safe --resume
            start = f" from the weights of {init_from}" if init_from is not None else ""
            print(f"no complete checkpoint under {self.root}: starting at step 0{start}")
        return None
