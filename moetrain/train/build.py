"""How the trainer builds its parts from a config: the optimizer (and its update kernel), the
GEMM precisions, the parameter dtype, the data loaders, and the claim on a run directory. A
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
from moetrain.moe.grouped_gemm import make_grouped_gemm
from moetrain.nn.attention import Attention
from moetrain.nn.fp8 import check_fp8_widths, fp8_unsupported_reason
from moetrain.nn.mlp import SwiGLU
from moetrain.optim.adamw import AdamW
from moetrain.optim.clip import global_grad_norm, params_with_kinds, sharded_grad_norm
from moetrain.optim.param_groups import build_param_groups
from moetrain.optim.sharded import ShardedAdamW, expert_global_slices
from moetrain.parallel.data import FSDPAccumulation, GradientSync
from moetrain.parallel.mesh import ParallelDims
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


def resolve_grad_dtype(
    model: Transformer, config: RunConfig, dims: ParallelDims
) -> torch.dtype | None:
    """The dtype gradients accumulate and are reduced in, when not the parameters' own (None).
    `precision.grad_dtype` fp32 with bf16 parameters gives fp32, except where nothing is
    accumulated or reduced (one micro-batch, one dp rank, no pipeline: a buffer would only add a
    pass); FSDP reduces its own; the sharded optimizers always take it (their buckets exist)."""
    if config.precision.grad_dtype != "fp32" or config.parallel.data_parallel == "fsdp":
        return None
    if all(p.dtype == torch.float32 for p in model.parameters()):
        return None
    accumulates = config.grad_accum_steps(dims.dp) > 1 or dims.dp > 1 or dims.pp > 1
    if not accumulates and config.train.optimizer not in ("sharded", "muon_sharded"):
        return None
    return torch.float32


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


def apply_precision(model: Transformer, config: RunConfig, device: torch.device) -> None:
    """Install the expert GEMM of `precision.experts` and the projections' precision of
    `precision.linear`; an unsupported choice fails here, never as a silent fallback
    (`precision.dispatch` is installed with the dispatchers, parallel/expert.py)."""
    if config.precision.dispatch == "fp8" and config.parallel.ep == 1:
        print(
            "note: precision.dispatch=fp8 without expert parallelism: no rows leave the device;"
            " the dispatched rows get the FP8 rounding only (same numerics as with ep > 1)"
        )
    if config.precision.linear == "fp8_rowwise":
        install_fp8_linears(model, config, device)
    if config.precision.lm_head == "fp8_rowwise":
        install_fp8_lm_head(model, config, device)
    if config.precision.experts == "bf16":
        return
    gemm = make_grouped_gemm(
        config.precision.experts, device, use_fast_accum=config.precision.fp8_fast_accum
    )
    for layer in model.moe_layers():
        layer.experts.gemm = gemm
        if hasattr(layer.dispatcher, "fp8_rows"):  # the local dispatchers: rows quantized there
            layer.dispatcher.fp8_rows = getattr(gemm, "takes_fp8_rows", False)
    if gemm.emulated:
        print(
            f"note: precision.experts={config.precision.experts} runs as {gemm.name}: "
            "for studying numerics, not for speed"
        )


def _fp8_mode(setting: str, device: torch.device) -> str:
    """ "fp8" where FP8 tensor cores run, "fp8-emulated" off the GPU (numerics only, with a
    note); a GPU without them is a start-up error naming `setting`."""
    reason = fp8_unsupported_reason(device)
    if device.type == "cuda" and reason is not None:
        raise ValueError(f"{setting}=fp8_rowwise is unavailable: {reason}; use 'bf16'")
    if reason is not None:
        print(f"note: {setting}=fp8_rowwise runs as an emulation: numerics, not speed")
    return "fp8" if reason is None else "fp8-emulated"


def install_fp8_linears(model: Transformer, config: RunConfig, device: torch.device) -> None:
    """precision.linear=fp8_rowwise: attention projections and dense SwiGLUs in FP8."""
    mode = _fp8_mode("precision.linear", device)
    m = config.model
    for module in model.modules():
        if isinstance(module, Attention):
            widths = {
                "model.d_model": m.d_model,
                "num_heads * head_dim": module.num_heads * module.head_dim,
                "num_kv_heads * head_dim": module.num_kv_heads * module.head_dim,
            }
        elif isinstance(module, SwiGLU):
            widths = {"d_model": m.d_model, "hidden": module.hidden}
        else:
            continue
        check_fp8_widths("precision.linear=fp8_rowwise", **widths)
        module.fp8 = mode
        module.fp8_fast_accum = config.precision.fp8_fast_accum


def install_fp8_lm_head(model: Transformer, config: RunConfig, device: torch.device) -> None:
    """precision.lm_head=fp8_rowwise: the LM head's logits and input gradient in FP8 (nn.loss)."""
    mode = _fp8_mode("precision.lm_head", device)
    m = config.model
    check_fp8_widths(
        "precision.lm_head=fp8_rowwise",
        **{"model.d_model": m.d_model, "model.vocab_size": m.vocab_size},
    )
    model.lm_head_fp8 = mode
    model.lm_head_fp8_fast_accum = config.precision.fp8_fast_accum


def resolve_param_dtype(config: RunConfig, device: torch.device) -> torch.dtype:
    """precision.param_dtype: auto is bf16 on CUDA and fp32 elsewhere. fp32 with compiled
    blocks is an error: torch.compile's shape function of torch._grouped_mm accepts bf16 only."""
    choice = config.precision.param_dtype
    if choice == "auto":
        choice = "bf16" if device.type == "cuda" else "fp32"
    compiled = config.parallel.compiles(device.type)
    if choice == "fp32" and compiled and config.precision.experts == "bf16":
        raise ValueError(
            "precision.param_dtype (fp32) needs parallel.compile=false: compiled, the expert "
            "GEMM (torch._grouped_mm) takes bf16 only"
        )
    return torch.bfloat16 if choice == "bf16" else torch.float32


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
