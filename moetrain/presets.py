"""Named run configurations. Each preset is a function returning a `RunConfig`.

`tiny` runs on a laptop CPU in seconds and is what tests use; `demo` is the default of
`moetrain train` (a few minutes on a 2-core CPU); the others are the benchmark architectures of
docs/benchmarks.md: the OLMoE block (qk-norm, RoPE theta 10,000, untied embeddings, softmax
router without top-k renormalization, SwiGLU experts, every layer MoE, vocabulary 50,304).
`ref-47b` is that block at the reference's 47B expert-scaling model, for the 8-GPU projection;
`trillion-1.2t` and `trillion-2.4t` are that block at the reference trillion-scale runs' totals,
for `moetrain plan` and `moetrain train --dry-run` (docs/plan.md).
"""

from __future__ import annotations

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


def _olmoe(
    name: str,
    *,
    d_model: int,
    num_layers: int,
    num_experts: int,
    top_k: int,
    expert_hidden: int,
    seq_len: int,
    micro_batch_size: int,
    num_heads: int = 16,
) -> RunConfig:
    return RunConfig(
        name=name,
        model=ModelConfig(
            vocab_size=50304, d_model=d_model, num_layers=num_layers, num_heads=num_heads
        ),
        moe=MoEConfig(num_experts=num_experts, top_k=top_k, expert_hidden=expert_hidden),
        train=TrainConfig(seq_len=seq_len, micro_batch_size=micro_batch_size),
    )


def small() -> RunConfig:
    return _olmoe(
        "small",
        d_model=1024,
        num_layers=8,
        num_experts=64,
        top_k=8,
        expert_hidden=512,
        seq_len=2048,
        micro_batch_size=8,
    )


def olmoe8() -> RunConfig:
    return _olmoe(
        "olmoe8",
        d_model=2048,
        num_layers=8,
        num_experts=64,
        top_k=8,
        expert_hidden=1024,
        seq_len=4096,
        micro_batch_size=4,
    )


def olmoe_1b_7b() -> RunConfig:
    return _olmoe(
        "olmoe-1b-7b",
        d_model=2048,
        num_layers=16,
        num_experts=64,
        top_k=8,
        expert_hidden=1024,
        seq_len=4096,
        micro_batch_size=4,
    )


def _scale(num_experts: int) -> Callable[[], RunConfig]:
    def preset() -> RunConfig:
        return _olmoe(
            f"scale-E{num_experts}",
            d_model=1024,
            num_layers=12,
            num_experts=num_experts,
            top_k=4,
            expert_hidden=1024,
            seq_len=4096,
            micro_batch_size=8,
        )

    return preset


def ref_47b() -> RunConfig:
    """The reference's 47B expert-scaling model (128 experts, top-4) in the OLMoE block: 47.06B
    parameters, 3.18B active counting the input embedding as the reference does. Its
    unpublished dimensions are derived from the reported totals in docs/plan.md."""
    return _olmoe(
        "ref-47b",
        d_model=4096,
        num_layers=20,
        num_heads=32,
        num_experts=128,
        top_k=4,
        expert_hidden=1440,
        seq_len=4096,
        micro_batch_size=4,
    )


def _trillion(name: str, num_experts: int) -> RunConfig:
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
        train=TrainConfig(seq_len=4096, micro_batch_size=1, global_batch_tokens=4096 * 4096),
    )


def trillion_1_2t() -> RunConfig:
    """The reference trillion-scale run's totals in the OLMoE block: 1.195T parameters, 58.57B
    active per token (reported: about 1.2T and 58.36B). Random routing as in the reference
    measurement, the dropless exact-split dispatcher, pp 16 x ep 8 without checkpointing; the
    arithmetic and the layout's choice: docs/plan.md."""
    return _trillion("trillion-1.2t", 256)


def trillion_2_4t() -> RunConfig:
    """The reference capacity run's scale: the same model with 512 experts, 2.37T parameters."""
    return _trillion("trillion-2.4t", 512)


PRESETS: dict[str, Callable[[], RunConfig]] = {
    "tiny": tiny,
    "demo": demo,
    "small": small,
    "olmoe8": olmoe8,
    "olmoe-1b-7b": olmoe_1b_7b,
    **{f"scale-E{e}": _scale(e) for e in (8, 16, 32, 64, 128)},
    "ref-47b": ref_47b,
    "trillion-1.2t": trillion_1_2t,
    "trillion-2.4t": trillion_2_4t,
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
    merged: dict = {}
    for _, data in reversed(chain):
        for key, values in data.items():
            if isinstance(values, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **values}
            else:
                merged[key] = values
    base = named or preset
    return layer(get_preset(base) if base else RunConfig(), merged)


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
