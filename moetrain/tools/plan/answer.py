"""The ranking as a user reads it: a header that states the batch and the units, the table, the
answer in plain words with its caveats, and the best row's `moetrain train` command with its
launch and dry-run lines (the dry run prints the row's predicted peak); `details` adds what the
model assumes, in its own terms, and `to_json` all of it. Nothing here imports torch.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from moetrain.config import RunConfig
from moetrain.model.flops import flops_per_token, param_counts
from moetrain.tools.plan import compare_report
from moetrain.tools.plan.layout import GIB, OVERHEAD_GIB
from moetrain.tools.plan.ranking import Ranked, Ranking
from moetrain.tools.plan.run_memory import run_memory

FAMILIES = ("all experts on each GPU", "resident experts", "FSDP2", "HSDP")
CLOSE = 0.05  # rows nearer than this are within what the model can tell apart
RDZV_PORT = 29500


@dataclass(frozen=True)
class Source:
    """How the plan's config was given, so that `train` loads the same one: --preset, a config
    file, the user's --set items and those the planner added (a vocabulary it assumed)."""

    preset: str | None
    path: str | None
    sets: tuple[str, ...] = ()
    assumed: tuple[str, ...] = ()

    def train_command(self, overrides: tuple[str, ...]) -> str:
        words = ["moetrain", "train"] + ["--preset", self.preset] * bool(self.preset)
        words += [self.path] if self.path else []
        for item in (*self.sets, *self.assumed, *overrides):
            words += ["--set", item]
        return shlex.join(words)


def header(config: RunConfig, ranking: Ranking, batch_source: str) -> list[str]:
    """What was planned, the global batch and where it comes from, and the units."""
    c, tokens, seq = ranking.setting.cluster, ranking.setting.global_batch_tokens, config.train
    counts = param_counts(config)
    num_fit = sum(r.row.fits for r in ranking.rows)
    return [
        f"{config.name}: {counts.total / 1e9:,.1f}B parameters, {counts.active / 1e9:,.2f}B "
        f"active a token; {c.num_gpus} x {c.gpu.name}, {c.memory_bytes / GIB:.0f} GiB usable "
        f"each, {c.gpus_per_node} GPUs a node",
        f"global batch: {tokens:,} tokens a step = {tokens // seq.seq_len:,} sequences of "
        f"{seq.seq_len:,} tokens ({batch_source})",
        f"micro-batch: the sequences one GPU runs in a forward and backward (x {seq.seq_len:,} "
        "tokens); m: micro-batches a step on each GPU",
        f"{len(ranking.rows)} configurations ranked, {num_fit} fit: DDP with all experts on each "
        "GPU (ep 1) or resident experts (ep > 1), each with ZeRO-1 or the replicated AdamW and "
        "pp; FSDP2; HSDP",
    ]


def shown(ranking: Ranking, top: int) -> list[tuple[int, Ranked]]:
    """(place, row) of the first `top` rows and of each family's best below them."""
    out = list(enumerate(ranking.rows[:top], 1))
    below = {ranking.rows.index(b) + 1: b for b in map(ranking.best_of, FAMILIES) if b}
    return out + sorted((place, r) for place, r in below.items() if place > top)


def table(ranking: Ranking, top: int) -> Any:
    from rich.table import Table

    seq = ranking.rows[0].config.train.seq_len if ranking.rows else 1
    out = Table(show_edge=False)
    heads = ["#", "layout", "optimizer", "micro-batch", "ckpt", "m", "tok/s/GPU", "TFLOP/s/GPU"]
    for name in heads + ["step s", "peak GiB", "fits"]:
        left = name in ("layout", "optimizer", "ckpt")
        out.add_column(name, justify="left" if left else "right", no_wrap=True)
    for place, r in shown(ranking, top):
        mb = r.layout.micro_batch_size
        out.add_row(
            str(place),
            r.describe(),
            r.optimizer,
            f"{mb} ({mb * seq:,} tok)",
            r.layout.activation_checkpointing,
            str(r.row.microbatches),
            f"{r.row.tokens_per_s:,.0f}",
            f"{r.row.tflops:,.0f}",
            f"{r.row.step_s:.3f}",
            f"{r.row.peak_bytes / GIB:,.1f}",
            "yes" if r.row.fits else "[red]no[/red]",
        )
    return out


def verdict(ranking: Ranking) -> list[str]:
    """The answer in a sentence: the best row against each other family's best."""
    rows = ranking.rows
    if not rows:
        return ["Answer: no configuration of this model divides these GPUs and this batch."]
    best = rows[0]
    if not best.row.fits:
        return [
            f"Answer: nothing fits {best.row.memory_limit / GIB:.0f} GiB; the smallest, "
            f"{best.describe()}, needs {best.row.peak_bytes / GIB:.1f} GiB: more GPUs, more "
            "memory a GPU (--gpu-memory) or a smaller global batch"
        ]
    others = []
    for family in FAMILIES:
        other = ranking.best_of(family)
        if family != best.family and other is not None and other.row.fits:
            ratio = best.row.tokens_per_s / other.row.tokens_per_s
            others.append(f"{ratio:.2f}x {other.describe()} (#{rows.index(other) + 1})")
    against = "; ".join(others) if others else "no other family fits"
    what = best.describe() + ("" if best.variant.fsdp else f" with {best.optimizer}")
    return [
        f"Answer: {what}, micro-batch {best.layout.micro_batch_size}"
        f", checkpointing {best.layout.activation_checkpointing}: {best.row.tokens_per_s:,.0f} "
        f"tokens/s a GPU at {ranking.setting.global_batch_tokens:,} tokens a step; {against}."
    ]


def caveats(ranking: Ranking, calibrated: str | None, source: Source) -> list[str]:
    """What the answer rests on, one plain line each."""
    s, c = ranking.setting, ranking.setting.cluster
    rows = ranking.rows
    rates = (
        f"rates calibrated on a GPU ({calibrated.split(' (')[0]})"
        if calibrated
        else f"the {c.gpu.name} datasheet's rates at the default efficiencies (calibrate with "
        "`moetrain bench --calibrate` on one)"
    )
    out = [f"modelled, not measured: {rates}; kernel launch gaps and host overheads left out"]
    if len(rows) > 1 and rows[1].row.fits and rows[0].row.fits:
        gap = rows[0].row.tokens_per_s / rows[1].row.tokens_per_s - 1
        if gap < CLOSE:
            out.append(
                f"#2 ({rows[1].describe()} with {rows[1].optimizer}) is {gap:.1%} slower, closer "
                "than the model can tell: measure both"
            )
    out.append(_overlap(s.overlap))
    if any(r.layout.ep > 1 for r in rows):
        out.append(
            f"the busiest expert rank gets {s.expert_load:g}x the mean routed rows "
            f"(--expert-load; {s.load_source})"
        )
    dropless = rows and rows[0].layout.ep > 1 and rows[0].expert_rows.dispatcher == "all_to_all"
    if dropless and s.expert_load > 1:
        out.append(
            "memory of the dropless dispatcher's expert buffers at even routing: the busiest "
            f"rank holds up to {s.expert_load:g}x those rows"
        )
    out.append(
        f"memory: eager activations x {c.activation_factor:g} and {c.overhead_gib:g} GiB for "
        f"the CUDA context and buffers, against {c.memory_bytes / GIB:.0f} GiB"
    )
    for item in source.assumed:
        field, _, value = item.partition("=")
        out.append(f"{field}: the config leaves it to the tokenizer; planned (and set below) at "
                   f"{value}: put in yours")  # fmt: skip
    return out + list(ranking.not_ranked)


def _overlap(overlap) -> str:
    p = overlap.pairs

    def hidden(name: str) -> str:
        return f"{p[name].eta:.0%} hidden" if p[name].eta > 0 else "not hidden"

    where = "assumed, no overlap file" if overlap.source.startswith("assumed") else (
        "pairs measured on one GPU with stand-in kernels, --details names the file")  # fmt: skip
    return (
        f"overlap ({where}): FSDP2's gathers {hidden('fsdp_gather')}, gradient reductions "
        f"{hidden('fsdp_reduce_scatter')}, expert all-to-alls {hidden('a2a')}"
    )


def commands(best: Ranked, source: Source, gpus: int, node: int) -> list[str]:
    """The launch line of the best row and the dry run that prints its memory."""
    train = source.train_command(best.overrides)
    if gpus == 1:
        launch = ["Run it:", f"  {train}"]
    elif gpus <= node:
        launch = ["Run it:", f"  torchrun --standalone --nproc-per-node {gpus} -m {train}"]
    else:
        nodes = -(-gpus // node)
        uneven = "" if gpus % node == 0 else f"; on the last, --nproc-per-node {gpus % node}"
        launch = [
            f"Run it on each of the {nodes} nodes (HOST: the first node's address{uneven}):",
            f"  torchrun --nnodes {nodes} --nproc-per-node {node} --rdzv-backend c10d "
            f"--rdzv-endpoint HOST:{RDZV_PORT} -m {train}",
        ]
    rank, peak = dry_run_rank(best), best.row.peak_bytes / GIB
    lay, stage, m = best.layout, best.peak_stage, best.row.microbatches
    dry = run_memory(best.config, lay, stage, m, overhead=int(OVERHEAD_GIB * GIB)).peak / GIB
    if f"{dry:.2f}" == f"{peak:.2f}":
        check = f"the dry run prints the predicted peak, {peak:.2f} GiB on rank {rank}"
    else:
        check = (
            f"the dry run prints {dry:.2f} GiB on rank {rank}: eager activations and "
            f"{OVERHEAD_GIB:g} GiB overhead, where the plan's {peak:.2f} GiB has its own"
        )
    return launch + [
        f"Check it first, on any machine ({check}):",
        f"  {dry_run_command(best, source, gpus)}",
    ]


def dry_run_rank(best: Ranked) -> int:
    """A rank of the stage at the peak (ranks are stage x dp + dp rank)."""
    return best.peak_stage * best.layout.dp


def dry_run_command(best: Ranked, source: Source, gpus: int) -> str:
    return (
        f"{source.train_command(best.overrides)} --dry-run --world-size {gpus} "
        f"--rank {dry_run_rank(best)} --device cuda"
    )


def details(config: RunConfig, ranking: Ranking) -> list[str]:
    """The model's assumptions in its own terms and where the best row's step goes."""
    lines = ["model assumptions:", *(f"  {a}" for a in compare_report.assumptions(
        config, ranking.setting))]  # fmt: skip
    if ranking.rows:
        best = ranking.rows[0].row
        comm = ", ".join(f"{k} {v:.3f}" for k, v in best.comm.items())
        lines += [
            f"#1's step: {best.step_s:.3f} s = compute {best.compute_s:.3f} + bubble "
            f"{best.bubble_s:.3f} + exposed communication {best.exposed_s:.3f} (all of it, "
            f"hidden or not: {comm})",
            f"#1's expert buffers on a rank: {ranking.rows[0].expert_rows.describe()}",
        ]
    c = ranking.setting.cluster
    if c.num_gpus == 8 and c.gpu.name == "b300":
        lines += compare_report.reference(config, ranking.setting)[0]
    return lines


def to_json(
    config: RunConfig, ranking: Ranking, source: Source, top: int, calibrated: str | None
) -> dict[str, Any]:
    s, c = ranking.setting, ranking.setting.cluster
    counts = param_counts(config)

    def row(place: int, r: Ranked) -> dict[str, Any]:
        return {"rank": place} | r.to_dict() | {
            "train_command": source.train_command(r.overrides),
            "dry_run_command": dry_run_command(r, source, c.num_gpus),
        }  # fmt: skip

    best = ranking.rows[0] if ranking.rows else None
    return {
        "config": config.name,
        "total_params": counts.total,
        "active_params": counts.active,
        "flops_per_token": flops_per_token(config),
        "gpu": c.gpu.name,
        "num_gpus": c.num_gpus,
        "gpus_per_node": c.gpus_per_node,
        "memory_limit_gib": c.memory_bytes / GIB,
        "calibration": calibrated,
        "global_batch_tokens": s.global_batch_tokens,
        "seq_len": config.train.seq_len,
        "expert_load": s.expert_load,
        "num_ranked": len(ranking.rows),
        "num_fitting": sum(r.row.fits for r in ranking.rows),
        "answer": verdict(ranking),
        "caveats": caveats(ranking, calibrated, source),
        "assumptions": compare_report.assumptions(config, s),
        "best": None if best is None else row(1, best),
        "commands": [] if best is None else commands(best, source, c.num_gpus, c.gpus_per_node),
        "rows": [row(place, r) for place, r in shown(ranking, top)],
    }
