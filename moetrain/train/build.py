"""How the trainer builds its parts from a config: the optimizer (and its update kernel), the
data loaders, and the claim on a run directory (the precision plan: parallel/precision.py). A
choice this machine cannot honour fails at start-up, naming the field to change.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from moetrain.checkpoint import manager
from moetrain.config import RunConfig
from moetrain.data import (
    MixedLoader,
    RandomTokenLoader,
    SequenceLoader,
    open_data,
)
from moetrain.model.transformer import Transformer
from moetrain.optim.adamw import AdamW
from moetrain.optim.clip import global_grad_norm, params_with_kinds, sharded_grad_norm
from moetrain.optim.param_groups import build_param_groups
from moetrain.optim.sharded import ShardedAdamW, expert_global_slices
from moetrain.parallel.data import FSDPAccumulation, GradientSync
from moetrain.parallel.mesh import ParallelDims
from moetrain.parallel.precision import resolve_grad_dtype
from moetrain.train.muon_build import MUON_OPTIMIZERS, build_muon


def build_optimizer(model: Transformer, config: RunConfig, dims: ParallelDims):
    """AdamW replicated over data parallelism (GradientSync all-reduces gradients), or the
    distributed optimizer (train.optimizer = sharded), which reduce-scatters them itself; Muon
    in either form (train/muon_build.py)."""
    t = config.train
    groups = build_param_groups(model, t)
    grad_dtype = resolve_grad_dtype(model, config, dims)
    if t.optimizer in MUON_OPTIMIZERS:
        kernel = resolve_adamw_kernel(t.adamw_kernel, dims.device)
        return build_muon(model, config, dims, groups, grad_dtype=grad_dtype, adamw_kernel=kernel)
    if t.optimizer == "sharded":
        if config.parallel.data_parallel == "fsdp":
            raise ValueError(
                "train.optimizer (sharded) cannot be combined with "
                "parallel.data_parallel (fsdp): FSDP shards the states itself"
            )
        return ShardedAdamW(
            groups,
            dense_group=dims.dp_group,
            expert_group=dims.edp_group,
            expert_grad_divisor=dims.dp,
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=t.eps,
            global_slices=expert_global_slices(model, config.moe.num_experts),
            pp_group=dims.pp_group,
            param_order=[n for n, _ in model.named_parameters()],
            grad_dtype=grad_dtype,
        )
    fsdp = config.parallel.data_parallel == "fsdp"
    needs_sync = (dims.world_size > 1 or grad_dtype is not None) and not fsdp
    grad_sync = GradientSync(model, dims, grad_dtype=grad_dtype) if needs_sync else None
    if fsdp and dims.dp > 1 and config.parallel.fsdp_reshard == "step":
        grad_sync = FSDPAccumulation(model)
    pairs = params_with_kinds(groups)

    def norm_fn() -> torch.Tensor:
        if fsdp:  # DTensor gradients on one mesh per kind (dense over dp, experts over edp)
            return sharded_grad_norm(pairs, ep_group=dims.ep_group)
        return global_grad_norm(pairs, ep_group=dims.ep_group, pp_group=dims.pp_group)

    optimizer = AdamW(
        groups,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
        master_weights=config.precision.master_weights,
        fused=dims.device.type == "cuda",
        norm_fn=norm_fn,
        grad_sync=grad_sync,
        kernel=resolve_adamw_kernel(t.adamw_kernel, dims.device),
    )
    optimizer.init_state()
    return optimizer


def resolve_adamw_kernel(choice: str, device: torch.device) -> str:
    """train.adamw_kernel: "auto" picks the Triton kernel on CUDA when Triton is installed."""
    from moetrain.kernels import adamw_triton

    usable = device.type == "cuda" and adamw_triton.triton_available()
    if choice == "triton" and not usable:
        raise ValueError(
            f"train.adamw_kernel (triton) needs a CUDA device and Triton; device is {device}, "
            f"Triton {'is' if adamw_triton.triton_available() else 'is not'} installed"
        )
    if choice == "auto":
        return "triton" if usable else "torch"
    return choice


def claim_run_dir(run_dir: Path, checkpoint_root: Path, overwrite: bool, is_main: bool) -> None:
    """A fresh start must not mix with an earlier run in the same directory (its checkpoints
    would outrank the new ones, its metrics interleave): an error without `overwrite`; with it
    the main rank first deletes the earlier run's checkpoints, metrics and TensorBoard files."""
    earlier = manager.list_complete(checkpoint_root)
    metrics = run_dir / "metrics.jsonl"
    if not earlier and not metrics.exists():
        return
    what = f"checkpoints up to {earlier[-1].name}" if earlier else "metrics.jsonl"
    if not overwrite:
        raise ValueError(
            f"{run_dir} holds an earlier run ({what}): pass --resume to continue it, "
            "--overwrite to delete it and start over, or choose another --run-dir"
        )
    if is_main:
        print(f"--overwrite: deleting the earlier run in {run_dir} ({what})")
        shutil.rmtree(checkpoint_root, ignore_errors=True)
        metrics.unlink(missing_ok=True)
        for events in run_dir.glob("events.out.tfevents.*"):
            events.unlink()


def build_loaders(cfg: RunConfig, d: ParallelDims, device: torch.device):
    """(this dp rank's train loader, the val tokens (a list for a mix), tokenizer or None):
    random ids, one token directory, or a weighted mix of sources."""
    t = cfg.train
    if cfg.data.random_tokens:
        train = RandomTokenLoader(
            cfg.model.vocab_size,
            t.seq_len,
            t.micro_batch_size,
            seed=t.seed,
            rank=d.dp_rank,
            device=device,
        )
        rng = np.random.default_rng([t.seed, 1])
        return train, rng.integers(0, cfg.model.vocab_size, t.eval_sequences * t.seq_len + 1), None
    train_tokens, val_tokens, tokenizer = open_data(cfg.data, cfg.model.vocab_size)
    common = dict(rank=d.dp_rank, world_size=d.dp, device=device)
    shape = (t.seq_len, t.micro_batch_size)
    if cfg.data.sources:
        weights = [s.weight for s in cfg.data.sources]
        return (
            MixedLoader(train_tokens, weights, *shape, seed=t.seed, **common),
            val_tokens,
            tokenizer,
        )
    return SequenceLoader(train_tokens, *shape, seed=t.seed, **common), val_tokens, tokenizer
