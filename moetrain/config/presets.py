"""Named run configurations. Each preset is a function returning a `RunConfig`.

`tiny` runs on a laptop CPU in seconds and is what tests use; `demo` is the default of
`moetrain train` (a few minutes on a 2-core CPU); `qwen3-moe-tiny` and `mixtral-tiny` are the
Qwen3-MoE and Mixtral blocks at tiny's size (for tests; they export to their families), and
`qwen3-30b-a3b` and `mixtral-8x7b` those published models' architectures (for `moetrain inspect`,
`plan` and `--dry-run`; train them from an import, `moetrain import`); the others are the
benchmark architectures of docs/benchmarks.md: the OLMoE block (qk-norm, RoPE theta 10,000, untied embeddings, softmax
router without top-k renormalization, SwiGLU experts, every layer MoE, vocabulary 50,304).
`ref-47b` is that block at the reference's 47B expert-scaling model, for the 8-GPU projection;
`trillion-1.2t` and `trillion-2.4t` are that block at the reference trillion-scale runs' totals,
for `moetrain plan` and `moetrain train --dry-run` (docs/plan.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from moetrain.config import (
    DataConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
    layer,
    merge,
    read_yaml,
)

BYTE_VOCAB = 320  # 256 bytes + EOS, padded to a multiple of 64


def tiny() -> RunConfig:
    return RunConfig(
        name="tiny",
        model=ModelConfig(vocab_size=BYTE_VOCAB, d_model=64, num_layers=2, num_heads=4),
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=128),
        train=TrainConfig(
            seq_len=64,
            micro_batch_size=8,
            steps=50,
            lr=3e-3,
            warmup_steps=5,
            log_every=5,
            eval_every=25,
            eval_sequences=32,
            checkpoint_every=25,
        ),
    )


def demo() -> RunConfig:
    """The default run: a small byte-level MoE trained on the embedded corpus on CPU."""
    return RunConfig(
        name="demo",
        model=ModelConfig(vocab_size=BYTE_VOCAB, d_model=128, num_layers=4, num_heads=4),
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=256),
        train=TrainConfig(
            seq_len=128,
            micro_batch_size=16,
            steps=300,
            lr=3e-3,
            warmup_steps=20,
            log_every=10,
            eval_every=100,
            eval_sequences=128,
            checkpoint_every=100,
        ),
        data=DataConfig(),
    )


def qwen3_moe(name: str) -> RunConfig:
    """The Qwen3-MoE block: per-head q/k RMSNorm, GQA, head_dim apart from d_model / heads,
    RoPE theta 1e6, norm eps 1e-6, a softmax router renormalized over the top k, no shared
    expert, every layer MoE. qwen3-30b-a3b is Qwen3-30B-A3B (48 layers, 128 experts, top-8):
    30.5B parameters, 3.3B active counting the input embedding as Qwen does."""
    big = name == "qwen3-30b-a3b"
    return RunConfig(
        name=name,
        model=ModelConfig(
            vocab_size=151936 if big else BYTE_VOCAB,
            d_model=2048 if big else 64,
            num_layers=48 if big else 2,
            num_heads=32 if big else 4,
            num_kv_heads=4 if big else 2,
            head_dim=128 if big else 32,
            rope_theta=1e6,
            norm_eps=1e-6,
            qk_norm="per_head",
            dense_hidden=6144 if big else 256,  # Qwen3's intermediate_size (its dense layers)
        ),
        moe=MoEConfig(
            num_experts=128 if big else 8,
            top_k=8 if big else 2,
            expert_hidden=768 if big else 128,
            renormalize=True,
            lb_loss_weight=0.001,
        ),
        train=TrainConfig(seq_len=4096, micro_batch_size=1) if big else tiny().train,
    )


def mixtral(name: str) -> RunConfig:
    """The Mixtral block: no q/k norm, GQA, RoPE theta 1e6, a softmax over the top-k logits
    (softmax renormalized over the top k), every layer MoE. mixtral-8x7b is Mixtral-8x7B (32
    layers, 8 experts of 14336, top-2): 46.7B parameters, 12.9B active counting the input
    embedding as Mistral does."""
    big = name == "mixtral-8x7b"
    return RunConfig(
        name=name,
        model=ModelConfig(
            vocab_size=32000 if big else BYTE_VOCAB,
            d_model=4096 if big else 64,
            num_layers=32 if big else 2,
            num_heads=32 if big else 4,
            num_kv_heads=8 if big else 2,
            rope_theta=1e6,
            qk_norm="none",
        ),
        moe=MoEConfig(
            num_experts=8,
            top_k=2,
            expert_hidden=14336 if big else 128,
            renormalize=True,
            lb_loss_weight=0.001,
        ),
        train=TrainConfig(seq_len=4096, micro_batch_size=1) if big else tiny().train,
    )


# The OLMoE-block presets: (d_model, num_layers, num_heads, num_experts, top_k, expert_hidden,
# seq_len, micro_batch_size). ref-47b is the reference's 47B expert-scaling model (128 experts,
# top-4): 47.06B parameters, 3.18B active counting the input embedding as the reference does; its
# unpublished dimensions are derived from the reported totals in docs/plan.md.
_OLMOE = {
    "small": (1024, 8, 16, 64, 8, 512, 2048, 8),
    "olmoe8": (2048, 8, 16, 64, 8, 1024, 4096, 4),
    "olmoe-1b-7b": (2048, 16, 16, 64, 8, 1024, 4096, 4),
    **{f"scale-E{e}": (1024, 12, 16, e, 4, 1024, 4096, 8) for e in (8, 16, 32, 64, 128)},
    "ref-47b": (4096, 20, 32, 128, 4, 1440, 4096, 4),
}


def _olmoe(name: str) -> RunConfig:
    d_model, num_layers, num_heads, num_experts, top_k, expert_hidden, seq_len, micro = _OLMOE[name]
    return RunConfig(
        name=name,
        model=ModelConfig(
            vocab_size=50304, d_model=d_model, num_layers=num_layers, num_heads=num_heads
        ),
        moe=MoEConfig(num_experts=num_experts, top_k=top_k, expert_hidden=expert_hidden),
        train=TrainConfig(seq_len=seq_len, micro_batch_size=micro),
    )


small = functools.partial(_olmoe, "small")


def _trillion(name: str, num_experts: int) -> RunConfig:
    """trillion-1.2t: the reference trillion-scale run's totals in the OLMoE block, 1.195T
    parameters, 58.57B active per token (reported: about 1.2T and 58.36B), with random routing
    as in the reference measurement, the dropless exact-split dispatcher, pp 16 x ep 8 without
    checkpointing, ShardedAdamW (the arithmetic and the layout's choice: docs/plan.md).
    trillion-2.4t: the reference capacity run's scale, the same model with 512 experts, 2.37T
    parameters."""
    return RunConfig(
        name=name,
        model=ModelConfig(vocab_size=50304, d_model=7168, num_layers=104, num_heads=56),
        moe=MoEConfig(
            num_experts=num_experts,
            top_k=8,
            expert_hidden=2048,
            routing="random",
            dispatcher="all_to_all",  # dropless exact splits, as auto (see docs/plan.md)
        ),
        parallel=ParallelConfig(pp=16, ep=8, activation_checkpointing="none"),
        train=TrainConfig(
            seq_len=4096,
            micro_batch_size=1,
            global_batch_tokens=4096 * 4096,
            optimizer="sharded",  # ZeRO-1: what the layout's plan holds (docs/plan.md)
        ),
    )


PRESETS: dict[str, Callable[[], RunConfig]] = {
    "tiny": tiny,
    "demo": demo,
    **{name: functools.partial(_olmoe, name) for name in _OLMOE},
    **{name: functools.partial(qwen3_moe, name) for name in ("qwen3-moe-tiny", "qwen3-30b-a3b")},
    **{name: functools.partial(mixtral, name) for name in ("mixtral-tiny", "mixtral-8x7b")},
    "trillion-1.2t": functools.partial(_trillion, "trillion-1.2t", 256),
    "trillion-2.4t": functools.partial(_trillion, "trillion-2.4t", 512),
}


def get_preset(name: str) -> RunConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
    return PRESETS[name]()


def load_config(preset: str | None = None, path: str | Path | None = None) -> RunConfig:
    """The config of a --preset, a YAML file, or both. A YAML lists only the fields it changes,
    over its base: another YAML named by `base:` (relative to the file; chains allowed, a cycle
    is an error), or at the chain's root a preset named by `preset:` (or the `preset` argument:
    naming another is an error), else RunConfig's defaults. The mappings merge field by field,
    the given file last, and the whole is validated once."""
    if path is None:
        return get_preset(preset or "demo")
    chain = yaml_chain(path)
    root, root_data = chain[-1]
    named = root_data.pop("preset", None)
    if named is not None and not isinstance(named, str):
        raise ValueError(f"preset ({named!r}) in {root} must be a preset name")
    if named is not None and preset is not None and named != preset:
        raise ValueError(
            f"--preset {preset} and the `preset: {named}` of {root} disagree; drop one of them"
        )
    merged = functools.reduce(merge, [data for _, data in reversed(chain)], {})
    base = named or preset
    return layer(get_preset(base) if base else RunConfig(), merged)


def names_field(key: str, path: str | Path | None, overrides: list[str]) -> bool:
    """Whether the user sets `key` ("section.field") themselves: the YAML at `path` or a base
    it names lists it, or an override does; a field neither names keeps its preset's value."""
    section, _, name = key.partition(".")
    for _, data in yaml_chain(path) if path is not None else []:
        if isinstance(data.get(section), dict) and name in data[section]:
            return True
    return any(item.partition("=")[0].strip() == key for item in overrides)


def yaml_chain(path: str | Path) -> list[tuple[Path, dict]]:
    """(file, its mapping without `base:`) for a YAML and each base it names in turn, the file
    itself first."""
    chain: list[tuple[Path, dict]] = []
    path = Path(path)
    while True:
        data = read_yaml(path)
        if not isinstance(data, dict):
            raise ValueError(f"config file {path} must hold a mapping of sections")
        chain.append((path, data))
        base = data.pop("base", None)
        if base is None:
            return chain
        if not isinstance(base, str) or "preset" in data:
            raise ValueError(
                f"base ({base!r}) in {path} must be the path of another YAML, and a file names "
                "either a base YAML or a preset, not both"
            )
        path = path.parent / base
        if not path.is_file():
            raise ValueError(f"the base {base} of {chain[-1][0]} does not exist ({path})")
        if path.resolve() in [p.resolve() for p, _ in chain]:
            names = " -> ".join(str(p) for p, _ in chain)
            raise ValueError(f"config files name each other as base in a cycle: {names} -> {path}")
