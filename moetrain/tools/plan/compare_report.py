"""`moetrain bench --project`'s comparison of resident experts and FSDP2 as text (`moetrain
plan`'s is plan/answer.py): each variant's best feasible point, the answer (which wins, by how
much), the reference's own comparison on B300, the compute-scale sweep, the assumptions, and the
JSON of the whole sweep. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moetrain.config import RunConfig
from moetrain.tools.plan.compare import Row, best, sweep
from moetrain.tools.plan.layout import GIB
from moetrain.tools.plan.rank_compute import FSDP, RESIDENT, VARIANTS, Setting

REFERENCE_TOKENS_PER_S = {"fsdp2": 19_400, "resident": 52_000}  # 8 B300, the reference's 47B
REFERENCE_TOLERANCE = 0.15
SCALES = (1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5)


def assumptions(config: RunConfig, setting: Setting) -> list[str]:
    """What the rows rest on, one line each, printed above the table."""
    c = setting.cluster
    if setting.measured:
        parts = []
        for key, m in setting.measured.items():
            products, memory = setting.ratios(m.gpu)
            how = (
                f"x {setting.compute_scale:g} (--compute-scale)"
                if setting.compute_scale is not None
                else f"products x {products:.2f} (BF16), memory-bound x {memory:.2f} (HBM)"
            )
            parts.append(
                f"{key} measured on {m.gpu} at {m.tokens:,} tokens, on {c.gpu.name}: {how}"
            )
        compute = "compute: " + "; ".join(parts)
    else:
        compute = f"compute: the planner's roofline on {c.gpu.name}'s datasheet (not measured)"
    dispatcher = (
        f"dispatcher index work {1e3 * setting.index_work_s:.2f} ms and host sync "
        f"{1e3 * setting.host_sync_s:.2f} ms per MoE layer ({setting.dispatcher})"
        if setting.index_work_s or setting.host_sync_s
        else f"dispatcher index work and host sync: not measured, 0 ({setting.dispatcher})"
    )
    return [
        compute,
        f"links: {c.gpus_per_node} GPUs a node, NVLink {c.nvlink_bps / 1e9:.0f} and network "
        f"{c.internode_bps / 1e9:.0f} GB/s per GPU and direction at {c.link_efficiency:g} of that "
        "(--link-efficiency); all-to-alls slower for small messages (plan/links.py)",
        setting.overlap.describe(),
        f"expert load: the busiest rank takes {setting.expert_load:g} x T K rows "
        f"({setting.load_source})",
        dispatcher,
        f"global batch {setting.global_batch_tokens:,} tokens; memory: the planner's model "
        f"(eager activations x {c.activation_factor:g}, {c.overhead_gib:g} GiB overhead) against "
        f"{c.memory_bytes / GIB:.0f} GiB",
    ]


def markdown(rows: list[Row]) -> str:
    """One line per row: its layout, point, speed, where the time goes, its memory."""
    head = [
        "variant", "GPU", "layout", "micro-batch", "ckpt", "m", "tok/s/GPU", "TFLOP/s",
        "step s = compute + bubble + exposed comm", "comm s (all)", "peak GiB", "fits",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r.variant,
            f"{r.gpus} x {r.gpu}",
            f"pp {r.pp}, dp {r.dp}, ep {r.ep}",
            f"{r.tokens:,}",
            r.checkpointing,
            str(r.microbatches),
            f"{r.tokens_per_s:,.0f}",
            f"{r.tflops:,.0f}",
            f"{r.step_s:.3f} = {r.compute_s:.3f} + {r.bubble_s:.3f} + {r.exposed_s:.3f}",
            f"{sum(r.comm.values()):.3f}",
            f"{r.peak_bytes / GIB:.1f} / {r.memory_limit / GIB:.0f}",
            "yes" if r.fits else "no",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def answer(chosen: dict[str, Row]) -> list[str]:
    """The fastest fitting resident-expert and FSDP2 rows and their ratio."""
    r, f = _fastest(chosen, fsdp=False), _fastest(chosen, fsdp=True)
    if r is None or f is None:
        missing = "resident experts" if r is None else "FSDP2"
        return [f"no {missing} layout fits {next(iter(chosen.values())).gpu}'s memory"]
    winner = "resident experts" if r.tokens_per_s >= f.tokens_per_s else "FSDP2"
    return [
        f"{r.gpus} x {r.gpu}: best resident ({r.variant}) {r.tokens_per_s:,.0f} tok/s/GPU, best "
        f"FSDP ({f.variant}) {f.tokens_per_s:,.0f}: {r.tokens_per_s / f.tokens_per_s:.2f}x, "
        f"{winner} win"
    ]


def reference(config: RunConfig, setting: Setting) -> tuple[list[str], list[Row]]:
    """The reference's comparison on `setting` (8 B300): its FSDP baseline pinned to 8k-token
    micro-batches against the best resident-expert variant, next to 19,400 and 52,000."""
    fixed = dataclasses.replace(setting, microbatch_tokens=(8192,))
    fsdp = best(sweep(config, fixed, (VARIANTS["fsdp2"],))).get("fsdp2")
    resident = best(sweep(config, setting, RESIDENT[:1])).get("resident")
    rows = [r for r in (fsdp, resident) if r is not None]
    lines = []
    for name, row in (("fsdp2", fsdp), ("resident", resident)):
        want = REFERENCE_TOKENS_PER_S[name]
        if row is None:
            lines.append(f"reference {name}: no point of the sweep exists")
            continue
        off = row.tokens_per_s / want - 1
        ok = "within" if abs(off) <= REFERENCE_TOLERANCE else "outside"
        lines.append(
            f"reference {name}: {row.tokens_per_s:,.0f} tok/s/GPU against {want:,} ({off:+.0%}, "
            f"{ok} 15%; {row.tokens:,} tokens, {row.checkpointing}, {row.peak_bytes / GIB:.0f} "
            f"GiB{'' if row.fits else ', does not fit'})"
        )
    if fsdp is not None and resident is not None:
        ratio = resident.tokens_per_s / fsdp.tokens_per_s
        lines.append(f"reference ratio: {ratio:.2f}x (reported: 2.68x)")
    return lines, rows


def scale_sweep(config: RunConfig, setting: Setting, scales=SCALES) -> list[str]:
    """The reference pair and the best of each layout as the compute scale moves."""
    lines = ["| compute scale | best resident tok/s | best FSDP2 tok/s | ratio | reference ratio |"]
    lines.append("|---|---|---|---|---|")
    for scale in scales:
        scaled = dataclasses.replace(setting, compute_scale=scale)
        chosen = best(sweep(config, scaled, (*RESIDENT[:1], *FSDP[:4])))
        res = _fastest(chosen, fsdp=False)
        fs = _fastest(chosen, fsdp=True)
        ref = reference(config, scaled)[1]
        pair = f"{ref[1].tokens_per_s / ref[0].tokens_per_s:.2f}x" if len(ref) == 2 else "-"
        cells = [f"{scale:g}", _speed(res), _speed(fs)]
        cells.append(f"{res.tokens_per_s / fs.tokens_per_s:.2f}x" if res and fs else "-")
        lines.append("| " + " | ".join([*cells, pair]) + " |")
    return lines


def _fastest(chosen: dict[str, Row], fsdp: bool) -> Row | None:
    rows = [r for r in chosen.values() if r.fits and VARIANTS[r.variant].fsdp == fsdp]
    return max(rows, key=lambda r: r.tokens_per_s, default=None)


def _speed(row: Row | None) -> str:
    return "no fit" if row is None else f"{row.tokens_per_s:,.0f} ({row.variant})"


def to_json(config: RunConfig, setting: Setting, rows: list[Row]) -> dict[str, Any]:
    """The whole sweep, each variant's chosen row and the assumptions."""
    return {
        "config": config.name,
        "gpu": setting.cluster.gpu.name,
        "gpus": setting.cluster.num_gpus,
        "assumptions": assumptions(config, setting),
        "best": {name: row.to_dict() for name, row in best(rows).items()},
        "sweep": [row.to_dict() for row in rows],
    }
