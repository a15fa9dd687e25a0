"""The trainer across processes (gloo): torchrun with expert parallelism matches one process, and
checkpoints reshard between layouts."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_distributed, two_source_mix

from moetrain.config.presets import tiny

pytestmark = pytest.mark.distributed

SEQ = 64


def _losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if r["kind"] == "train"}


@pytest.mark.parametrize(
    "dispatcher",
    [["moe.dispatcher=all_to_all"], ["moe.dispatcher=no_sync", "moe.capacity_factor=4"]],
    ids=["all_to_all", "no_sync"],
)
def test_torchrun_ep2_matches_one_process(tmp_path, dispatcher):
    """2 processes with ep=2 (micro-batch 4 each) vs 1 process accumulating 2 micro-batches of 4:
    the same global batch, the same micro-batches, so the same losses, and the same validation
    loss. Both EP dispatchers (the NoSync one with capacity factor E / K, which never drops a
    route)."""
    cache = tmp_path / "cache"
    env = {**os.environ, "MOETRAIN_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    common = [
        "--preset",
        "tiny",
        "--quiet",
        "--set",
        "train.steps=6",
        "--set",
        "train.log_every=1",
        "--set",
        "train.eval_every=6",
        "--set",
        "train.eval_sequences=13",
        "--set",
        "train.micro_batch_size=4",
        "--set",
        "train.checkpoint_every=0",
    ]
    one = subprocess.run(
        [
            sys.executable,
            "-m",
            "moetrain",
            "train",
            "--run-dir",
            str(tmp_path / "one"),
            *common,
            "--set",
            f"train.global_batch_tokens={2 * 4 * SEQ}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--standalone",
            "-m",
            "moetrain",
            "train",
            "--run-dir",
            str(tmp_path / "two"),
            *common,
            "--set",
            "parallel.ep=2",
            *[arg for override in dispatcher for arg in ("--set", override)],
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-4 * abs(a[step]), (step, a[step], b[step])
    # the same 13 validation windows, dealt to two ranks and padded to equal micro-batches
    va, vb = _val_losses(tmp_path / "one"), _val_losses(tmp_path / "two")
    assert list(va) == list(vb) == [6] and abs(va[6] - vb[6]) <= 1e-4 * va[6], (va, vb)
    # router statistics are means over the dp ranks, as over the one process's micro-batches
    for key in ("lb_loss", "z_loss", "entropy"):
        ra, rb = _router_stat(tmp_path / "one", key), _router_stat(tmp_path / "two", key)
        for step in ra:
            assert abs(ra[step] - rb[step]) <= 1e-4 * abs(ra[step]), (key, step, ra, rb)
    # the worst step's load: one process logging every step, that step's; over two ranks the
    # worst rank's micro-batch, at least the summed load's max/mean
    for run, tight in (("one", True), ("two", False)):
        for record in _records(tmp_path / run):
            for layer in record["moe"]:
                peak, interval = layer["max_mean_peak"], layer["max_mean"]
                if tight:
                    assert peak == pytest.approx(interval, rel=1e-5), (run, record["step"])
                else:
                    assert peak >= interval * (1 - 1e-6), (run, record["step"])


def _records(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r["kind"] == "train"]


def _val_losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in lines if r["kind"] == "eval"}


def _router_stat(run_dir, key: str) -> dict[int, float]:
    """Per step, the mean over MoE layers of a logged router statistic."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        r["step"]: sum(layer[key] for layer in r["moe"]) / len(r["moe"])
        for r in lines
        if r["kind"] == "train"
    }


def _layout_overrides(world: int, ep: int) -> list[str]:
    # the same 8 sequences per step and the same micro-batches of 2 in every layout
    return [
        "train.micro_batch_size=2",
        f"train.global_batch_tokens={8 * SEQ}",
        f"parallel.ep={ep}",
        "train.optimizer=sharded",
        "train.log_every=1",
        "train.eval_every=0",
        "train.checkpoint_every=2",
        "train.steps=4",
        "moe.dispatcher=all_to_all",
    ]


def _train(rank, world, run_dir, cache, ep, resume):
    os.environ["MOETRAIN_CACHE"] = cache
    from moetrain.train.trainer import Trainer

    config = tiny().with_overrides(_layout_overrides(world, ep))
    Trainer(config, run_dir, resume=resume, progress=False).train()
    return None


def test_checkpoint_reshards_between_layouts(tmp_path):
    cache = str(tmp_path / "cache")
    source = tmp_path / "dp4_ep2"
    run_distributed(_train, 4, str(source), cache, 2, False)
    reference = _losses(source)
    for world, ep in ((2, 1), (1, 1)):
        target = tmp_path / f"world{world}_ep{ep}"
        (target / "checkpoints").mkdir(parents=True)
        shutil.copytree(source / "checkpoints" / "step-2", target / "checkpoints" / "step-2")
        if world == 1:
            _train(0, 1, str(target), cache, ep, True)
        else:
            run_distributed(_train, world, str(target), cache, ep, True)
        resumed = _losses(target)
        for step in (3, 4):
            assert abs(resumed[step] - reference[step]) <= 1e-6 * abs(reference[step]), (
                world,
                ep,
                step,
                resumed[step],
                reference[step],
            )


def _train_mix(rank, world, run_dir, cache, mix):
    os.environ["MOETRAIN_CACHE"] = cache
    from moetrain.train.trainer import Trainer

    overrides = [*_layout_overrides(world, 1), "train.checkpoint_every=0", mix]
    Trainer(tiny().with_overrides(overrides), run_dir, progress=False).train()


def test_two_ranks_read_the_mix_one_process_reads(tmp_path):
    """Each rank takes its slice of the global batch of a data.sources mix; together they train
    on the same sequences, and count the same tokens per source, as one process."""
    cache, mix = str(tmp_path / "cache"), two_source_mix(tmp_path)
    run_distributed(_train_mix, 2, str(tmp_path / "two"), cache, mix)
    _train_mix(0, 1, str(tmp_path / "one"), cache, mix)
    records = {}
    for run in ("one", "two"):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        records[run] = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    for one, two in zip(records["one"], records["two"], strict=True):
        assert abs(one["loss"] - two["loss"]) <= 1e-6 * abs(one["loss"]), (one["step"], one, two)
        assert one["tokens_per_source"] == two["tokens_per_source"]


def _train_compiled(rank, world, run_dir, cache, overrides):
    os.environ["MOETRAIN_CACHE"] = cache
    from moetrain.train.trainer import Trainer

    common = [
        "model.num_layers=1",
        "train.steps=3",
        "train.log_every=1",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        "train.micro_batch_size=2",
        f"train.global_batch_tokens={2 * 2 * SEQ}",
        "parallel.compile=true",
        "precision.param_dtype=bf16",  # compiled, torch._grouped_mm takes bf16 only
    ]
    Trainer(tiny().with_overrides([*common, *overrides]), run_dir, progress=False).train()


@pytest.mark.slow
def test_compiled_no_sync_ep2_matches_one_process(tmp_path):
    """The trainer's compiled blocks at ep 2 with the NoSync dispatcher (one graph a block, its
    collectives traced) train like one compiled process accumulating both micro-batches: bf16,
    so the loss within 1e-3 relative (tests/gpu/test_gpu_multirank.py's bound)."""
    cache = str(tmp_path / "cache")
    nosync = ["parallel.ep=2", "moe.dispatcher=no_sync", "moe.capacity_factor=4"]
    run_distributed(_train_compiled, 2, str(tmp_path / "two"), cache, nosync)
    _train_compiled(0, 1, str(tmp_path / "one"), cache, [])
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(one) == sorted(two) == [1, 2, 3]
    for step in one:
        assert abs(one[step] - two[step]) <= 1e-3 * abs(one[step]), (step, one[step], two[step])


def _resume_at_two(rank, world, run_dir, cache, overrides):
    os.environ["MOETRAIN_CACHE"] = cache
    from moetrain.train.trainer import Trainer

    config = tiny().with_overrides(overrides)
    try:
        Trainer(config, run_dir, resume=True, progress=False).train()
    except ValueError as error:
        return str(error)
    return None


def test_a_resume_at_another_world_size_keeps_its_tokens_a_step_or_says_how(tmp_path):
    """With train.global_batch_tokens unset, the global batch follows the ranks: a run of 128
    tokens a step resumed on two ranks would train 256. That is refused, naming the setting that
    keeps it; setting the new size explicitly resumes."""
    cache, run = str(tmp_path / "cache"), tmp_path / "run"
    base = ["train.micro_batch_size=2", "train.log_every=1", "train.eval_every=0"]
    base += ["train.checkpoint_every=2", "train.optimizer=sharded"]
    _train_with(0, 1, str(run), cache, [*base, "train.steps=2"])
    refused = run_distributed(_resume_at_two, 2, str(run), cache, [*base, "train.steps=4"])
    for message in refused:
        assert "trained 128 tokens a step" in message and "would train 256" in message, message
        assert "--set train.global_batch_tokens=128 keeps it" in message, message
    explicit = [*base, "train.steps=4", f"train.global_batch_tokens={4 * SEQ}"]
    assert run_distributed(_resume_at_two, 2, str(run), cache, explicit) == [None, None]
    assert set(_losses(run)) == {1, 2, 3, 4}


def _train_with(rank, world, run_dir, cache, overrides):
    os.environ["MOETRAIN_CACHE"] = cache
    from moetrain.train.trainer import Trainer

    Trainer(tiny().with_overrides(overrides), run_dir, progress=False).train()
