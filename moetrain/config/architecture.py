"""The model's sections of a run configuration: `ModelConfig` (the dense transformer) and
`MoEConfig` (the mixture-of-experts feed-forward), frozen keyword-only dataclasses that check their
own fields at construction, with `ValueError`s that name the field path, the value and what is
allowed. They are what an exported model is: each field declares which of its values each export
format (`olmoe=...`, `qwen3_moe=...`, `mixtral=...`) can represent, or `in_model=False`, and
whether a resume may change it (`moetrain.config.fields` says how). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moetrain.config.fields import ANY, Needs, Only, frozen, resumable
from moetrain.config.values import check_choices, fail, non_negative, positive

# ---- the rules declared at fields (moetrain.config.fields) -------------------------------------
# OLMoE sizes its q and k norms by d_model, so the heads must span it exactly
_OLMOE_HEAD_DIM = Needs(
    lambda m: m.dim_per_head * m.num_heads == m.d_model,
    "head_dim x num_heads must equal model.d_model (OLMoE sizes its q/k norms by d_model); "
    "leave head_dim unset",
)


def _bias_stays_on_or_off(key: str, old: float, new: float, source: str) -> None:
    """A resume may change the rate of the expert bias, but not between 0 and > 0: the routers'
    learned bias exists only while the rate is positive."""
    if (old > 0) != (new > 0):
        raise ValueError(
            f"{key} cannot change between 0 and > 0 on --resume ({old!r} in {source}, {new!r} "
            "now): the router's learned expert bias exists only while the rate is > 0, so it "
            "would be dropped (or start again from zero); keep a positive rate (a small one all "
            "but freezes the bias), or start a new run"
        )


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The dense part of the transformer (attention, embeddings, norms)."""

    # None: the tokenizer's size rounded up to a multiple of 64
    vocab_size: int | None = frozen(None, olmoe=ANY, qwen3_moe=ANY, mixtral=ANY)
    d_model: int = frozen(1024, olmoe=ANY, qwen3_moe=ANY, mixtral=ANY)
    num_layers: int = frozen(8, olmoe=ANY, qwen3_moe=ANY, mixtral=ANY)
    num_heads: int = frozen(16, olmoe=ANY, qwen3_moe=ANY, mixtral=ANY)
    # None: num_heads (multi-head attention)
    num_kv_heads: int | None = frozen(None, olmoe=ANY, qwen3_moe=ANY, mixtral=ANY)
    # None: d_model // num_heads
    head_dim: int | None = frozen(None, olmoe=_OLMOE_HEAD_DIM, qwen3_moe=ANY, mixtral=ANY)
    rope_theta: float = frozen(10_000.0, olmoe=ANY, qwen3_moe=ANY, mixtral=ANY)
    norm_eps: float = frozen(1e-5, olmoe=ANY, qwen3_moe=ANY, mixtral=ANY)
    # RMSNorm of q and k before RoPE: "full" over each whole projection (OLMoE), "per_head" over
    # each head's head_dim with one head_dim-wide weight for all heads (Qwen3), "none" (Mixtral).
    # The true/false of older configs reads as "full"/"none" (config.LEGACY_CHOICES)
    qk_norm: Literal["none", "full", "per_head"] = frozen(
        "full", olmoe=Only("full"), qwen3_moe=Only("per_head"), mixtral=Only("none")
    )
    tie_embeddings: bool = frozen(False, olmoe=ANY, qwen3_moe=ANY, mixtral=ANY)
    # the first N blocks use a dense SwiGLU MLP instead of MoE (every OLMoE and Mixtral layer is
    # MoE; Qwen3 lists its dense layers in mlp_only_layers)
    num_dense_layers: int = frozen(0, olmoe=Only(0), qwen3_moe=ANY, mixtral=Only(0))
    # the blocks, by index in increasing order, that use a dense SwiGLU MLP instead of MoE, at
    # any positions (Qwen3's mlp_only_layers and decoder_sparse_step); only with
    # num_dense_layers 0
    dense_layers: tuple[int, ...] = frozen((), olmoe=Only(()), qwen3_moe=ANY, mixtral=Only(()))
    # hidden size of dense MLPs; None: 4 * d_model (unused in OLMoE and Mixtral, which have none)
    dense_hidden: int | None = frozen(None, olmoe=ANY, qwen3_moe=ANY, mixtral=ANY)
    init_std: float = frozen(0.02, in_model=False)  # the initialization only
    # the attention kernel (nn/attention.py): any of them computes the same model
    attention_backend: Literal["auto", "cudnn", "flash", "efficient", "math"] = resumable(
        "auto", in_model=False
    )

    def __post_init__(self) -> None:
        s = "model"
        positive(
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
        if self.dim_per_head % 2:
            fail(
                "model.head_dim" if self.head_dim else "model.d_model",
                self.head_dim or self.d_model,
                f"gives heads of {self.dim_per_head} features: RoPE rotates pairs, so a head's "
                "width must be even",
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
        layers = self.dense_layers
        if any(not 0 <= i < self.num_layers for i in layers) or list(layers) != sorted(set(layers)):
            fail(
                "model.dense_layers",
                list(layers),
                f"must list layer indices in [0, {self.num_layers}) once each, in increasing order",
            )
        if layers and self.num_dense_layers:
            fail(
                "model.dense_layers",
                list(layers),
                f"cannot be combined with model.num_dense_layers ({self.num_dense_layers}); list "
                "the first layers in dense_layers too, or use num_dense_layers alone",
            )
        check_choices(s, self)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    def is_dense(self, layer: int) -> bool:
        """Whether block `layer` has a dense SwiGLU MLP (model.num_dense_layers or
        model.dense_layers) instead of a MoE layer."""
        return layer < self.num_dense_layers or layer in self.dense_layers

    @property
    def num_dense(self) -> int:
        """The number of dense-MLP blocks."""
        return self.num_dense_layers + len(self.dense_layers)

    @property
    def dense_hidden_size(self) -> int:
        return self.dense_hidden or 4 * self.d_model


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """The mixture-of-experts feed-forward: router, balancing and expert shapes."""

    num_experts: int = frozen(64, olmoe=ANY, qwen3_moe=ANY, mixtral=ANY)
    top_k: int = frozen(8, olmoe=ANY, qwen3_moe=ANY, mixtral=ANY)
    expert_hidden: int = frozen(512, olmoe=ANY, qwen3_moe=ANY, mixtral=ANY)
    score_func: Literal["softmax", "sigmoid"] = frozen(
        "softmax", olmoe=Only("softmax"), qwen3_moe=Only("softmax"), mixtral=Only("softmax")
    )
    # renormalize the top-k weights to sum to one (Mixtral always does: softmax over the top-k
    # logits)
    renormalize: bool = frozen(False, olmoe=ANY, qwen3_moe=ANY, mixtral=Only(True))
    # random: uniform experts, for benchmarks
    routing: Literal["learned", "random"] = frozen(
        "learned", olmoe=Only("learned"), qwen3_moe=Only("learned"), mixtral=Only("learned")
    )
    # group-limited routing (DeepSeek-V3): the experts form n_groups groups of consecutive ids; a
    # token chooses its top_k among the experts of its topk_groups best groups, a group scored by
    # the sum of its two best selection scores (moe/group_limit.py). topk_groups = n_groups: off.
    # None of the export formats has it
    n_groups: int = frozen(1, olmoe=Only(1), qwen3_moe=Only(1), mixtral=Only(1))
    topk_groups: int = frozen(1, olmoe=Only(1), qwen3_moe=Only(1), mixtral=Only(1))
    lb_loss_weight: float = resumable(0.01, in_model=False)
    # the routes the balance loss's fractions count: this rank's micro-batch, or the micro-batch
    # of every data-parallel rank (counts summed over dp; never over a step's micro-batches:
    # docs/design.md, "Which routes the balance loss counts")
    lb_scope: Literal["micro_batch", "micro_batch_dp"] = resumable("micro_batch", in_model=False)
    z_loss_weight: float = resumable(0.001, in_model=False)
    # > 0: auxiliary-loss-free balancing with a per-expert bias in the routers' expert choice
    bias_update_rate: float = resumable(
        0.0,
        check=_bias_stays_on_or_off,
        olmoe=Only(0.0),
        qwen3_moe=Only(0.0),
        mixtral=Only(0.0),
    )
    # always-on experts of expert_hidden each
    num_shared_experts: int = frozen(0, olmoe=Only(0), qwen3_moe=Only(0), mixtral=Only(0))
    # None: dropless (the exact-split all_to_all dispatcher under expert parallelism); a factor:
    # capacity mode (no_sync on CUDA), static buffers of about factor x T x K rows per rank. A
    # way to train: an exported model routes every token, as the dropless layer does
    capacity_factor: float | None = resumable(None, in_model=False)
    dispatcher: Literal["auto", "local", "all_to_all", "no_sync"] = resumable(
        "auto", in_model=False
    )
    # two_chunk: each MoE block splits its micro-batch's sequences in two, so that each chunk's
    # all-to-alls run under the other chunk's compute (docs/design.md, "Overlap")
    overlap: Literal["none", "two_chunk"] = resumable("none", in_model=False)
    # write every training forward's expert ids to RUN/routes/ at the log cadence, kept on the
    # device in between (moetrain/train/routes.py says the format)
    record_routes: bool = resumable(False, in_model=False)
    # a routes directory (RUN/routes: this rank's files) or file: each training forward takes
    # the recorded experts instead of choosing them (moe/replay_router.py); the weights are
    # still the scores at those experts. Frozen: the run's routes come from it
    replay_routes: str | None = frozen(None, in_model=False)

    def __post_init__(self) -> None:
        s = "moe"
        positive(s, self, "num_experts", "top_k", "expert_hidden", "capacity_factor")
        non_negative(
            s, self, "lb_loss_weight", "z_loss_weight", "bias_update_rate", "num_shared_experts"
        )
        if self.top_k > self.num_experts:
            fail("moe.top_k", self.top_k, f"must be <= moe.num_experts ({self.num_experts})")
        self._check_groups()
        check_choices(s, self)
        if self.replay_routes is not None and self.routing != "learned":
            fail(
                "moe.replay_routes",
                self.replay_routes,
                f"replays recorded routes in place of moe.routing {self.routing!r}: leave "
                "moe.routing learned",
            )
        if self.replay_routes is not None and self.overlap != "none":
            fail(
                "moe.overlap",
                self.overlap,
                "routes chunks of a micro-batch, and replayed routes are whole micro-batches: "
                "use moe.overlap none with moe.replay_routes",
            )
        if self.dispatcher == "no_sync" and self.capacity_factor is None:
            fail(
                "moe.dispatcher",
                "no_sync",
                "needs moe.capacity_factor (None, dropless): the no-sync dispatcher has fixed "
                "buffers and drops the routes beyond capacity. Set moe.capacity_factor (e.g. "
                "1.25-2.0), or use moe.dispatcher all_to_all (or auto) for dropless routing",
            )

    @property
    def group_limited(self) -> bool:
        """Whether routing is group-limited (moe.topk_groups < moe.n_groups)."""
        return self.topk_groups < self.n_groups

    def _check_groups(self) -> None:
        E, G, top = self.num_experts, self.n_groups, self.topk_groups
        positive("moe", self, "n_groups", "topk_groups")
        if E % G:
            fail("moe.n_groups", G, f"must divide moe.num_experts ({E})")
        if top > G:
            fail("moe.topk_groups", top, f"must be <= moe.n_groups ({G})")
        if not self.group_limited:
            return
        if E // G < 2:
            fail(
                "moe.n_groups",
                G,
                f"must leave at least 2 experts a group (moe.num_experts {E}): a group's score "
                "is the sum of its two best scores",
            )
        if self.top_k > top * (E // G):
            fail(
                "moe.top_k",
                self.top_k,
                f"must be <= moe.topk_groups x the experts a group ({top} x {E // G}): a token "
                "chooses among the experts of its best groups",
            )
