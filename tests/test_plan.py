"""The planner: its byte counts against materialized models, layout validation, enumeration, the
trillion-scale preset and its plan on 512 B300 (the number docs/plan.md quotes)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from moetrain.config.presets import PRESETS, get_preset, tiny
from moetrain.model.flops import param_counts
from moetrain.optim.buckets import SHARD_ALIGN
from moetrain.optim.param_groups import build_param_groups, param_kind
from moetrain.optim.sharded import ShardedAdamW
from moetrain.parallel.parallelize import apply_activation_checkpointing
from moetrain.tools import plan as P
from moetrain.tools.dry_run import build_rank_model

DOCS = Path(__file__).resolve().parents[1] / "docs" / "plan.md"


def _materialize(config, layout, rank):
    model = build_rank_model(config, layout, rank)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _zero1_bytes(model: nn.Module, dp: int, ep: int) -> tuple[int, int]:
    """(reduce-scatter output bytes, optimizer bytes) of one rank of ShardedAdamW, emulated
    without processes: each sync group's parameters (dense over dp, experts over dp / ep) in one
    flat bucket padded to equal shards of a multiple of SHARD_ALIGN; the rank's shard gets an
    fp32 master and AdamW's state after one step (its 0-dim `step` counters left out), and a
    gradient shard in fp32 (`precision.grad_dtype`'s default) when the group has more than one
    rank."""
    grad_shards, masters = 0, []
    for is_expert, size in ((False, dp), (True, dp // ep)):
        params = [
            p for n, p in model.named_parameters() if (param_kind(n) == "expert") == is_expert
        ]
        flat = torch.cat([p.detach().float().reshape(-1) for p in params])
        shard = flat.numel()
        if size > 1:
            shard = -(-flat.numel() // (size * SHARD_ALIGN)) * SHARD_ALIGN
            grad_shards += shard * 4
        padded = nn.functional.pad(flat, (0, shard * size - flat.numel()))
        master = nn.Parameter(padded.chunk(size)[-1].clone())
        master.grad = torch.randn_like(master)
        masters.append(master)
    optimizer = torch.optim.AdamW(masters)
    optimizer.step()
    state = [t for s in optimizer.state.values() for k, t in s.items() if k != "step"]
    assert len(state) == 2 * len(masters)
    return grad_shards, _nbytes(state) + _nbytes(masters)


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("ep", [1, 2])
def test_param_grad_optimizer_bytes_match_materialized_tiny(pp, ep):
    config = tiny()
    for dp in (1, 2, 4):
        layout = P.Layout(pp=pp, dp=dp, ep=ep, micro_batch_size=1)
        tokens = config.train.seq_len * dp
        if dp % ep:
            with pytest.raises(ValueError, match=r"parallel\.ep"):
                P.validate_layout(config, layout, dp * pp, tokens)
            continue
        for stage in range(pp):
            rank = stage * dp + dp - 1  # the stage's last rank: the last expert slice
            model = _materialize(config, layout, rank)
            grad_shards, optimizer = _zero1_bytes(model, dp, ep)
            mem = P.stage_memory(config, layout, stage, num_micro=1)
            assert mem.params == _nbytes(model.parameters())
            buckets = sum(4 * p.numel() for p in model.parameters())  # fp32 gradient buckets
            assert mem.grads == buckets + grad_shards
            assert mem.optimizer == optimizer


@pytest.mark.parametrize("pp", [1, 2])
def test_memory_equals_the_sharded_optimizers_buffers_on_one_rank(pp):
    assert P.SHARD_ALIGN == SHARD_ALIGN
    config = tiny()
    layout = P.Layout(pp=pp, dp=1, ep=1, micro_batch_size=1)
    for stage in range(pp):
        model = _materialize(config, layout, stage)
        groups = build_param_groups(model, config.train)
        opt = ShardedAdamW(
            groups, dense_group=None, expert_group=None, lr=1e-3, grad_dtype=torch.float32
        )
        held = sum(
            _nbytes([b.params_flat, b.grads_flat, b.master, b.exp_avg, b.exp_avg_sq])
            for b in opt.buckets
        )
        mem = P.stage_memory(config, layout, stage, num_micro=1)
        assert held == mem.params + mem.grads + mem.optimizer


@pytest.mark.parametrize("pp", [1, 2])
def test_memory_equals_the_sharded_muons_buffers_on_one_rank(pp):
    """train.optimizer=muon_sharded: the planner's bytes are the optimizer's own buffers (AdamW's
    flat buckets with two moments, Muon's whole-matrix buckets with one momentum buffer); its
    Newton-Schulz FLOPs are model/flops.py's count of the stage's matrices."""
    from moetrain.model.flops import muon_flops
    from moetrain.optim.muon import MuonSettings
    from moetrain.optim.muon_params import split_param_groups
    from moetrain.optim.muon_sharded import MuonShards

    config = tiny().with_overrides(["train.optimizer=muon_sharded"])
    layout = P.Layout(pp=pp, dp=1, ep=1, micro_batch_size=1)
    flops = 0
    for stage in range(pp):
        model = _materialize(config, layout, stage)
        muon, adamw = split_param_groups(build_param_groups(model, config.train))
        kw = dict(dense_group=None, expert_group=None, grad_dtype=torch.float32)
        opt = ShardedAdamW(adamw, lr=1e-3, **kw)
        shards = MuonShards(muon, MuonSettings.from_config(config.train), expert_grad_divisor=1, global_slices=None, param_order=None, **kw)  # fmt: skip
        held = sum(
            _nbytes([b.params_flat, b.grads_flat, b.master, b.exp_avg, b.exp_avg_sq])
            for b in opt.buckets
        )
        held += sum(
            _nbytes([b.params_flat, b.grads_flat, b.master, b.momentum]) for b in shards.buckets
        )
        mem = P.stage_memory(config, layout, stage, num_micro=1)
        assert held == mem.params + mem.grads + mem.optimizer
        flops += P.rank_muon_flops(config, layout, stage)
    assert flops == muon_flops(config)
    adamw_memory = P.stage_memory(tiny(), layout, 0, num_micro=1)
    assert adamw_memory.optimizer > P.stage_memory(config, layout, 0, num_micro=1).optimizer


def test_backward_gives_every_parameter_a_gradient_of_its_dtype():
    config = tiny()
    layout = P.Layout(pp=2, dp=1, ep=1, micro_batch_size=2)
    first, last = _materialize(config, layout, 0), _materialize(config, layout, 1)
    tokens = torch.randint(0, config.model.vocab_size, (2, config.train.seq_len))
    h = first(tokens)
    h_in = h.detach().requires_grad_()
    last.loss(last(h_in), tokens).backward()
    h.backward(h_in.grad)
    for model in (first, last):
        for p in model.parameters():
            assert p.grad is not None and p.grad.dtype == p.dtype == torch.bfloat16
    # ShardedAdamW adds them into fp32 buckets (precision.grad_dtype=fp32), or keeps their dtype
    for grad_dtype, size in (("fp32", 4), ("bf16", 2)):
        c = config.with_overrides([f"precision.grad_dtype={grad_dtype}"])
        total = P.stage_memory(c, layout, 0, 1).grads + P.stage_memory(c, layout, 1, 1).grads
        assert total == size * param_counts(config).total


def _saved_bytes(model: nn.Module, fn) -> int:
    """Bytes of the distinct storages autograd saves while running fn, parameters excluded."""
    owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in owned:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


VARIANTS = [
    ({}, {}),
    ({"num_dense_layers": 1, "num_kv_heads": 2}, {"num_shared_experts": 1, "top_k": 3}),
    ({"qk_norm": "none", "d_model": 128, "num_heads": 2}, {}),
    # a dense layer after a MoE one (stage 1 of 2 holds it); per-head q/k norms
    ({"dense_layers": (1,), "qk_norm": "per_head", "num_kv_heads": 2}, {}),
]


@pytest.mark.parametrize("ckpt", P.CHECKPOINTING)
@pytest.mark.parametrize(("model_changes", "moe_changes"), VARIANTS)
def test_activation_bytes_equal_what_autograd_saves(model_changes, moe_changes, ckpt):
    """Every stage of a 1- and 2-stage split, under the real activation-checkpointing transform
    (its checkpoints save their inputs through the same hooks)."""
    base = tiny()
    config = dataclasses.replace(
        base,
        # flash: the CPU kernel that, like flash/cuDNN on GPU, saves no S x S matrix
        model=dataclasses.replace(base.model, attention_backend="flash", **model_changes),
        moe=dataclasses.replace(base.moe, **moe_changes),
    )
    mb, S, D = 3, config.train.seq_len, config.model.d_model
    tokens = torch.randint(0, config.model.vocab_size, (mb, S))
    for pp in (1, 2):
        layout = P.Layout(pp=pp, dp=1, ep=1, micro_batch_size=mb, activation_checkpointing=ckpt)
        for stage in range(pp):
            model = _materialize(config, layout, stage)
            apply_activation_checkpointing(model, ckpt)
            x = tokens
            held_by_schedule = 0
            if stage > 0:  # the received activation: autograd saves it only as a block input
                x = torch.randn(mb, S, D, dtype=torch.bfloat16, requires_grad=True)
                held_by_schedule = 0 if ckpt == "full" else 2 * mb * S * D
            if stage == pp - 1:
                got = _saved_bytes(model, lambda m=model, x=x: m.loss(m(x), tokens))
            else:
                got = _saved_bytes(model, lambda m=model, x=x: m(x))
            kept, _ = P.stage_activation_bytes(config, layout, stage, mb * S)
            assert got == kept - held_by_schedule, (pp, stage)


def test_checkpointing_and_schedule_order_activation_memory():
    config = get_preset("olmoe8")
    mem = {}
    for ckpt in P.CHECKPOINTING:
        for schedule in ("gpipe", "1f1b"):
            layout = P.Layout(
                pp=2,
                dp=1,
                ep=1,
                micro_batch_size=1,
                activation_checkpointing=ckpt,
                schedule=schedule,
            )
            mem[ckpt, schedule] = P.stage_memory(config, layout, 0, num_micro=8).activations
    assert mem["full", "1f1b"] < mem["moe", "1f1b"] < mem["none", "1f1b"]
    assert mem["none", "1f1b"] * 4 == mem["none", "gpipe"]  # 2 in flight against 8


def test_stage_layer_ranges_split_contiguously():
    for num_layers in (1, 2, 7, 10, 104):
        for pp in range(1, min(num_layers, 16) + 1):
            ranges = P.stage_layer_ranges(num_layers, pp)
            assert [i for r in ranges for i in r] == list(range(num_layers))
            sizes = [len(r) for r in ranges]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert P.stage_layer_ranges(10, 4) == [range(0, 2), range(2, 5), range(5, 8), range(8, 10)]
    with pytest.raises(ValueError, match=r"parallel\.pp \(3\) must be <= model\.num_layers"):
        P.stage_layer_ranges(2, 3)


@pytest.mark.parametrize("pp", [1, 2, 3, 5])
def test_stages_hold_every_parameter_once(pp):
    base = get_preset("small")
    tied = dataclasses.replace(base.model, tie_embeddings=True, num_dense_layers=2)
    scattered = dataclasses.replace(base.model, dense_layers=(1, 4, 5), qk_norm="per_head")
    for model in (base.model, tied, scattered):
        config = dataclasses.replace(base, model=model)
        counts = param_counts(config)
        held = sum(P.rank_params(config, pp=pp, ep=4, stage=s).dense for s in range(pp))
        held += sum(P.rank_params(config, pp=pp, ep=4, stage=s).experts * 4 for s in range(pp))
        tied_copy = counts.embedding if (config.model.tie_embeddings and pp > 1) else 0
        assert held == counts.total + tied_copy


@pytest.mark.parametrize(
    ("layout", "field"),
    [
        ({"pp": 1, "dp": 8, "ep": 3}, r"parallel\.ep \(3\) must divide moe\.num_experts \(8\)"),
        ({"pp": 2, "dp": 4, "ep": 8}, r"parallel\.ep \(8\) must divide parallel\.dp \(4\)"),
        ({"pp": 4, "dp": 2, "ep": 1}, r"parallel\.pp \(4\) must be <= model\.num_layers \(2\)"),
        ({"pp": 3, "dp": 2, "ep": 1}, r"parallel\.pp \(3\) must divide the number of GPUs"),
        ({"pp": 2, "dp": 2, "ep": 1}, r"parallel\.dp \(2\) times parallel\.pp \(2\) must equal"),
        ({"pp": 1, "dp": 8, "ep": 1, "micro_batch_size": 3}, r"train\.global_batch_tokens"),
        ({"pp": 1, "dp": 8, "ep": 1, "activation_checkpointing": "some"}, r"checkpointing"),
    ],
)
def test_layouts_that_do_not_divide_are_rejected(layout, field):
    config = tiny()
    kwargs = {"micro_batch_size": 1} | layout
    with pytest.raises(ValueError, match=field):
        P.validate_layout(config, P.Layout(**kwargs), 8, 8 * 8 * config.train.seq_len)


def test_pinned_layouts_are_rejected_with_the_reason():
    cluster = P.Cluster(gpu=P.GPUS["h200"], num_gpus=8)
    with pytest.raises(ValueError, match=r"parallel\.ep \(3\) must divide moe\.num_experts"):
        P.plan(tiny(), cluster, ep=3)
    with pytest.raises(ValueError, match=r"parallel\.pp \(3\) must divide the number of GPUs"):
        P.plan(tiny(), cluster, pp=3)
    estimates = P.plan(tiny(), cluster, pp=2, ep=2)
    assert estimates and all(e.layout.pp == 2 and e.layout.ep == 2 for e in estimates)


def test_enumeration_yields_only_valid_layouts_best_first():
    config = get_preset("olmoe-1b-7b")
    cluster = P.Cluster(gpu=P.GPUS["h200"], num_gpus=16)
    tokens = 64 * config.train.seq_len
    estimates = P.plan(config, cluster, tokens)
    for e in estimates:
        P.validate_layout(config, e.layout, 16, tokens)
    keys = [(not e.fits, e.step_s) for e in estimates]
    assert keys == sorted(keys)
    assert {e.layout.pp for e in estimates} == {1, 2, 4, 8, 16}


def test_traffic_stays_in_the_node_when_the_group_does():
    config = get_preset("olmoe-1b-7b").with_overrides(["moe.dispatcher=all_to_all"])
    cluster = P.Cluster(gpu=P.GPUS["h200"], num_gpus=16, gpus_per_node=8)
    tokens = 16 * 4 * config.train.seq_len
    inside = P.estimate(config, cluster, P.Layout(pp=1, dp=16, ep=8, micro_batch_size=4), tokens)
    across = P.estimate(config, cluster, P.Layout(pp=1, dp=16, ep=16, micro_batch_size=4), tokens)
    t_in, t_across = inside.stages[0].traffic, across.stages[0].traffic
    assert t_in.all_to_all_inter == 0 < t_in.all_to_all_intra
    assert t_across.all_to_all_inter > 0
    # 8 of the 16 destinations are on the other node; the all-to-all moves T K D bf16 values
    # per dispatch or combine, four times per layer
    T, K, D, L = 4 * 4096, 8, 2048, 16
    assert t_across.all_to_all_inter == pytest.approx(4 * L * T * K * D * 2 * 8 / 16)
    # expert replicas sit ep ranks apart: with ep 8 they are on different nodes
    assert t_in.grad_sync_inter > 0 and across.stages[0].traffic.grad_sync_inter > 0
    # dropless auto is the exact-split all_to_all; with a capacity factor, NoSyncDispatcher
    # (auto on GPUs) sends ep fixed blocks of ceil(1.25 T K / ep) rows
    auto = config.with_overrides(["moe.dispatcher=auto"])
    auto_traffic = P.estimate(auto, cluster, across.layout, tokens).stages[0].traffic
    assert auto_traffic == t_across
    capped = auto.with_overrides(["moe.capacity_factor=1.25"])
    capped_traffic = P.estimate(capped, cluster, across.layout, tokens).stages[0].traffic
    assert capped_traffic.all_to_all_inter == pytest.approx(t_across.all_to_all_inter * 1.25)
    piped = P.estimate(config, cluster, P.Layout(pp=2, dp=8, ep=8, micro_batch_size=4), tokens)
    # stages sit dp = 8 ranks apart: on different nodes
    assert piped.stages[0].traffic.pipeline_intra == 0
    assert piped.stages[0].traffic.pipeline_inter > 0


def test_olmoe_1b_7b_at_ep8_fits_an_h200_with_expert_buffers_of_at_most_2TK(capsys):
    """The default (dropless) run at ep 8 uses exact splits: T K rows a rank per MoE layer, not
    NoSync's worst case of 8 T K (10.7 GB of saved activations a layer, 203 GiB at the peak).
    With a capacity factor of 2, NoSync's fixed blocks hold 2 T K rows. Both fit an H200 with
    the preset's micro-batch and no checkpointing, and the activations follow the rows."""
    config = get_preset("olmoe-1b-7b")
    cluster = P.Cluster(gpu=P.GPUS["h200"], num_gpus=8)
    layout = P.Layout(pp=1, dp=8, ep=8, micro_batch_size=config.train.micro_batch_size)
    T, K, D, F = 4 * 4096, 8, 2048, 1024
    rows = {}
    for cf, dispatcher in ((None, "all_to_all"), (2.0, "no_sync")):
        run = config.with_overrides([f"moe.capacity_factor={cf}"]) if cf else config
        e = P.estimate(run, cluster, layout, P.default_global_batch_tokens(run, 8))
        assert e.expert_rows == P.ExpertRows(dispatcher, T, T * K, int((cf or 1) * T * K))
        assert e.expert_rows.rows <= 2 * T * K
        assert e.fits, f"cf={cf}: {e.peak_memory / P.GIB:.1f} GiB"
        rows[cf] = e.expert_rows.rows
        _, _, ffn = P.block_activation_bytes(run, T, moe=True, ep=8)
        rows[cf, "ffn"] = ffn
    # the saved dispatched rows, gate|up and SwiGLU outputs: a (D + 3 F) bytes a row
    assert rows[2.0, "ffn"] - rows[None, "ffn"] == 2 * (rows[2.0] - rows[None]) * (D + 3 * F)
    argv = ["--preset", "olmoe-1b-7b", "--gpus", "8", "--ep", "8", "--micro-batch-size", "4"]
    argv += ["--checkpointing", "none", "--global-batch-tokens", str(8 * T)]
    assert _cli([*argv, "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["best"]
    assert best["fits"] and best["dispatcher"] == "all_to_all"
    assert best["expert_rows_per_layer"] == best["routes_per_layer"] == T * K
    assert _cli([*argv, "--details"]) == 0
    assert f"{T * K:,} rows per MoE layer" in capsys.readouterr().out


def test_planner_resolves_the_dispatcher_as_the_trainer_does_on_gpus():
    from types import SimpleNamespace

    from moetrain.parallel.expert import resolve_dispatcher

    for choice in ("auto", "all_to_all", "no_sync"):
        for cf in (None, 1.25):
            if choice == "no_sync" and cf is None:
                continue  # a config error
            for ep in (1, 2, 8):
                config = get_preset("small").with_overrides(
                    [
                        f"moe.dispatcher={choice}",
                        f"moe.capacity_factor={cf or ''}",
                        f"parallel.ep={ep}",
                    ]
                )
                dims = SimpleNamespace(ep=ep, device=torch.device("cuda"))
                assert P.resolved_dispatcher(config, ep) == resolve_dispatcher(config, dims)


def test_trillion_preset_matches_the_reference_totals():
    counts = param_counts(get_preset("trillion-1.2t"))
    assert abs(counts.total / 1.2e12 - 1) < 0.05
    assert abs(counts.active / 58.36e9 - 1) < 0.05
    assert abs(param_counts(get_preset("trillion-2.4t")).total / 2.38e12 - 1) < 0.05
    assert {"trillion-1.2t", "trillion-2.4t"} <= set(PRESETS)


def test_trillion_plan_on_512_b300_fits_and_is_the_number_in_the_docs():
    from moetrain.tools.plan.overlap import overlap_from
    from moetrain.tools.plan.rank_compute import Setting
    from moetrain.tools.plan.ranking import rank

    config = get_preset("trillion-1.2t")
    cluster = P.Cluster(gpu=P.GPUS["b300"], num_gpus=512)
    tokens = config.train.global_batch_tokens
    setting = Setting(cluster=cluster, global_batch_tokens=tokens, overlap=overlap_from(None))
    ranking = rank(config, dataclasses.replace(setting, expert_load=1.0))  # random routing
    best = ranking.rows[0]
    assert best.row.fits
    preset = next(r for r in ranking.rows if r.config == config)  # the preset as it is
    assert preset.row.fits and preset.row.tflops > 0.95 * best.row.tflops, "update the preset"
    text = DOCS.read_text()
    number = re.search(r"planner\s+predicts \*\*([\d,]+) TFLOP/s", text)
    assert number, "docs/plan.md must state the prediction"
    assert int(number.group(1).replace(",", "")) == round(preset.row.tflops)
    roofline = P.estimate(config, cluster, preset.layout, tokens)
    assert f"nothing overlapped: {roofline.step_s:.2f} s a step, {roofline.tflops_per_gpu:.0f}" in (
        " ".join(text.split())
    )
    assert "858" in text


def _cli(argv):
    parser = argparse.ArgumentParser()
    P.add_plan_parser(parser.add_subparsers(dest="command"))
    return P.run_plan(parser.parse_args(["plan", *argv]))


def test_cli_prints_json_and_a_table(capsys):
    argv = ["--preset", "tiny", "--gpus", "8", "--gpu", "h100", "--top", "3"]
    assert _cli([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_gpus"] == 8 and out["num_fitting"] <= out["num_ranked"]
    assert [r["rank"] for r in out["rows"][:3]] == [1, 2, 3] and out["best"] == out["rows"][0]
    first = out["best"]
    assert {"step_s", "tflops_per_gpu", "tokens_per_s_per_gpu", "peak_gib", "fits"} <= set(first)
    assert first["comm"] and all(seconds >= 0 for seconds in first["comm"].values())

    assert _cli(["--preset", "trillion-1.2t", "--gpus", "512", "--gpu", "b300"]) == 0
    table = capsys.readouterr().out
    assert "TFLOP/s" in table and "trillion" in table


def test_cli_names_the_field_of_a_bad_pin(capsys):
    assert _cli(["--preset", "tiny", "--gpus", "8", "--ep", "3"]) == 2
    assert "parallel.ep (3) must divide moe.num_experts (8)" in capsys.readouterr().err


def test_planner_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, moetrain.tools.plan; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("dense_layers", [0, 1])
def test_fp8_linears_move_the_projections_to_the_fp8_rate(dense_layers):
    """precision.linear=fp8_rowwise: the forward and input gradient of the attention projections
    and dense SwiGLUs, and nothing else, run at the FP8 rate (their weight gradient stays bf16):
    the product time falls by exactly two thirds of their FLOPs times the difference of the
    two rates' reciprocals."""
    from moetrain.tools.plan.timing import _matmul_parts

    config = get_preset("olmoe8").with_overrides([f"model.num_dense_layers={dense_layers}"])
    fp8 = config.with_overrides(["precision.linear=fp8_rowwise"])
    cluster = P.Cluster(gpu=P.GPUS["h200"], num_gpus=1)
    layout = P.Layout(pp=1, dp=1, ep=1, micro_batch_size=config.train.micro_batch_size)
    saved = sum(_matmul_parts(config, cluster, layout, 0)) - sum(
        _matmul_parts(fp8, cluster, layout, 0)
    )
    m = config.model
    projections = param_counts(config).attention - (m.num_heads + m.kv_heads) * m.dim_per_head * m.num_layers  # fmt: skip
    dense_mlp = 3 * m.d_model * m.dense_hidden_size * dense_layers
    flops = 6 * (projections + dense_mlp) * config.train.micro_batch_size * config.train.seq_len
    expected = (
        flops
        * 2
        / 3
        * (
            1 / (P.GPUS["h200"].bf16_tflops * cluster.matmul_efficiency * 1e12)
            - 1 / (P.GPUS["h200"].fp8_tflops * cluster.fp8_efficiency * 1e12)
        )
    )
    assert saved == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("checkpointing", ["none", "moe"])
def test_fp8_experts_move_forward_and_input_gradient_to_the_fp8_rate(checkpointing):
    """precision.experts=fp8_rowwise: two thirds of the expert FLOPs (and a recomputed forward)
    at the FP8 rate, the weight gradient's third at the bf16 grouped rate; the quantizations'
    bytes join the elementwise time."""
    from moetrain.tools.plan.timing import _elementwise_s, _fp8_quantization_bytes, _matmul_parts

    config = get_preset("olmoe8")
    fp8 = config.with_overrides(["precision.experts=fp8_rowwise"])
    cluster = P.Cluster(gpu=P.GPUS["h200"], num_gpus=1)
    layout = P.Layout(
        pp=1, dp=1, ep=1, micro_batch_size=config.train.micro_batch_size,
        activation_checkpointing=checkpointing,
    )  # fmt: skip
    saved = sum(_matmul_parts(config, cluster, layout, 0)) - sum(
        _matmul_parts(fp8, cluster, layout, 0)
    )
    moe, m, t = config.moe, config.model, config.train
    expert_flops = 6 * moe.top_k * 3 * m.d_model * moe.expert_hidden * m.num_layers
    expert_flops *= t.micro_batch_size * t.seq_len
    fp8_share = 2 / 3 + (1 / 3 if checkpointing == "moe" else 0)
    gpu = P.GPUS["h200"]
    expected = (
        expert_flops
        * fp8_share
        * (
            1 / (gpu.bf16_tflops * cluster.grouped_efficiency * 1e12)
            - 1 / (gpu.fp8_tflops * cluster.fp8_efficiency * 1e12)
        )
    )
    assert saved == pytest.approx(expected, rel=1e-3)
    assert _fp8_quantization_bytes(config, layout, 0) == 0
    quantized = _fp8_quantization_bytes(fp8, layout, 0)
    assert quantized > 0
    extra = _elementwise_s(fp8, cluster, layout, 0) - _elementwise_s(config, cluster, layout, 0)
    assert extra == pytest.approx(quantized / cluster.hbm_bps)


@pytest.mark.parametrize("pp", [1, 2])
def test_fp8_lm_head_moves_the_head_to_the_fp8_rate_on_the_last_stage(pp):
    """precision.lm_head=fp8_rowwise: two thirds of the head's 6 V D FLOPs a token at the FP8
    rate, on the last pipeline stage only, with its quantizations' bytes there."""
    from moetrain.tools.plan.timing import _fp8_quantization_bytes, _matmul_parts

    config = get_preset("olmoe8")
    fp8 = config.with_overrides(["precision.lm_head=fp8_rowwise"])
    cluster = P.Cluster(gpu=P.GPUS["h200"], num_gpus=pp)
    layout = P.Layout(pp=pp, dp=1, ep=1, micro_batch_size=config.train.micro_batch_size)
    m, t, gpu = config.model, config.train, P.GPUS["h200"]
    flops = 6 * m.vocab_size * m.d_model * t.micro_batch_size * t.seq_len
    expected = (
        flops
        * 2
        / 3
        * (
            1 / (gpu.bf16_tflops * cluster.matmul_efficiency * 1e12)
            - 1 / (gpu.fp8_tflops * cluster.fp8_efficiency * 1e12)
        )
    )
    last = pp - 1
    saved = sum(_matmul_parts(config, cluster, layout, last)) - sum(
        _matmul_parts(fp8, cluster, layout, last)
    )
    assert saved == pytest.approx(expected, rel=1e-3)
    assert _fp8_quantization_bytes(fp8, layout, last) > 0
    if pp > 1:
        assert sum(_matmul_parts(fp8, cluster, layout, 0)) == sum(
            _matmul_parts(config, cluster, layout, 0)
        )
        assert _fp8_quantization_bytes(fp8, layout, 0) == 0


def test_run_memory_counts_muons_one_buffer_in_both_families():
    """The replicated and the sharded Muon hold one fp32 momentum buffer per Muon element where
    AdamW holds two moments: 4 B less per element the rank's Muon matrices hold."""
    from moetrain.tools.plan.run_memory import run_memory

    layout = P.Layout(pp=1, dp=1, ep=1, micro_batch_size=1)
    muon_elements = param_counts(tiny()).muon
    for adam, muon in (("adamw", "muon"), ("sharded", "muon_sharded")):
        a, m = (
            run_memory(tiny().with_overrides([f"train.optimizer={o}"]), layout, 0, 1, overhead=0)
            for o in (adam, muon)
        )
        assert a.optimizer - m.optimizer == 4 * muon_elements, (adam, muon)
        assert a.params == m.params and a.grads == m.grads
