"""Routes recorded in training (`moe.record_routes`) and replayed (`moe.replay_routes`)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import run_distributed

from moetrain.cli import main
from moetrain.config.presets import tiny
from moetrain.moe.replay_router import ReplayRouter
from moetrain.moe.router import RouterConfig, TopKRouter
from moetrain.tools.bench.harness import warmed_trainer
from moetrain.train.routes import load_routes
from moetrain.train.trainer import Trainer


def _cfg(*overrides):
    return tiny().with_overrides(
        ["train.steps=6", "train.log_every=4", "train.eval_every=0", *overrides]
    )


def _train(run_dir: Path, *overrides) -> dict[int, float]:
    Trainer(_cfg("moe.record_routes=true", *overrides), run_dir, progress=False).train()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if r["kind"] == "train"}


def test_a_replay_takes_the_recorded_routes_and_repeats_the_losses_bit_for_bit(tmp_cache, tmp_path):
    losses = _train(tmp_path / "a", "train.log_every=1")
    recorded = load_routes(tmp_path / "a" / "routes")
    config = tiny()
    T, K = config.train.micro_batch_size * config.train.seq_len, config.moe.top_k
    assert recorded["routes"].shape == (6, 2, T, K) and recorded["first_step"] == 1
    assert len(list((tmp_path / "a" / "routes").iterdir())) == 6  # a file a log line
    replay = f"moe.replay_routes={tmp_path / 'a' / 'routes'}"
    assert _train(tmp_path / "b", "train.log_every=1", replay) == losses
    assert torch.equal(load_routes(tmp_path / "b" / "routes")["routes"], recorded["routes"])
    # another seed's routers would choose other experts: the replay still takes the recorded
    _train(tmp_path / "c", "train.seed=1")
    assert not torch.equal(load_routes(tmp_path / "c" / "routes")["routes"], recorded["routes"])
    _train(tmp_path / "d", "train.seed=1", replay)
    assert torch.equal(load_routes(tmp_path / "d" / "routes")["routes"], recorded["routes"])
    # two micro-batches a step take the same forwards in order; a recompute neither records nor
    # replays a forward twice
    accumulate = f"train.global_batch_tokens={2 * T}"
    recompute = "parallel.activation_checkpointing=moe"
    _train(tmp_path / "e", "train.steps=3", accumulate, recompute, replay)
    assert torch.equal(load_routes(tmp_path / "e" / "routes")["routes"], recorded["routes"])


def test_a_recording_of_another_shape_or_too_short_is_refused(tmp_cache, tmp_path):
    _train(tmp_path / "a")
    files = sorted((tmp_path / "a" / "routes").iterdir())
    assert [f.name for f in files] == [
        "rank000-steps0000001-0000004.pt",
        "rank000-steps0000005-0000006.pt",
    ]
    replay = f"moe.replay_routes={tmp_path / 'a' / 'routes'}"
    with pytest.raises(ValueError, match=r"num_experts 8, this run has moe.num_experts = 4"):
        Trainer(_cfg(replay, "moe.num_experts=4"), tmp_path / "e", progress=False)
    with pytest.raises(ValueError, match=r"train.micro_batch_size x train.seq_len = 256"):
        Trainer(_cfg(replay, "train.micro_batch_size=4"), tmp_path / "t", progress=False)
    with pytest.raises(RuntimeError, match="hold 6 forwards; forward 6 has no recorded routes"):
        Trainer(_cfg(replay, "train.steps=7"), tmp_path / "long", progress=False).train()
    later = torch.load(files[1], weights_only=True)
    files[1].unlink()
    torch.save({**later, "first_step": 6}, files[1].with_name("rank000-steps0000006-0000007.pt"))
    with pytest.raises(ValueError, match="the recording has a gap"):
        load_routes(tmp_path / "a" / "routes")


def test_the_replay_routers_gate_learns_from_the_scores_at_the_replayed_experts():
    config = RouterConfig(num_experts=6, top_k=2)
    routes_NTK = torch.stack([torch.randperm(6)[:2] for _ in range(2 * 5)]).view(2, 5, 2)
    learned, replay = TopKRouter(8, config), ReplayRouter(8, config, routes_NTK)
    replay.load_state_dict(learned.state_dict(), strict=False)
    for n in range(2):
        x_TD = torch.randn(5, 8)
        out = replay(x_TD)
        assert torch.equal(out.expert_ids_TK, routes_NTK[n])
        assert torch.equal(
            out.tokens_per_expert_E, torch.bincount(routes_NTK[n].flatten(), minlength=6)
        )
        scores_TE = learned.gate(x_TD).softmax(-1)
        torch.testing.assert_close(out.weights_TK, scores_TE.gather(1, routes_NTK[n]))
        out.weights_TK.sum().backward()
        assert replay.gate.weight.grad.abs().sum() > 0
    resumed = ReplayRouter(8, config, routes_NTK)
    resumed.load_state_dict(replay.state_dict())
    assert resumed.forwards == 2


def test_bench_times_the_step_under_replayed_routes(tmp_cache, tmp_path):
    _train(tmp_path / "a")
    routes = str(tmp_path / "a" / "routes")
    out = tmp_path / "r.json"
    args = ["bench", "--preset", "tiny", "--steps", "2", "--warmup", "1", "--optimizer", "mixed"]
    assert main([*args, "--routing", routes, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["results"][0]["routing"] == routes
    with warmed_trainer(tiny(), "mixed", warmup=3, routing=routes, device="cpu") as (trainer, _):
        routers = [layer.router for layer in trainer.model.moe_layers()]
        assert all(isinstance(r, ReplayRouter) and r.forwards == 3 for r in routers)
    with pytest.raises(SystemExit):
        main([*args, "--routing", str(tmp_path / "missing")])


def _record_then_replay_world2(rank, world_size, run_dir):
    """Records at dp 2 (ep 2), then replays in a run whose routers would choose otherwise."""
    layout = ["parallel.dp=2", "parallel.ep=2", "train.log_every=1"]
    _train(Path(run_dir) / "a", *layout)
    replay = f"moe.replay_routes={Path(run_dir) / 'a' / 'routes'}"
    _train(Path(run_dir) / "b", *layout, "train.seed=1", replay)
    return [load_routes(Path(run_dir) / run / "routes", rank)["routes"] for run in "ab"]


@pytest.mark.distributed
def test_each_rank_records_and_replays_its_own_routes(tmp_cache, tmp_path):
    (ours, ours_replayed), (theirs, theirs_replayed) = run_distributed(
        _record_then_replay_world2, 2, str(tmp_path)
    )
    names = sorted(p.name[:7] for p in (tmp_path / "a" / "routes").iterdir())
    assert names == ["rank000"] * 6 + ["rank001"] * 6
    assert not torch.equal(ours, theirs)  # each rank's own micro-batches
    assert torch.equal(ours, ours_replayed) and torch.equal(theirs, theirs_replayed)


def test_a_resumed_recording_and_a_resumed_replay_go_on_where_they_stopped(tmp_cache, tmp_path):
    losses = _train(tmp_path / "a", "train.log_every=1")
    replay = f"moe.replay_routes={tmp_path / 'a' / 'routes'}"
    part = ("train.log_every=1", "train.checkpoint_every=4", replay)
    _train(tmp_path / "b", "train.steps=4", *part)
    Trainer(
        _cfg("moe.record_routes=true", *part), tmp_path / "b", resume=True, progress=False
    ).train()
    lines = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"]: r["loss"] for r in lines if r["kind"] == "train"} == losses
    recorded = load_routes(tmp_path / "a" / "routes")["routes"]
    assert torch.equal(load_routes(tmp_path / "b" / "routes")["routes"], recorded)
