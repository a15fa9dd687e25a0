"""Muon through the trainer in every layout (gloo processes) against one process: the same 16
sequences a step in micro-batches of 2 (one process accumulates 8, dp 2 four each, dp 2 x ep 2
two each, pp 2 eight through the schedule), clipping that binds, fp32. Losses and the final
weights (read back from each run's checkpoint, global names and shapes) equal one process's to
1e-5; the sharded state resumes bitwise at world 2 and reshards from world 2 to one process,
the replicated one from ep 2 to one process.

Newton-Schulz runs in fp32 here (train.muon_ns_dtype): the layouts must do the same arithmetic,
and bf16 products round to 8 bits, so gradients that differ in fp32 summation order (1e-7) round
differently and the weights of two layouts drifted apart by up to 1e-3 (relative) in 4 steps,
rounding noise that hides any layout error; in fp32 they agree to 3e-7. The bf16 products are
tested against the fp32 reference in test_muon.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed

from moetrain.checkpoint import manager
from moetrain.config.presets import tiny
from moetrain.model.transformer import build_model

pytestmark = pytest.mark.distributed

SEQ, MICRO, SEQUENCES, STEPS, CLIP = 16, 2, 16, 4, 0.5
REL = 1e-5


def _config(optimizer: str, *layout: str):
    return tiny().with_overrides(
        [
            "model.d_model=32",
            "model.num_layers=2",
            "moe.expert_hidden=32",
            "moe.dispatcher=all_to_all",
            f"train.seq_len={SEQ}",
            f"train.micro_batch_size={MICRO}",
            f"train.global_batch_tokens={SEQUENCES * SEQ}",
            f"train.steps={STEPS}",
            f"train.grad_clip={CLIP}",
            "train.warmup_steps=1",
            "train.log_every=1",
            "train.eval_every=0",
            "train.checkpoint_every=2",
            "train.keep_checkpoints=3",
            f"train.optimizer={optimizer}",
            "train.muon_ns_dtype=fp32",
            *layout,
        ]
    )


def _train(run_dir: str, optimizer: str, layout: tuple[str, ...], resume: bool) -> None:
    from moetrain.train.trainer import Trainer

    Trainer(_config(optimizer, *layout), run_dir, resume=resume, progress=False).train()


def _jobs(rank: int, world: int, cache: str, jobs: list[tuple]) -> None:
    """(run_dir, optimizer, layout, resume_from) in order; resume_from: a run directory whose
    step-2 checkpoint rank 0 copies in first."""
    os.environ["MOETRAIN_CACHE"] = cache
    torch.set_num_threads(1)
    for run_dir, optimizer, layout, resume_from in jobs:
        if resume_from is not None and rank == 0:
            _copy_step2(resume_from, run_dir)
        if dist.is_initialized():
            dist.barrier()
        _train(run_dir, optimizer, layout, resume_from is not None)


def _copy_step2(source: str, target: str) -> None:
    (Path(target) / "checkpoints").mkdir(parents=True)
    shutil.copytree(Path(source) / "checkpoints/step-2", Path(target) / "checkpoints/step-2")


def _records(run_dir: Path) -> dict[int, dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if r["kind"] == "train"}


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The final checkpoint's model tensors, global, read in this one process."""
    state = {"model": build_model(_config("muon")).state_dict()}
    manager.load(run_dir / f"checkpoints/step-{STEPS}", state)
    return state["model"]


def _assert_same_run(got: Path, want: Path, what: str, steps=range(1, STEPS + 1)) -> None:
    a, b = _records(got), _records(want)
    for step in steps:
        for key in ("loss", "grad_norm"):
            x, y = a[step][key], b[step][key]
            assert abs(x - y) <= REL * abs(y), (what, step, key, x, y)
    wa, wb = _weights(got), _weights(want)
    for name, w in wb.items():
        err = ((wa[name] - w).norm() / w.norm()).item()
        assert err <= REL, (what, name, err)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("muon_layouts")
    cache = str(root / "cache")
    os.environ["MOETRAIN_CACHE"] = cache
    d = {name: str(root / name) for name in ("one", "dp2", "ep2", "pp2", "s2", "s2_resumed", "s1", "e1", "dp2ep2")}  # fmt: skip
    run_distributed(
        _jobs,
        2,
        cache,
        [
            (d["dp2"], "muon", (), None),
            (d["ep2"], "muon", ("parallel.ep=2",), None),
            (d["pp2"], "muon", ("parallel.pp=2", "parallel.pp_schedule=1f1b"), None),
            (d["s2"], "muon_sharded", (), None),
            (d["s2_resumed"], "muon_sharded", (), d["s2"]),
        ],
    )
    run_distributed(_jobs, 4, cache, [(d["dp2ep2"], "muon_sharded", ("parallel.ep=2",), None)])
    _jobs(
        0,
        1,
        cache,
        [
            (d["one"], "muon", (), None),
            (d["s1"], "muon_sharded", (), d["s2"]),
            (d["e1"], "muon", (), d["ep2"]),
        ],
    )
    return root


def test_one_process_clips(runs):
    norms = [r["grad_norm"] for r in _records(runs / "one").values()]
    assert len(norms) == STEPS and min(norms) > CLIP, norms


@pytest.mark.parametrize("layout", ["dp2", "ep2", "pp2", "dp2ep2"])
def test_layout_trains_as_one_process(runs, layout):
    """dp 2, ep 2 (replicated Muon), pp 2 (1F1B) and dp 2 x ep 2 with the sharded state."""
    _assert_same_run(runs / layout, runs / "one", layout)


def test_sharded_state_resumes_bitwise_at_world_2(runs):
    a, b = _records(runs / "s2_resumed"), _records(runs / "s2")
    assert sorted(a) == [3, 4]
    for step in a:
        assert a[step]["loss"] == b[step]["loss"] and a[step]["grad_norm"] == b[step]["grad_norm"]
    wa, wb = _weights(runs / "s2_resumed"), _weights(runs / "s2")
    assert all(torch.equal(wa[name], w) for name, w in wb.items())


def test_sharded_state_reshards_from_world_2_to_one_process(runs):
    _assert_same_run(runs / "s1", runs / "s2", "2 -> 1", steps=(3, 4))
    _assert_same_run(runs / "s2", runs / "one", "sharded at world 2")


def test_replicated_state_reshards_from_ep_2_to_one_process(runs):
    """The replicated Muon's momentum of expert slices is saved as global tensors (DTensors
    over ep) and loads into one process."""
    _assert_same_run(runs / "e1", runs / "ep2", "ep 2 -> 1", steps=(3, 4))
