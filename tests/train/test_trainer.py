"""End-to-end training on CPU: loss goes down, resume is bitwise, faults are handled."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import two_source_mix

from moetrain.checkpoint import manager
from moetrain.cli import main
from moetrain.config.presets import tiny
from moetrain.moe.random_router import RandomRouter
from moetrain.train.checkpointing import Checkpointer
from moetrain.train.trainer import Trainer, TrainingStopped


def _cfg(*overrides):
    return tiny().with_overrides(["train.log_every=2", "train.eval_every=0", *overrides])


def _train_losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if r["kind"] == "train"}


def test_loss_decreases_on_tiny(tmp_cache, tmp_path):
    summary = Trainer(
        _cfg("train.steps=40", "train.eval_every=40"), tmp_path / "run", progress=False
    ).train()
    losses = _train_losses(tmp_path / "run")
    assert losses[40] < losses[2] - 1.0, losses
    assert summary["final_val_loss"] < 3.5  # ln(320) = 5.8 at random init
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    for key in (
        "loss",
        "lb_loss",
        "z_loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "tflops",
        "peak_mem_gib",
        "moe",
    ):
        assert key in record
    assert len(record["moe"]) == 2 and sum(record["moe"][0]["tokens_per_expert"]) > 0


def test_fp8_training_on_tiny_tracks_bf16(tmp_cache, tmp_path):
    """FP8 projections, expert GEMMs and LM head (the emulation: the CPU has no FP8 tensor cores)
    against bf16 (parameters and GEMMs; fp32 masters, as on a GPU) from the same seed on the
    same batches: the loss falls as bf16's does and ends within 2% of it."""
    bf16 = _cfg("train.steps=20", "precision.param_dtype=bf16")
    fp8 = bf16.with_overrides(
        [
            "precision.linear=fp8_rowwise",
            "precision.experts=fp8_rowwise",
            "precision.lm_head=fp8_rowwise",
        ]
    )
    Trainer(bf16, tmp_path / "bf16", progress=False).train()
    Trainer(fp8, tmp_path / "fp8", progress=False).train()
    a, b = _train_losses(tmp_path / "fp8"), _train_losses(tmp_path / "bf16")
    assert a[20] < a[2] - 1.0, a
    assert a[2] != b[2]  # the FP8 rounding is there
    assert abs(a[20] - b[20]) < 0.02 * b[20], (a[20], b[20])


def _records(run_dir: Path, kind: str) -> dict[int, dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if r["kind"] == kind}


def _task_file(path: Path) -> Path:
    items = [
        {"context": f"def f{i}(x):\n    return", "choices": [" x + 1", " the", "()"], "answer": 0}
        for i in range(5)
    ]
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def test_resume_is_bitwise(tmp_cache, tmp_path, monkeypatch):
    """Train losses, weights and every evaluation (val loss, an eval set, a task) of a run
    resumed at step 6 equal the uninterrupted run's bit for bit."""
    web = two_source_mix(tmp_path).split("path: ")[1].split(",")[0]
    evals = (
        "train.checkpoint_every=6",
        "train.eval_every=4",
        f"data.eval_sets=[{{name: web, path: {web}}}]",
        f"train.eval_tasks=[{_task_file(tmp_path / 'fn.jsonl')}]",
    )
    Trainer(_cfg("train.steps=12", *evals), tmp_path / "full", progress=False).train()
    Trainer(_cfg("train.steps=6", *evals), tmp_path / "part", progress=False).train()
    hashed = []  # a resume reads each checkpoint file's bytes for its hash once, not twice
    sha256 = manager._sha256
    monkeypatch.setattr(manager, "_sha256", lambda path: hashed.append(path) or sha256(path))
    # A resumed run with a longer horizon must reuse the same schedule: resume with steps=12
    t = Trainer(_cfg("train.steps=12", *evals), tmp_path / "part", resume=True, progress=False)
    assert t.step == 6
    assert len(hashed) == len(set(hashed)) == len(list(t.resumed_from.iterdir())) - 1
    t.train()
    full, part = _train_losses(tmp_path / "full"), _train_losses(tmp_path / "part")
    for step in (8, 10, 12):
        assert full[step] == part[step], (step, full[step], part[step])
    full, part = _records(tmp_path / "full", "eval"), _records(tmp_path / "part", "eval")
    assert sorted(full) == [4, 8, 12] and sorted(part) == [4, 6, 8, 12]
    assert set(full[12]["eval_sets"]) == {"web"} and set(full[12]["tasks"]) == {"fn"}
    for step in (8, 12):
        assert full[step] == part[step], (step, full[step], part[step])
    ta = Trainer(_cfg("train.steps=12", *evals), tmp_path / "full", resume=True, progress=False)
    tb = Trainer(_cfg("train.steps=12", *evals), tmp_path / "part", resume=True, progress=False)
    for (name, p), (_, q) in zip(
        ta.model.state_dict().items(), tb.model.state_dict().items(), strict=True
    ):
        assert torch.equal(p, q), name


def test_a_resume_after_a_crash_logs_each_step_once(tmp_cache, tmp_path, capsys):
    """A run that logged steps past its newest checkpoint (its step-4 checkpoint lost, as by a
    crash in that save) redoes them on resume: metrics.jsonl then holds each step once, the
    redone steps' records, whose losses equal the first attempt's (the resume is bitwise)."""
    run = tmp_path / "run"
    cfg = _cfg(
        "train.steps=4", "train.log_every=1", "train.checkpoint_every=2", "train.eval_every=2"
    )
    Trainer(cfg, run, progress=False).train()
    first = _train_losses(run)
    newest = manager.list_complete(run / "checkpoints")[-1]
    shutil.rmtree(newest)
    capsys.readouterr()
    resumed = Trainer(cfg, run, resume=True, progress=True)
    assert resumed.step == 2
    resumed.train()
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [
        ("train", 1), ("train", 2), ("eval", 2), ("train", 3), ("train", 4), ("eval", 4)
    ]  # fmt: skip
    assert _train_losses(run) == first
    assert "metrics.jsonl: dropped 3 records past step 2" in capsys.readouterr().out


def test_resume_is_bitwise_on_a_two_source_mix(tmp_path, capsys):
    mix = two_source_mix(tmp_path)
    common = (mix, "train.checkpoint_every=4", "train.eval_every=4", "train.eval_sequences=8")
    Trainer(_cfg("train.steps=8", *common), tmp_path / "full", progress=False).train()
    Trainer(_cfg("train.steps=4", *common), tmp_path / "part", progress=False).train()
    Trainer(_cfg("train.steps=8", *common), tmp_path / "part", resume=True, progress=False).train()
    full, part = _train_losses(tmp_path / "full"), _train_losses(tmp_path / "part")
    assert [full[s] for s in (6, 8)] == [part[s] for s in (6, 8)]
    assert _records(tmp_path / "full", "eval")[8] == _records(tmp_path / "part", "eval")[8]
    records = {}
    for run in ("full", "part"):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        records[run] = [json.loads(x) for x in lines]
    last = {run: [r for r in rs if r["kind"] == "train"][-1] for run, rs in records.items()}
    tokens = last["full"]["tokens_per_source"]
    assert tokens == last["part"]["tokens_per_source"]
    seq_len, sequences = 64, 8 * 8  # tiny: seq_len 64, micro-batch 8; 8 steps
    assert sum(tokens.values()) == sequences * seq_len
    assert abs(tokens["web"] - 0.7 * sequences * seq_len) <= seq_len
    evals = [r for r in records["full"] if r["kind"] == "eval"]
    assert len(evals) == 2 and set(evals[-1]["val_loss_per_source"]) == {"web", "code"}
    per_source = evals[-1]["val_loss_per_source"]
    mixed = 0.7 * per_source["web"] + 0.3 * per_source["code"]
    assert evals[-1]["val_loss"] == pytest.approx(mixed)
    assert main(["eval", "--checkpoint", str(tmp_path / "full")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == 8 and result["data"].startswith("the val splits of data.sources")
    # the run's own evaluation, from its checkpoint: the same sequences, the same losses
    assert (
        result["val_loss_per_source"] == per_source and result["val_loss"] == evals[-1]["val_loss"]
    )


def test_resume_is_bitwise_with_document_masking_on_a_two_source_mix(tmp_path):
    """The done-when of document masking: a 70/30 mix of documents shorter than a sequence
    (every row holds several), masked with positions reset, killed after a checkpoint and
    resumed: the same losses and weights bit for bit; the loss goes down, and masking changed
    it."""
    mix = two_source_mix(tmp_path, repeats=2, num_docs=300)
    masking = ("data.document_masking=true", "data.reset_positions=true")
    common = (mix, *masking, "train.checkpoint_every=4", "train.log_every=1")
    Trainer(_cfg("train.steps=8", *common), tmp_path / "full", progress=False).train()
    Trainer(_cfg("train.steps=4", *common), tmp_path / "part", progress=False).train()
    resumed = Trainer(
        _cfg("train.steps=8", *common), tmp_path / "part", resume=True, progress=False
    )
    assert resumed.step == 4 and resumed.config.data.eos_id == 256
    resumed.train()
    full, part = _train_losses(tmp_path / "full"), _train_losses(tmp_path / "part")
    assert [full[s] for s in range(5, 9)] == [part[s] for s in range(5, 9)]
    assert full[8] < full[1] - 1.0, full
    whole = Trainer(_cfg("train.steps=8", *common), tmp_path / "full", resume=True, progress=False)
    for (name, p), q in zip(
        whole.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(p, q), name
    plain = (mix, "train.steps=2", "train.log_every=1")
    Trainer(_cfg(*plain), tmp_path / "plain", progress=False).train()
    assert _train_losses(tmp_path / "plain")[2] != full[2]


def test_resume_is_bitwise_with_random_routing(tmp_cache, tmp_path):
    """The random routers' draw counters travel in the checkpoint (each router's own state), so
    experts are redrawn alike."""
    common = ("train.steps=8", "train.checkpoint_every=4", "moe.routing=random")
    Trainer(_cfg(*common), tmp_path / "full", progress=False).train()
    Trainer(
        _cfg("train.steps=4", "train.checkpoint_every=4", "moe.routing=random"),
        tmp_path / "part",
        progress=False,
    ).train()
    Trainer(_cfg(*common), tmp_path / "part", resume=True, progress=False).train()
    full, part = _train_losses(tmp_path / "full"), _train_losses(tmp_path / "part")
    assert [full[s] for s in (6, 8)] == [part[s] for s in (6, 8)]


def test_resume_is_bitwise_from_a_checkpoint_with_the_draws_in_the_trainer_state(
    tmp_cache, tmp_path, monkeypatch
):
    """Checkpoints written before the random routers kept their draws in their own state recorded
    the count as trainer.json's routing_draws: resuming one reads it there, and stays bitwise."""
    common = ("train.steps=8", "train.checkpoint_every=4", "moe.routing=random")
    Trainer(_cfg(*common), tmp_path / "full", progress=False).train()
    own_state = Checkpointer.trainer_state
    with monkeypatch.context() as before:  # the checkpoint the code before wrote
        before.delattr(RandomRouter, "get_extra_state")
        before.setattr(
            Checkpointer,
            "trainer_state",
            lambda self, step: {
                **own_state(self, step),
                "routing_draws": max(m.router.draws for m in self.model.moe_layers()),
            },
        )
        Trainer(_cfg(*common[1:], "train.steps=4"), tmp_path / "part", progress=False).train()
    saved = tmp_path / "part" / "checkpoints" / "step-4"
    assert json.loads((saved / manager.TRAINER_STATE).read_text())["routing_draws"] > 0
    assert not [k for k in manager.read_metadata(saved).state_dict_metadata if "extra" in k]
    Trainer(_cfg(*common), tmp_path / "part", resume=True, progress=False).train()
    full, part = _train_losses(tmp_path / "full"), _train_losses(tmp_path / "part")
    assert [full[s] for s in (6, 8)] == [part[s] for s in (6, 8)]


def test_non_finite_steps_are_skipped_then_stop(tmp_cache, tmp_path, monkeypatch):
    from moetrain.train import step as train_step

    real = train_step.forward_backward
    calls = {"n": 0}

    def poisoned(model, batches, accum, no_sync=None):
        calls["n"] += 1
        loss = real(model, batches, accum, no_sync)
        if calls["n"] in (3,) or calls["n"] >= 7:
            for p in model.parameters():
                p.grad.fill_(float("nan"))
        return loss

    monkeypatch.setattr(train_step, "forward_backward", poisoned)
    trainer = Trainer(
        _cfg("train.steps=20", "train.max_bad_steps=3"), tmp_path / "run", progress=False
    )
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(TrainingStopped, match="consecutive"):
        trainer.train()
    assert trainer.bad_steps.skipped_total >= 4
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert (tmp_path / "run" / "checkpoints" / f"step-{trainer.step}").is_dir()


def test_sigterm_saves_and_exits_zero(tmp_cache, tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moetrain",
            "train",
            "--preset",
            "tiny",
            "--run-dir",
            str(run_dir),
            "--set",
            "train.steps=100000",
            "--set",
            "train.log_every=1",
            "--set",
            "train.eval_every=0",
            "--set",
            "train.checkpoint_every=0",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (run_dir / "metrics.jsonl").exists():
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "checkpoint saved to" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["stopped_early"] and Path(summary["checkpoint"]).is_dir()


def test_the_worst_steps_load_is_logged_next_to_the_intervals(tmp_cache, tmp_path, capsys):
    """Logged every 4 steps, each layer's max_mean_peak is the largest max/mean of one step: the
    max of the same run's per-step max_mean logged every step; the console shows it."""
    every_step = _records_of(_cfg("train.steps=8", "train.log_every=1"), tmp_path / "a")
    capsys.readouterr()
    every_4 = _records_of(_cfg("train.steps=8", "train.log_every=4"), tmp_path / "b", True)
    assert "(step peak " in capsys.readouterr().out
    for step in (4, 8):
        for layer in range(2):
            per_step = [every_step[s]["moe"][layer]["max_mean"] for s in range(step - 3, step + 1)]
            logged = every_4[step]["moe"][layer]
            assert logged["max_mean_peak"] == pytest.approx(max(per_step), rel=1e-5)
            assert logged["max_mean"] <= logged["max_mean_peak"]


def _records_of(config, run_dir: Path, progress: bool = False) -> dict[int, dict]:
    Trainer(config, run_dir, progress=progress).train()
    return _records(run_dir, "train")


def test_a_run_stopped_between_evaluations_reports_when_its_val_loss_was_measured(
    tmp_cache, tmp_path, monkeypatch
):
    """Ctrl-C after step 3 of a run evaluated every 2 steps: the summary's final_val_loss is
    None (nothing was evaluated at step 3), and the last val loss comes with its step."""

    def ctrl_c_after_step_3(step: int, rank: int) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # the trainer's handler: finish, save, return

    monkeypatch.setattr("moetrain.train.trainer.faults.after_step", ctrl_c_after_step_3)
    run = tmp_path / "run"
    summary = Trainer(_cfg("train.steps=10", "train.eval_every=2"), run, progress=False).train()
    assert summary["steps"] == 3 and summary["stopped_early"]
    assert summary["final_val_loss"] is None
    evaluated = _records(run, "eval")
    assert sorted(evaluated) == [2] and summary["last_val_step"] == 2
    assert summary["last_val_loss"] == evaluated[2]["val_loss"]
    assert summary["final_loss"] == _records(run, "train")[3]["loss"]  # logged at the stop


def test_capacity_drops_and_buffer_use_are_logged(tmp_cache, tmp_path):
    """NoSync at ep=1 with capacity factor 1.0 drops the routes beyond capacity and says so."""
    Trainer(
        _cfg("train.steps=4", "moe.dispatcher=no_sync", "moe.capacity_factor=1.0"),
        tmp_path / "run",
        progress=False,
    ).train()
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    for layer in record["moe"]:
        assert 0.0 < layer["drop_frac"] < 0.5
        assert 0.5 < layer["buffer_utilization"] <= 1.0


def test_fresh_start_never_mixes_with_an_earlier_run(tmp_cache, tmp_path):
    """Without --resume a used run directory is an error (its newer checkpoints would outrank and
    rotate away the new ones); --overwrite deletes the earlier run and starts over."""
    run = tmp_path / "run"
    Trainer(_cfg("train.steps=4", "train.checkpoint_every=2"), run, progress=False).train()
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert before == ["step-2", "step-4"]
    with pytest.raises(ValueError, match="--resume.*--overwrite"):
        Trainer(_cfg("train.steps=2"), run, progress=False)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before  # untouched
    Trainer(
        _cfg("train.steps=2", "train.checkpoint_every=2"), run, progress=False, overwrite=True
    ).train()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]
    assert max(_train_losses(run)) == 2  # the earlier run's metrics are gone
    # the CLI says the same, with a nonzero exit status and no traceback
    result = subprocess.run(
        [sys.executable, "-m", "moetrain", "train", "--preset", "tiny", "--run-dir", str(run),
         "--device", "cpu", "--quiet"],
        capture_output=True, text=True, env={**os.environ, "MOETRAIN_CACHE": str(tmp_cache)},
    )  # fmt: skip
    assert result.returncode != 0 and "--overwrite" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def _train_dense_world2(rank, world_size, run_dir):
    config = _cfg(
        "train.steps=2", "train.log_every=1", "train.checkpoint_every=0", "model.num_dense_layers=2"
    ).with_overrides(["parallel.dp=2"])
    trainer = Trainer(config, run_dir, device="cpu", progress=False)
    assert not trainer.model.moe_layers()
    return trainer.train()["steps"]


@pytest.mark.distributed
def test_data_parallel_logging_of_a_model_without_moe_layers(tmp_cache, tmp_path):
    """The log-time reduction of router statistics has no rows to reduce: it must not fail."""
    from conftest import run_distributed

    assert run_distributed(_train_dense_world2, 2, str(tmp_path / "run")) == [2, 2]
