"""The dry run: one rank's model on the meta device, with the right shapes, and nothing allocated."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from moetrain.cli import build_parser
from moetrain.config.presets import get_preset
from moetrain.model.flops import param_counts
from moetrain.tools import plan as P
from moetrain.tools.dry_run import (
    build_rank_model,
    dry_run,
    layout_from_config,
    run_dry_run,
)


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_dry_run_allocates_nothing(monkeypatch):
    def no_cuda(*args, **kwargs):
        raise AssertionError("the dry run touched CUDA")

    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda)
    config = get_preset("olmoe-1b-7b")  # 6.9B parameters: 13.8 GB in bf16 if materialized
    layout = P.Layout(pp=1, dp=1, ep=1, micro_batch_size=4)
    build_rank_model(config, layout, 0)  # pay one-time library imports before measuring
    gc.collect()
    before = _rss_bytes() if Path("/proc/self/status").exists() else None
    model = build_rank_model(config, layout, 0)
    report = dry_run(config, layout, 0)
    if before is not None:
        assert _rss_bytes() - before < 256 * 2**20
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors and all(t.device.type == "meta" for t in tensors)
    assert report.num_params == param_counts(config).total
    assert not torch.cuda.is_initialized()


def test_per_rank_shapes_with_ep4_pp2():
    config = get_preset("small")  # 8 layers, 64 experts, d_model 1024, expert hidden 512
    layout = P.Layout(pp=2, dp=4, ep=4, micro_batch_size=1)
    V, D, F = 50304, 1024, 512
    first = build_rank_model(config, layout, 0)  # stage 0, ep rank 0
    assert sorted(first.blocks) == ["0", "1", "2", "3"]
    assert first.embed.weight.shape == (V, D)
    assert first.norm is None and first.lm_head is None
    experts = first.blocks["0"].ffn.experts
    assert experts.w_up_eD2F.shape == (16, D, 2 * F)
    assert experts.w_down_eFD.shape == (16, F, D)
    assert experts.expert_offset == 0
    assert first.blocks["0"].ffn.router.gate.weight.shape == (64, D)  # the router is replicated

    last = build_rank_model(config, layout, 7)  # stage 1, dp rank 3, ep rank 3
    assert sorted(last.blocks) == ["4", "5", "6", "7"]
    assert last.embed is None
    assert last.norm.weight.shape == (D,) and last.lm_head.weight.shape == (V, D)
    assert all(b.ffn.experts.expert_offset == 48 for b in last.blocks.values())
    assert build_rank_model(config, layout, 5).blocks["4"].ffn.experts.expert_offset == 16
    assert all(p.dtype == torch.bfloat16 for p in last.parameters())

    report = dry_run(config, layout, 5)
    assert (report.stage, report.dp_rank, report.ep_rank) == (1, 1, 1)
    assert report.layers == range(4, 8) and report.experts == range(16, 32)
    up = next(r for r in report.rows if r.name == "blocks.[4-7].ffn.experts.w_up_eD2F")
    assert up.shape == (16, D, 2 * F) and up.count == 4 and up.kind == "expert"


@pytest.mark.parametrize(
    "overrides", [[], ["model.dense_layers=[2,3,5]", "model.qk_norm=per_head"]]
)
def test_ranks_together_hold_the_model_once(overrides):
    """Each rank's model holds what the planner counts for it (dense layers at any positions
    included), and the ranks together hold the model once."""
    config = get_preset("small").with_overrides(overrides)
    layout = P.Layout(pp=2, dp=4, ep=4, micro_batch_size=1)
    # one dp group of a stage holds each expert once and every dense parameter ep times
    dense = experts = 0
    for rank in range(layout.world_size):
        stage, dp_rank, _ = P.rank_coordinates(layout, rank)
        if dp_rank >= layout.ep:
            continue
        rank_dense = rank_experts = 0
        for name, p in build_rank_model(config, layout, rank).named_parameters():
            if name.endswith(("w_up_eD2F", "w_down_eFD")):
                rank_experts += p.numel()
            else:
                rank_dense += p.numel()
        planned = P.rank_params(config, pp=layout.pp, ep=layout.ep, stage=stage)
        assert (rank_dense, rank_experts) == (planned.dense, planned.experts), rank
        experts += rank_experts
        dense += rank_dense if dp_rank == 0 else 0
    assert dense + experts == param_counts(config).total


def test_dry_run_of_the_trillion_preset_agrees_with_the_planner(capsys):
    config = get_preset("trillion-1.2t")
    layout = layout_from_config(config, 512)  # pp 16, dp 32, ep 8
    for rank in (0, 511):
        report = dry_run(config, layout, rank)  # asserts its count equals plan.rank_params
        mem = P.stage_memory(config, layout, report.stage, report.num_microbatches)
        assert report.param_bytes == mem.params
        assert report.memory == mem
    args = build_parser().parse_args(
        ["train", "--preset", "trillion-1.2t", "--dry-run", "--world-size", "512", "--rank", "511"]
    )
    assert run_dry_run(config, args) == 0
    out = capsys.readouterr().out
    assert "rank 511 of 512" in out and "stage 15, layers 98-103" in out
    assert "experts 224-255" in out and "lm_head.weight" in out
    assert "Nothing was allocated" in out


def test_dry_run_shows_the_expert_buffer_rows(capsys):
    """olmoe-1b-7b at ep 8: exact splits (dropless) take T K rows a rank per MoE layer; NoSync
    with a capacity factor of 1.25 allocates ep blocks of ceil(1.25 T K / ep) rows."""
    T, K = 4 * 4096, 8
    for overrides, dispatcher, rows in (
        ([], "all_to_all", T * K),
        (["moe.capacity_factor=1.25"], "no_sync", 8 * 20480),
    ):
        config = get_preset("olmoe-1b-7b").with_overrides(["parallel.ep=8", *overrides])
        report = dry_run(config, layout_from_config(config, 8), 3)
        assert report.expert_rows == P.ExpertRows(dispatcher, T, T * K, rows)
        args = build_parser().parse_args(
            ["train", "--preset", "olmoe-1b-7b", "--dry-run", "--world-size", "8"]
        )
        assert run_dry_run(config, args) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert f"{rows:,} rows per MoE layer and micro-batch" in out and dispatcher in out


def test_dry_run_counts_muons_state_and_flops(capsys):
    """olmoe8 at dp 8 x ep 8, muon_sharded: each row names its optimizer, the optimizer shards
    shrink by Muon's one buffer, and the rank's Newton-Schulz FLOPs are its 8 experts of every
    layer whole (edp 1) plus an eighth of the attention matrices."""
    from moetrain.model.flops import muon_block_flops

    base = get_preset("olmoe8").with_overrides(["parallel.ep=8"])
    muon = base.with_overrides(["train.optimizer=muon_sharded"])
    layout = layout_from_config(muon, 8)
    report = dry_run(muon, layout, 5)
    by_name = {row.name: row.updated_by for row in report.rows}
    assert by_name["blocks.[0-7].ffn.experts.w_up_eD2F"] == "muon"
    assert by_name["blocks.[0-7].attn.q_proj.weight"] == "muon"
    assert by_name["embed.weight"] == by_name["blocks.[0-7].ffn.router.gate.weight"] == "adamw"
    assert {row.updated_by for row in dry_run(base, layout, 5).rows} == {"adamw"}
    assert report.memory.optimizer < dry_run(base, layout, 5).memory.optimizer
    layers = muon.model.num_layers
    expected = layers * muon_block_flops(muon, "experts") // 8
    expected += layers * muon_block_flops(muon, "moe") // 8
    assert report.muon_flops == expected
    args = build_parser().parse_args(["train", "--dry-run", "--world-size", "8", "--rank", "5"])
    assert run_dry_run(muon, args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"Muon: {expected / 1e12:,.2f} TFLOP of Newton-Schulz products" in out


def test_bad_rank_or_layout_is_a_value_error():
    config = get_preset("small")
    with pytest.raises(ValueError, match="rank"):
        dry_run(config, P.Layout(pp=2, dp=4, ep=4, micro_batch_size=1), 8)
    with pytest.raises(ValueError, match=r"parallel\.ep \(3\)"):
        dry_run(config, P.Layout(pp=1, dp=3, ep=3, micro_batch_size=1), 0)


def test_the_dry_run_lists_the_parameters_a_run_on_the_device_has(tmp_cache, tmp_path, capsys):
    """precision.param_dtype auto: the CPU trains in fp32 and the dry run there says so, with
    the Trainer's parameter bytes; `--device cuda` shows a GPU run's bf16 on any machine."""
    from moetrain.cli import main
    from moetrain.tools.dry_run import on_device
    from moetrain.train.trainer import Trainer

    config = get_preset("tiny")
    trainer = Trainer(config, tmp_path, device="cpu", progress=False)
    params = list(trainer.model.parameters())
    trainer.shutdown()
    report = dry_run(on_device(config, "cpu"), layout_from_config(config, 1), 0)
    assert {p.dtype for p in params} == {torch.float32}
    assert {row.dtype for row in report.rows} == {"float32"}
    assert report.param_bytes == sum(p.numel() * p.element_size() for p in params)
    dtypes = {"cpu": ("float32", "bfloat16"), "cuda": ("bfloat16", "float32")}  # shown, not
    default = "cuda" if torch.cuda.is_available() else "cpu"
    for flags, device in (
        ([], default),
        (["--device", "cpu"], "cpu"),
        (["--device", "cuda"], "cuda"),
    ):
        capsys.readouterr()
        assert main(["train", "--preset", "tiny", "--dry-run", *flags]) == 0
        out = capsys.readouterr().out
        shown, absent = dtypes[device]
        assert f"tiny on {device}" in out and shown in out and absent not in out
