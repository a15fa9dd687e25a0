"""Resident experts against FSDP2 (moetrain/tools/plan/compare.py and its parts) against hand
arithmetic: overlap pairs, compute scaled per kind, FSDP2's transfers and memory per mode, the
expert load, the micro-batch sweep and what it rejects for memory, the reference's row, and
`moetrain plan` beyond a node."""

import dataclasses
import json

import pytest

from moetrain.config.presets import get_preset
from moetrain.tools import plan as P
from moetrain.tools.plan import compare as C
from moetrain.tools.plan import compare_report as R
from moetrain.tools.plan import overlap as O
from moetrain.tools.plan.fsdp import fsdp_memory, fsdp_transfers
from moetrain.tools.plan.links import Links
from moetrain.tools.plan.rank_compute import (
    GLOBAL_BATCH_TOKENS as GLOBAL,
)
from moetrain.tools.plan.rank_compute import (
    VARIANTS,
    RankCompute,
    Setting,
    measured_compute,
)

REF = get_preset("ref-47b")  # 20 MoE blocks, seq 4096, 128 experts, top-4


def cluster(gpu: str = "h200", gpus: int = 8, **kw) -> P.Cluster:
    return P.Cluster(gpu=P.GPUS[gpu], num_gpus=gpus, latency_us=0, **kw)


def layout(tokens: int = 8192, ckpt: str = "none", dp: int = 8, ep: int = 1) -> P.Layout:
    mb = tokens // 4096
    return P.Layout(pp=1, dp=dp, ep=ep, micro_batch_size=mb, activation_checkpointing=ckpt)


def test_overlap_pairs_reproduce_their_measurement_and_the_stated_assumption(tmp_path):
    hidden, exposed = O.Pair(0.0, 1.0), O.Pair(0.0, 0.0)
    assert O.paired_s(3.0, 2.0, hidden) == 3.0 and O.paired_s(3.0, 5.0, hidden) == 5.0
    assert O.paired_s(3.0, 2.0, exposed) == 5.0
    pair = O.Pair(0.1, 0.8)  # eta: 0.8 of the shorter hidden, as measured with a short transfer
    assert O.paired_s(10.0, 2.0, pair) == pytest.approx(10 + 2 - 0.8 * 2)
    # a long transfer: 0.88 of it beside the compute, which it slows to 1.1 s; 0.12 x 5 exposed
    assert O.paired_s(1.0, 5.0, pair) == pytest.approx(0.88 * 5 + 0.12 * 5)
    path = tmp_path / "overlap.json"
    pairs = {"a2a": {"sigma": 0.07, "eta": 0.88}, "fsdp_gather": {"sigma": 0.05, "eta": 0.92}}
    pairs["fsdp_reduce_scatter"] = {"sigma": 0.06, "eta": 0.9}
    path.write_text(json.dumps({"gpu": "NVIDIA H200", "date": "d", "torch": "t", "pairs": pairs}))
    read = O.overlap_from(path)
    assert read.pairs["a2a"] == O.Pair(0.07, 0.88) and str(path) in read.describe()
    pairs["a2a"]["eta"] = 1.5
    path.write_text(json.dumps({"pairs": pairs}))
    with pytest.raises(ValueError, match=r"pairs.a2a \(sigma 0.07, eta 1.5\)"):
        O.load_overlap(path)
    # slower side by side than in turn (the H100's a2a stand-in): projected as run in turn
    pairs["a2a"] = {"sigma": 0.29, "eta": -0.54}
    path.write_text(json.dumps({"pairs": pairs}))
    read = O.load_overlap(path)
    assert read.pairs["a2a"] == O.Pair(0.0, 0.0) and "a2a (measured eta -0.54)" in read.describe()
    assert read.pairs["fsdp_gather"] == O.Pair(0.05, 0.92)


def test_no_overlap_file_means_the_stated_assumption(tmp_path, monkeypatch):
    monkeypatch.setattr(O, "DEFAULT_PATH", tmp_path / "none.json")
    assert O.overlap_from(None) is O.ASSUMED
    assert "assumed" in O.ASSUMED.describe()


def test_measured_compute_is_carried_to_another_gpu_per_kind():
    shares = {"experts": 0.4, "products": 0.3, "memory": 0.2, "idle": 0.1}
    measured = RankCompute(2.0, 0.16, 0.0, shares=shares, tokens=8192, gpu="h200")
    fsdp = VARIANTS["fsdp2"]
    on = {
        gpu: measured_compute(
            REF, Setting(cluster=cluster(gpu), measured={"fsdp": measured}), fsdp, layout()
        )
        for gpu in ("h200", "b300")
    }
    # at its own point on its own GPU the measurement is itself, the update 1 / 8 of it
    h200 = on["h200"]
    assert (h200.experts, h200.products, h200.memory, h200.idle) == pytest.approx(
        (0.8, 0.6, 0.4, 0.2)
    )
    assert h200.optimizer == pytest.approx(0.02)
    products, hbm = 2250 / 989, 8.0 / 4.8  # the datasheets' BF16 and HBM ratios
    b300 = on["b300"]
    assert b300.experts == pytest.approx(0.8 / products)
    assert b300.products == pytest.approx(0.6 / products)
    assert (b300.memory, b300.idle) == pytest.approx((0.4 / hbm, 0.2))
    scaled = Setting(cluster=cluster("b300"), measured={"fsdp": measured}, compute_scale=2.0)
    two = measured_compute(REF, scaled, fsdp, layout())
    assert (two.experts, two.memory, two.idle) == pytest.approx((0.4, 0.2, 0.2))
    # twice the tokens: the roofline's ratio, about twice the work
    double = measured_compute(
        REF, Setting(cluster=cluster(), measured={"fsdp": measured}), fsdp, layout(16384)
    )
    assert double.experts == pytest.approx(1.6) and 1.9 < double.memory / 0.4 < 2.1


def test_fsdp2_transfers_by_hand():
    links = Links(nvlink_gbps=450, internode_gbps=50, latency_us=0)
    lp = P.layer_params(REF)
    block, root = lp.moe_layer.total, lp.outside.total
    t = fsdp_transfers(REF, links, 8, reshard="forward", reduce_bytes=4)
    assert t.block_gathers == pytest.approx(20 * block * 2 * 7 / 8 / 450e9)
    assert t.block_reductions == pytest.approx(2 * t.block_gathers)  # fp32: twice the bytes
    assert t.root_gather == pytest.approx(root * 2 * 7 / 8 / 450e9)
    g, r = t.block_gathers, t.block_reductions
    assert t.of_microbatch(1, 3) == pytest.approx((t.root_gather, g, g, r, t.root_reduction))
    bf16 = fsdp_transfers(REF, links, 8, reshard="backward", reduce_bytes=2)
    assert bf16.block_reductions == pytest.approx(g) and bf16.of_microbatch(0, 2)[2] == 0
    step = fsdp_transfers(REF, links, 8, reshard="step", reduce_bytes=4)
    assert step.of_microbatch(0, 3)[1:4] == pytest.approx((g, 0, 0))
    assert step.of_microbatch(1, 3)[1:4] == (0, 0, 0)
    assert step.of_microbatch(2, 3)[1:4] == pytest.approx((0, 0, r))
    # HSDP on 16 GPUs: shards of 8 inside a node, the shard all-reduced between the two nodes
    hsdp = fsdp_transfers(REF, links, 16, reshard="forward", reduce_bytes=4, shard=8)
    across = 2 * (block * 4 / 8) / 2 / 50e9  # ring all-reduce over 2: 2 x 1/2 of the shard
    assert hsdp.block_reductions == pytest.approx(20 * (block * 4 * 7 / 8 / 450e9 + across))


def test_fsdp2_memory_by_hand_and_a_mode_that_must_be_rejected():
    lp = P.layer_params(REF)
    block, root = lp.moe_layer.total, lp.outside.total
    total = 20 * block + root
    shard = -(-total // 8)
    kept, transient = P.stage_activation_bytes(REF, layout(), 0, 8192)
    m = fsdp_memory(REF, layout(), 8, reshard="forward", reduce_bytes=4)
    assert m.params == 2 * shard + 2 * (2 * block + root)  # the shard, two blocks and the root
    assert m.grads == 2 * shard + block * (2 + 4)  # one block's and the last's fp32 scatter
    assert m.optimizer == 12 * shard and m.activations == kept and m.transient == transient
    one = fsdp_memory(REF, layout(dp=1), 1, reshard="forward", reduce_bytes=4)
    assert one.params == 2 * total and one.grads == 2 * total  # nothing gathered at n = 1
    step = fsdp_memory(REF, layout(), 8, reshard="step", reduce_bytes=4)
    assert step.params == 2 * shard + 2 * total and step.grads == 2 * shard + 4 * total
    # 8 B300: the whole model and its fp32 gradients do not fit; each micro-batch's gathers do
    setting = Setting(cluster=cluster("b300"))
    rows = C.sweep(REF, setting, (VARIANTS["fsdp2"], VARIANTS["fsdp2, reshard step"]))
    assert rows and not any(r.fits for r in rows if r.variant == "fsdp2, reshard step")
    chosen = C.best(rows)
    assert chosen["fsdp2"].fits and not chosen["fsdp2, reshard step"].fits
    assert "FSDP2" not in R.answer(chosen)[0] or "resident" not in R.answer(chosen)[0]


def test_link_efficiency_moves_the_fsdp_row_not_its_compute():
    rows = {
        eff: C.fsdp_row(
            REF, VARIANTS["fsdp2"], Setting(cluster=cluster("b300", link_efficiency=eff)), layout()
        )
        for eff in (0.8, 0.4)
    }
    fast, slow = rows[0.8], rows[0.4]
    assert fast.compute == slow.compute
    assert slow.comm["all-gathers"] == pytest.approx(2 * fast.comm["all-gathers"])
    assert slow.step_s > fast.step_s  # 8k-token micro-batches: the gathers outlast the compute


def test_micro_batches_follow_the_global_batch_and_odd_points_are_skipped():
    setting = Setting(cluster=cluster("b300"), global_batch_tokens=3 * 8 * 16384)
    rows = C.sweep(REF, setting, (VARIANTS["fsdp2"],))
    assert {(r.tokens, r.microbatches) for r in rows} == {(4096, 12), (8192, 6), (16384, 3)}
    assert all(r.tokens_per_s == pytest.approx(r.tokens * r.microbatches / r.step_s) for r in rows)


def test_expert_load_grows_the_busiest_ranks_products_buffers_and_all_to_alls():
    lay = layout(16384, ep=8)
    rows = {}
    for load in (1.0, 1.5):
        setting = Setting(cluster=cluster(), expert_load=load)
        cfg = C.resident_config(REF, VARIANTS["resident"], setting, 8)
        est = P.estimate(cfg, setting.cluster, lay, GLOBAL)
        rows[load] = C.resident_row(REF, VARIANTS["resident"], setting, lay, est)
    even, busy = rows[1.0], rows[1.5]
    assert busy.compute.experts == pytest.approx(1.5 * even.compute.experts)
    assert busy.compute.products == even.compute.products
    assert busy.comm["all-to-alls"] == pytest.approx(1.5 * even.comm["all-to-alls"], rel=0.01)
    assert busy.peak_bytes > even.peak_bytes


def test_the_busiest_rank_follows_the_configs_dispatcher():
    """Dropless (exact splits): the busiest rank computes and receives `load` x T K rows, sends
    between stages unchanged. NoSync at cf 1.25: its fixed blocks travel whole whatever the
    load, and its experts compute at most the blocks' rows."""
    lay = layout(16384, ep=8)
    capped = REF.with_overrides(["moe.capacity_factor=1.25"])
    for config, dispatcher in ((REF, "all_to_all"), (capped, "no_sync")):
        est = P.estimate(config, cluster(), lay, GLOBAL)
        assert est.expert_rows.dispatcher == dispatcher
        rows = {
            load: C.resident_row(
                REF, VARIANTS["resident"], Setting(cluster=cluster(), expert_load=load), lay, est
            )
            for load in (1.0, 1.5)
        }
        even, busy = rows[1.0], rows[1.5]
        assert busy.comm["pipeline sends"] == even.comm["pipeline sends"] == 0  # pp 1
        a2a = busy.comm["all-to-alls"] / even.comm["all-to-alls"]
        experts = busy.compute.experts / even.compute.experts
        if dispatcher == "all_to_all":
            assert a2a == pytest.approx(1.5) and experts == pytest.approx(1.5)
        else:
            cap = est.expert_rows.rows / est.expert_rows.routes  # about the capacity factor
            assert a2a == 1.0 and experts == pytest.approx(cap) and 1.25 <= cap < 1.26


def test_two_chunk_hides_the_all_to_alls_by_the_measured_pair():
    pairs = dict(O.ASSUMED.pairs, a2a=O.Pair(0.0, 1.0))
    lay = layout(16384, ep=8)
    setting = Setting(cluster=cluster(), overlap=O.Overlap(pairs, "test"))
    cfg = C.resident_config(REF, VARIANTS["resident"], setting, 8)
    est = P.estimate(cfg, setting.cluster, lay, GLOBAL)
    plain, chunked = (C.resident_row(REF, VARIANTS[v], setting, lay, est) for v in (
        "resident", "resident, two_chunk"))  # fmt: skip
    a2a = plain.comm["all-to-alls"]
    assert plain.step_s - chunked.step_s == pytest.approx(a2a)  # shorter than the compute


def test_the_dispatchers_measured_costs_join_each_micro_batch():
    lay = layout(16384, ep=8)
    base = Setting(cluster=cluster(), dispatcher="all_to_all")
    costs = dataclasses.replace(base, index_work_s=1e-3, host_sync_s=2e-4)
    cfg = C.resident_config(REF, VARIANTS["resident"], base, 8)
    est = P.estimate(cfg, base.cluster, lay, GLOBAL)
    plain, paid = (C.resident_row(REF, VARIANTS["resident"], s, lay, est) for s in (base, costs))
    assert paid.compute.memory - plain.compute.memory == pytest.approx(20 * 1e-3)
    assert paid.compute.idle - plain.compute.idle == pytest.approx(20 * 2e-4)


def test_the_reference_row_pins_its_fsdp_baseline():
    lines, rows = R.reference(REF, Setting(cluster=cluster("b300")))
    fsdp, resident = rows
    assert fsdp.variant == "fsdp2" and fsdp.tokens == 8192 and resident.variant == "resident"
    assert "19,400" in lines[0] and "52,000" in lines[1] and "ratio" in lines[2]


def _plan(argv):
    import argparse

    parser = argparse.ArgumentParser()
    P.add_plan_parser(parser.add_subparsers(dest="command"))
    return P.run_plan(parser.parse_args(["plan", *argv]))


def test_plan_ranks_hsdp_beyond_one_node_and_names_a_bad_overlap_file(capsys, tmp_path):
    argv = ["--preset", "ref-47b", "--gpus", "16", "--gpu", "b300"]
    assert _plan([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    families = {r["family"] for r in out["rows"]}
    assert families == {"all experts on each GPU", "resident experts", "FSDP2", "HSDP"}
    assert all(r["gpus"] == 16 and r["peak_gib"] > 0 for r in out["rows"])
    assert any(line.startswith("overlap: ") for line in out["assumptions"])  # its source stated
    assert _plan(argv) == 0
    text = capsys.readouterr().out
    assert "│ HSDP, shards of 8" in text and "tok/s/GPU" in text
    (tmp_path / "bad.json").write_text("{}")
    assert _plan([*argv, "--overlap", str(tmp_path / "bad.json")]) == 2
    assert "overlap file" in capsys.readouterr().err
