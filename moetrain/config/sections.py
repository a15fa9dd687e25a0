"""The run's sections of a run configuration (`moetrain.config.RunConfig`): parallel, train, data
and precision (the model's two are in `moetrain.config.architecture`). Frozen, keyword-only
dataclasses, one per section, each checking its own fields at construction. Rules that span
sections live on `RunConfig`. Errors are `ValueError`s that name the field path, the value and
what is allowed. Each field declares where it is defined whether a resume may change it
(`frozen` or `resumable`); none of them is part of an exported model (`in_model=False`):
`moetrain.config.fields` says how. This module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moetrain.config.fields import frozen, resumable
from moetrain.config.files import same_files, tokenizer_file
from moetrain.config.values import check_choices, fail, non_negative, positive


# ---- the rules declared at fields (moetrain.config.fields) -------------------------------------
def _same_weights(old: tuple[dict, ...], new: tuple[dict, ...]) -> bool:
    """A mix's directories may move on resume (the recorded content hash catches other data),
    its number of sources and their weights may not."""
    return [s["weight"] for s in old] == [s["weight"] for s in new]


def _same_tokenizer(old: str, new: str) -> bool:
    """The same tokenizer.json under another (e.g. now absolute) path."""
    return "byte" not in (old, new) and same_files(tokenizer_file(old), tokenizer_file(new))


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Degrees of parallelism. world = pp x dp; ep divides dp and the number of experts."""

    dp: int | None = resumable(None, in_model=False)  # None: world_size // pp
    ep: int = resumable(1, in_model=False)
    pp: int = resumable(1, in_model=False)
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = resumable(
        "1f1b", in_model=False
    )
    # None: the number of gradient-accumulation steps
    pp_microbatches: int | None = resumable(None, in_model=False)
    data_parallel: Literal["ddp", "fsdp"] = resumable("ddp", in_model=False)
    # fsdp: when a block's gathered parameters are freed. forward: after its forward and again
    # after its backward (two all-gathers a micro-batch); backward: after its backward (one);
    # step: after the step's last backward (one all-gather and one reduce-scatter a step, the
    # whole parameters and unreduced gradients held between micro-batches)
    fsdp_reshard: Literal["forward", "backward", "step"] = resumable("forward", in_model=False)
    # fsdp: shard within groups of this many consecutive ranks (a node) and replicate across
    # them (HSDP; gradients reduce-scatter inside a group, then all-reduce across groups);
    # None: shard over all dp ranks
    fsdp_shard_size: int | None = resumable(None, in_model=False)
    activation_checkpointing: Literal["none", "moe", "full"] = resumable("none", in_model=False)
    # torch.compile each block; None: on for CUDA, off on CPU
    compile: bool | None = resumable(None, in_model=False)
    # process-group backend. auto: nccl on CUDA, gloo on CPU. gloo on CUDA lets several ranks
    # share one GPU (rank r on GPU r mod #GPUs): collectives are staged through the host, for
    # tests and debugging of the multi-rank code on real kernels only, never for speed
    backend: Literal["auto", "nccl", "gloo"] = resumable("auto", in_model=False)

    def __post_init__(self) -> None:
        s = "parallel"
        positive(s, self, "dp", "ep", "pp", "pp_microbatches", "fsdp_shard_size")
        check_choices(s, self)

    def compiles(self, device_type: str) -> bool:
        """Whether blocks are compiled on this device: `compile`, where None means on for CUDA
        and off elsewhere (on the CPU compile time dwarfs the gain for the models run there)."""
        return self.compile if self.compile is not None else device_type == "cuda"


MAX_NS_STEPS = 20


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimization and the training loop's cadence."""

    seed: int = frozen(0, in_model=False)
    steps: int = resumable(1000, in_model=False)
    seq_len: int = frozen(2048, in_model=False)
    micro_batch_size: int = frozen(8, in_model=False)
    # None: micro_batch_size * seq_len * dp, i.e. no gradient accumulation
    global_batch_tokens: int | None = resumable(None, in_model=False)
    lr: float = resumable(3e-4, in_model=False)
    min_lr_ratio: float = resumable(0.1, in_model=False)
    warmup_steps: int = resumable(100, in_model=False)
    schedule: Literal["cosine", "linear", "wsd", "constant"] = resumable("cosine", in_model=False)
    decay_fraction: float = resumable(0.2, in_model=False)  # wsd: fraction of steps spent decaying
    weight_decay: float = resumable(0.1, in_model=False)
    beta1: float = resumable(0.9, in_model=False)
    beta2: float = resumable(0.95, in_model=False)
    eps: float = resumable(1e-8, in_model=False)
    grad_clip: float = resumable(1.0, in_model=False)  # 0 disables clipping
    expert_lr_mult: float = resumable(1.0, in_model=False)
    router_lr_mult: float = resumable(1.0, in_model=False)
    # adamw: replicated AdamW; sharded: ZeRO-1 AdamW (flat shards); muon: Muon for the weight
    # matrices and the replicated AdamW for the rest; muon_sharded: Muon with each matrix's state
    # on one data-parallel rank and ZeRO-1 AdamW for the rest (docs/design.md, "Muon"). Frozen:
    # the optimizer state's layout depends on it
    optimizer: Literal["adamw", "sharded", "muon", "muon_sharded"] = frozen("adamw", in_model=False)
    # Muon's momentum (the lr and weight decay are AdamW's)
    muon_momentum: float = resumable(0.95, in_model=False)
    # orthogonalize g + momentum x buffer instead of the buffer
    muon_nesterov: bool = resumable(True, in_model=False)
    muon_ns_steps: int = resumable(5, in_model=False)  # quintic Newton-Schulz steps per update
    # the dtype of the Newton-Schulz products; fp32 for studying numerics (slower)
    muon_ns_dtype: Literal["bf16", "fp32"] = resumable("bf16", in_model=False)
    # the RMS of each matrix's update before the lr: 0.2 x sqrt(max(rows, cols)) x the
    # orthogonalized momentum (Moonlight's match of AdamW's update RMS)
    muon_update_rms: float = resumable(0.2, in_model=False)
    # the replicated AdamW's update kernel: auto = Triton on CUDA when installed, else torch's
    adamw_kernel: Literal["auto", "torch", "triton"] = resumable("auto", in_model=False)
    # replay each training step as one CUDA graph (moetrain.train.graph); None: where supported
    # in one process (several processes: only when true, not yet verified on several GPUs)
    cuda_graph: bool | None = resumable(None, in_model=False)
    log_every: int = resumable(10, in_model=False)
    eval_every: int = resumable(100, in_model=False)  # 0 disables evaluation
    # the validation set: this many windows of seq_len tokens of the val split (all when it has
    # fewer), the same at every evaluation and in every layout (moetrain.train.evaluate)
    eval_sequences: int = frozen(64, in_model=False)
    # multiple-choice tasks scored at every evaluation: JSON-lines files or built-in names
    # (moetrain.data.tasks)
    eval_tasks: tuple[str, ...] = resumable((), in_model=False)
    checkpoint_every: int = resumable(500, in_model=False)  # 0: only at the end
    keep_checkpoints: int = resumable(2, in_model=False)
    # consecutive skipped steps (NaN/inf, spikes) before save + stop
    max_bad_steps: int = resumable(5, in_model=False)
    # > 0: skip a step whose loss exceeds the mean + spike_sigma x std of the losses of the last
    # spike_window applied steps (once that many exist); 0 disables
    spike_sigma: float = resumable(0.0, in_model=False)
    spike_window: int = resumable(50, in_model=False)
    # log the metrics to this Weights & Biases project too (the optional wandb package); offline
    # without an API key. None: off
    wandb_project: str | None = resumable(None, in_model=False)

    def __post_init__(self) -> None:
        s = "train"
        positive(
            s,
            self,
            "steps",
            "seq_len",
            "micro_batch_size",
            "global_batch_tokens",
            "lr",
            "beta2",
            "eps",
            "log_every",
            "eval_sequences",
            "keep_checkpoints",
            "max_bad_steps",
            "muon_update_rms",
        )
        non_negative(
            s,
            self,
            "seed",
            "warmup_steps",
            "weight_decay",
            "grad_clip",
            "eval_every",
            "checkpoint_every",
            "expert_lr_mult",
            "router_lr_mult",
            "spike_sigma",
        )
        if self.spike_window < 2:
            fail("train.spike_window", self.spike_window, "must be >= 2 (it measures a spread)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            fail("train.min_lr_ratio", self.min_lr_ratio, "must be between 0 and 1")
        if not 0.0 < self.decay_fraction <= 1.0:
            fail("train.decay_fraction", self.decay_fraction, "must be in (0, 1]")
        for name in ("beta1", "beta2", "muon_momentum"):
            if not 0.0 <= getattr(self, name) < 1.0:
                fail(f"train.{name}", getattr(self, name), "must be in [0, 1)")
        if not 1 <= self.muon_ns_steps <= MAX_NS_STEPS:
            fail(
                "train.muon_ns_steps",
                self.muon_ns_steps,
                f"must be between 1 and {MAX_NS_STEPS} (the quintic iteration stops improving "
                "after about 5)",
            )
        check_choices(s, self)


@dataclass(frozen=True, kw_only=True)
class DataSource:
    """One token directory of a mix and its share of the training sequences."""

    path: str
    weight: float = 1.0


@dataclass(frozen=True, kw_only=True)
class EvalSet:
    """A token directory scored at every evaluation, its own curve in the metrics."""

    name: str
    path: str


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where tokens come from. path None and no sources: the embedded corpus."""

    # a directory written by `moetrain prepare`; relative paths are made absolute at start
    path: str | None = resumable(None, in_model=False)
    # a weighted mix of token directories instead of `path`, e.g. in YAML
    # [{path: data/a, weight: 0.7}, {path: data/b, weight: 0.3}]; weights are normalized. A
    # resume may move the directories, not change the weights
    sources: tuple[DataSource, ...] = frozen((), allow=_same_weights, in_model=False)
    # "byte" or a path to a Hugging Face tokenizer.json (on resume: the same file by any path)
    tokenizer: str = frozen("byte", allow=_same_tokenizer, in_model=False)
    # the embedded corpus's held-out share (None: 0.05); a token directory's split was made by
    # `moetrain prepare --val-fraction`, so with path or sources it must be None or that value
    val_fraction: float | None = resumable(None, in_model=False)
    # uniform random token ids (benchmarks only)
    random_tokens: bool = frozen(False, in_model=False)
    # attention stays within the documents of a packed sequence (EOS-separated; nn/document_mask.py)
    document_masking: bool = frozen(False, in_model=False)
    # with document_masking: RoPE positions count from 0 at each document start
    reset_positions: bool = frozen(False, in_model=False)
    # the id that separates documents; None: the tokenizer's EOS (resolve_eos_id). Set it only
    # with document_masking; with random_tokens it must be set (benchmarks)
    eos_id: int | None = frozen(None, in_model=False)
    # token directories scored (both splits) at every evaluation besides the val split, e.g. in
    # YAML [{name: wiki, path: data/wiki}]; prepared with the run's tokenizer
    eval_sets: tuple[EvalSet, ...] = frozen((), in_model=False)

    def __post_init__(self) -> None:
        if self.eval_sets and self.random_tokens:
            fail("data.eval_sets", self.eval_sets, "needs real data, not data.random_tokens")
        names = [s.name for s in self.eval_sets]
        for i, eval_set in enumerate(self.eval_sets):
            if not eval_set.name or "/" in eval_set.name or names.index(eval_set.name) != i:
                fail(
                    f"data.eval_sets[{i}].name",
                    eval_set.name,
                    "must be a non-empty name without '/', used once",
                )
        if self.val_fraction is not None and not 0.0 < self.val_fraction < 1.0:
            fail("data.val_fraction", self.val_fraction, "must be in (0, 1)")
        if self.reset_positions and not self.document_masking:
            fail("data.reset_positions", True, "needs data.document_masking=true")
        if self.eos_id is not None and not self.document_masking:
            fail(
                "data.eos_id",
                self.eos_id,
                "is read by document masking only; set data.document_masking=true or leave it null",
            )
        if self.eos_id is not None and self.eos_id < 0:
            fail("data.eos_id", self.eos_id, "must be >= 0")
        if self.document_masking and self.random_tokens and self.eos_id is None:
            fail(
                "data.document_masking",
                True,
                "needs data.eos_id with data.random_tokens (random ids have no tokenizer, hence "
                "no EOS to separate documents by)",
            )
        if not self.sources:
            return
        if self.path is not None:
            fail("data.path", self.path, "must be null when data.sources is set (one or the other)")
        if self.random_tokens:
            fail("data.random_tokens", True, "cannot be combined with data.sources")
        paths = [s.path for s in self.sources]
        for i, source in enumerate(self.sources):
            if not source.weight > 0:
                fail(f"data.sources[{i}].weight", source.weight, "must be > 0")
            if paths.index(source.path) != i:
                fail(f"data.sources[{i}].path", source.path, "is listed twice")


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """Number formats. param_dtype auto: bf16 params + fp32 master weights on GPU, fp32 on CPU."""

    param_dtype: Literal["auto", "fp32", "bf16"] = frozen("auto", in_model=False)
    # keep fp32 master weights and moments when params are bf16
    master_weights: bool = frozen(True, in_model=False)
    experts: Literal["bf16", "fp8_rowwise", "mxfp8"] = resumable("bf16", in_model=False)
    # the attention projections (q, k, v, o) and dense SwiGLUs (dense layers, shared experts);
    # the router stays bf16
    linear: Literal["bf16", "fp8_rowwise"] = resumable("bf16", in_model=False)
    # the LM head's logits and input gradient (its weight gradient stays bf16)
    lm_head: Literal["bf16", "fp8_rowwise"] = resumable("bf16", in_model=False)
    dispatch: Literal["bf16", "fp8"] = resumable("bf16", in_model=False)
    # dtype in which bf16 parameters' gradients accumulate over micro-batches and are reduced
    # over ranks (fp32: Megatron's main_grad, FSDP2's reduce dtype); fp32 parameters: fp32
    grad_dtype: Literal["fp32", "bf16"] = resumable("fp32", in_model=False)
    # FP8 products (experts, linears) accumulate without CUTLASS's periodic promotion to fp32:
    # faster, a little less precise; false selects the precise kernels
    fp8_fast_accum: bool = resumable(True, in_model=False)

    def __post_init__(self) -> None:
        s = "precision"
        check_choices(s, self)
