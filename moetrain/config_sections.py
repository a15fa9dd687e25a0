"""The sections of a run configuration (`moetrain.config.RunConfig`): frozen, keyword-only
dataclasses, one per section, each checking its own fields at construction. Rules that span
sections live on `RunConfig`. Errors are `ValueError`s that name the field path, the value and
what is allowed. This module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from moetrain.config_types import check_choices, fail


def _positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value <= 0:
            fail(f"{section}.{name}", value, "must be > 0")


def _non_negative(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 0:
            fail(f"{section}.{name}", value, "must be >= 0")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The dense part of the transformer (attention, embeddings, norms)."""

    vocab_size: int | None = None  # None: the tokenizer's size rounded up to a multiple of 64
    d_model: int = 1024
    num_layers: int = 8
    num_heads: int = 16
    num_kv_heads: int | None = None  # None: same as num_heads (multi-head attention)
    head_dim: int | None = None  # None: d_model // num_heads
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    qk_norm: bool = True  # RMSNorm over the full q and k projections (OLMoE)
    tie_embeddings: bool = False
    num_dense_layers: int = 0  # the first N blocks use a dense SwiGLU MLP instead of MoE
    dense_hidden: int | None = None  # hidden size of dense MLPs; None: 4 * d_model
    init_std: float = 0.02
    attention_backend: Literal["auto", "cudnn", "flash", "efficient", "math"] = "auto"

    def __post_init__(self) -> None:
        s = "model"
        _positive(
            s,
            self,
            "vocab_size",
            "d_model",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "rope_theta",
            "norm_eps",
            "dense_hidden",
            "init_std",
        )
        if self.head_dim is None and self.d_model % self.num_heads:
            fail(
                "model.d_model",
                self.d_model,
                f"must be divisible by model.num_heads ({self.num_heads}) unless head_dim is set",
            )
        if self.num_heads % self.kv_heads:
            fail(
                "model.num_kv_heads",
                self.num_kv_heads,
                f"must divide model.num_heads ({self.num_heads})",
            )
        if not 0 <= self.num_dense_layers <= self.num_layers:
            fail(
                "model.num_dense_layers",
                self.num_dense_layers,
                f"must be between 0 and model.num_layers ({self.num_layers})",
            )
        check_choices(s, self)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def dense_hidden_size(self) -> int:
        return self.dense_hidden or 4 * self.d_model


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """The mixture-of-experts feed-forward: router, balancing and expert shapes."""

    num_experts: int = 64
    top_k: int = 8
    expert_hidden: int = 512
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    renormalize: bool = False  # renormalize the top-k weights to sum to one
    routing: Literal["learned", "random"] = "learned"  # random: uniform experts, for benchmarks
    lb_loss_weight: float = 0.01
    # the routes the balance loss's fractions count: this rank's micro-batch, or the micro-batch
    # of every data-parallel rank (counts summed over dp; never over a step's micro-batches:
    # docs/design.md, "Which routes the balance loss counts")
    lb_scope: Literal["micro_batch", "micro_batch_dp"] = "micro_batch"
    z_loss_weight: float = 0.001
    bias_update_rate: float = 0.0  # > 0: auxiliary-loss-free balancing with a per-expert bias
    num_shared_experts: int = 0  # always-on experts of hidden size expert_hidden each
    # None: dropless (the exact-split all_to_all dispatcher under expert parallelism); a factor:
    # capacity mode (no_sync on CUDA), static buffers of about factor x T x K rows per rank
    capacity_factor: float | None = None
    dispatcher: Literal["auto", "local", "all_to_all", "no_sync"] = "auto"
    # two_chunk: each MoE block splits its micro-batch's sequences in two, so that each chunk's
    # all-to-alls run under the other chunk's compute (docs/design.md, "Overlap")
    overlap: Literal["none", "two_chunk"] = "none"

    def __post_init__(self) -> None:
        s = "moe"
        _positive(s, self, "num_experts", "top_k", "expert_hidden", "capacity_factor")
        _non_negative(
            s, self, "lb_loss_weight", "z_loss_weight", "bias_update_rate", "num_shared_experts"
        )
        if self.top_k > self.num_experts:
            fail("moe.top_k", self.top_k, f"must be <= moe.num_experts ({self.num_experts})")
        check_choices(s, self)
        if self.dispatcher == "no_sync" and self.capacity_factor is None:
            fail(
                "moe.dispatcher",
                "no_sync",
                "needs moe.capacity_factor (None, dropless): the no-sync dispatcher has fixed "
                "buffers and drops the routes beyond capacity. Set moe.capacity_factor (e.g. "
                "1.25-2.0), or use moe.dispatcher all_to_all (or auto) for dropless routing",
            )


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Degrees of parallelism. world = pp x dp; ep divides dp and the number of experts."""

    dp: int | None = None  # None: world_size // pp
    ep: int = 1
    pp: int = 1
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = "1f1b"
    pp_microbatches: int | None = None  # None: the number of gradient-accumulation steps
    data_parallel: Literal["ddp", "fsdp"] = "ddp"
    # fsdp: when a block's gathered parameters are freed. forward: after its forward and again
    # after its backward (two all-gathers a micro-batch); backward: after its backward (one);
    # step: after the step's last backward (one all-gather and one reduce-scatter a step, the
    # whole parameters and unreduced gradients held between micro-batches)
    fsdp_reshard: Literal["forward", "backward", "step"] = "forward"
    # fsdp: shard within groups of this many consecutive ranks (a node) and replicate across
    # them (HSDP; gradients reduce-scatter inside a group, then all-reduce across groups);
    # None: shard over all dp ranks
    fsdp_shard_size: int | None = None
    activation_checkpointing: Literal["none", "moe", "full"] = "none"
    compile: bool | None = None  # torch.compile each block; None: on for CUDA, off on CPU
    # process-group backend. auto: nccl on CUDA, gloo on CPU. gloo on CUDA lets several ranks
    # share one GPU (rank r on GPU r mod #GPUs): collectives are staged through the host, for
    # tests and debugging of the multi-rank code on real kernels only, never for speed
    backend: Literal["auto", "nccl", "gloo"] = "auto"

    def __post_init__(self) -> None:
        s = "parallel"
        _positive(s, self, "dp", "ep", "pp", "pp_microbatches", "fsdp_shard_size")
        check_choices(s, self)

    def compiles(self, device_type: str) -> bool:
        """Whether blocks are compiled on this device: `compile`, where None means on for CUDA
        and off elsewhere (on the CPU compile time dwarfs the gain for the models run there)."""
        return self.compile if self.compile is not None else device_type == "cuda"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimization and the training loop's cadence."""

    seed: int = 0
    steps: int = 1000
    seq_len: int = 2048
    micro_batch_size: int = 8
    # None: micro_batch_size * seq_len * dp, i.e. no gradient accumulation
    global_batch_tokens: int | None = None
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    schedule: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    decay_fraction: float = 0.2  # wsd: fraction of steps spent decaying
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    expert_lr_mult: float = 1.0
    router_lr_mult: float = 1.0
    optimizer: Literal["adamw", "sharded"] = "adamw"
    # the replicated AdamW's update kernel: auto = Triton on CUDA when installed, else torch's
    adamw_kernel: Literal["auto", "torch", "triton"] = "auto"
    # replay each training step as one CUDA graph (moetrain.train.graph); None: where supported
    # in one process (several processes: only when true, not yet verified on several GPUs)
    cuda_graph: bool | None = None
    log_every: int = 10
    eval_every: int = 100  # 0 disables evaluation
    # the validation set: this many windows of seq_len tokens of the val split (all when it has
    # fewer), the same at every evaluation and in every layout (moetrain.train.evaluate)
    eval_sequences: int = 64
    # multiple-choice tasks scored at every evaluation: JSON-lines files or built-in names
    # (moetrain.data.tasks)
    eval_tasks: tuple[str, ...] = ()
    checkpoint_every: int = 500  # 0: only at the end
    keep_checkpoints: int = 2
    max_bad_steps: int = 5  # consecutive skipped steps (NaN/inf, spikes) before save + stop
    # > 0: skip a step whose loss exceeds the mean + spike_sigma x std of the losses of the last
    # spike_window applied steps (once that many exist); 0 disables
    spike_sigma: float = 0.0
    spike_window: int = 50
    # log the metrics to this Weights & Biases project too (the optional wandb package); offline
    # without an API key. None: off
    wandb_project: str | None = None

    def __post_init__(self) -> None:
        s = "train"
        _positive(
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
        )
        _non_negative(
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
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                fail(f"train.{name}", getattr(self, name), "must be in [0, 1)")
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
    path: str | None = None
    # a weighted mix of token directories instead of `path`, e.g. in YAML
    # [{path: data/a, weight: 0.7}, {path: data/b, weight: 0.3}]; weights are normalized
    sources: tuple[DataSource, ...] = ()
    tokenizer: str = "byte"  # "byte" or a path to a Hugging Face tokenizer.json
    # the embedded corpus's held-out share (None: 0.05); a token directory's split was made by
    # `moetrain prepare --val-fraction`, so with path or sources it must be None or that value
    val_fraction: float | None = None
    random_tokens: bool = False  # uniform random token ids (benchmarks only)
    # attention stays within the documents of a packed sequence (EOS-separated; nn/document_mask.py)
    document_masking: bool = False
    # with document_masking: RoPE positions count from 0 at each document start
    reset_positions: bool = False
    # the id that separates documents; None: the tokenizer's EOS (resolve_eos_id). Set it only
    # with document_masking; with random_tokens it must be set (benchmarks)
    eos_id: int | None = None
    # token directories scored (both splits) at every evaluation besides the val split, e.g. in
    # YAML [{name: wiki, path: data/wiki}]; prepared with the run's tokenizer
    eval_sets: tuple[EvalSet, ...] = ()

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

    param_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    master_weights: bool = True  # keep fp32 master weights and moments when params are bf16
    experts: Literal["bf16", "fp8_rowwise", "mxfp8"] = "bf16"
    # the attention projections (q, k, v, o) and dense SwiGLUs (dense layers, shared experts);
    # the router stays bf16
    linear: Literal["bf16", "fp8_rowwise"] = "bf16"
    # the LM head's logits and input gradient (its weight gradient stays bf16)
    lm_head: Literal["bf16", "fp8_rowwise"] = "bf16"
    dispatch: Literal["bf16", "fp8"] = "bf16"
    # dtype in which bf16 parameters' gradients accumulate over micro-batches and are reduced
    # over ranks (fp32: Megatron's main_grad, FSDP2's reduce dtype); fp32 parameters: fp32
    grad_dtype: Literal["fp32", "bf16"] = "fp32"
    # FP8 products (experts, linears) accumulate without CUTLASS's periodic promotion to fp32:
    # faster, a little less precise; false selects the precise kernels
    fp8_fast_accum: bool = True

    def __post_init__(self) -> None:
        s = "precision"
        check_choices(s, self)
