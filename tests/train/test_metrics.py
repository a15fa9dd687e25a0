"""Where records go: the metrics hub and its sinks (metrics.jsonl, TensorBoard, the console),
the metrics.jsonl reader, and the scalars TensorBoard and W&B log."""

import json
import sys

import pytest

from moetrain.config.presets import tiny
from moetrain.train.console import Console
from moetrain.train.metrics import open_metrics
from moetrain.train.metrics_jsonl import JsonlWriter, read_metrics
from moetrain.train.routing_stats import routing_summary
from moetrain.train.tensorboard_log import TensorBoardWriter, scalar_tags


def _summary(tokens, **kwargs):
    args = {"lb_loss": 1.0, "z_loss": 0.0, "lb_weight": 0.01, "z_weight": 0.001, **kwargs}
    return routing_summary(tokens, **args)


# --- the hub -------------------------------------------------------------------------------


def _records():
    moe = {"layer": 0, **_summary([8, 4, 4, 0])}
    train = {"kind": "train", "step": 2, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5,
             "tokens_per_s": 1000.0, "mfu": None, "skipped_steps": 0, "moe": [moe]}  # fmt: skip
    return train, {"kind": "eval", "step": 2, "val_loss": 2.75}


def _open(run_dir, *, is_main=True, console=True):
    run_dir.mkdir()
    config = tiny().with_overrides(["train.steps=4"])
    return open_metrics(
        run_dir, config, is_main=is_main, console=console, start_step=0, resumed=False
    )


def test_the_hub_writes_every_record_to_every_sink(tmp_path, capsys):
    """metrics.jsonl, TensorBoard and the console (last) each get both records."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = _open(tmp_path / "run")
    assert [type(s) for s in metrics.sinks] == [JsonlWriter, TensorBoardWriter, Console]
    train, evals = _records()
    metrics.write(train)
    metrics.write(evals)
    metrics.note("note: a message")
    metrics.close()
    assert read_metrics(tmp_path / "run") == ([train], [evals])
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    assert [(p.step, p.value) for p in events.Scalars("loss/train")] == [(2, 2.5)]
    assert [(p.step, p.value) for p in events.Scalars("loss/val")] == [(2, 2.75)]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[2] == "note: a message"
    assert lines[0].startswith("step 2/4  loss 2.5000  lr 1.00e-03  gnorm 0.50  1,000 tok/s")
    assert lines[1].startswith("step 2/4  val_loss 2.7500")


def test_only_the_main_rank_writes_and_a_quiet_run_prints_nothing(tmp_path, capsys):
    train, _ = _records()
    other = _open(tmp_path / "other", is_main=False)
    quiet = _open(tmp_path / "quiet", console=False)
    for metrics in (other, quiet):
        metrics.write(train)
        metrics.note("note: a message")
        metrics.close()
    assert list((tmp_path / "other").iterdir()) == []
    assert read_metrics(tmp_path / "quiet") == ([train], [])
    assert capsys.readouterr().out == ""


def test_a_record_after_a_line_cut_short_starts_on_a_fresh_line(tmp_path):
    """A crash cut the last line short; the resumed run's first record must not join it."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_train(10, 3.0)) + '\n{"kind": "tr')
    writer = JsonlWriter(tmp_path)
    writer.write(_train(20, 2.6))
    writer.close()
    train, _ = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in train] == [(10, 3.0), (20, 2.6)]


def test_a_resumed_run_drops_the_records_it_redoes(tmp_path):
    """Resumed at step 20, the records past it (and a line cut short) are dropped before the
    run's own are appended: each step once; a start at the file's last step drops nothing."""
    lines = [_train(10, 3.0), {"kind": "eval", "step": 20, "val_loss": 3.1}, _train(20, 2.6)]
    lines += [_train(30, 2.5), {"kind": "eval", "step": 30, "val_loss": 2.9}]
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"kind": "train", "step": 40, "lo'
    (tmp_path / "metrics.jsonl").write_text(text)
    writer = JsonlWriter(tmp_path, start_step=20)
    assert writer.dropped == 2
    writer.write(_train(30, 2.4))
    writer.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [*lines[:3], _train(30, 2.4)]
    writer = JsonlWriter(tmp_path, start_step=30)
    assert writer.dropped == 0
    writer.close()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 4


# --- metrics.jsonl ----------------------------------------------------------------------------


def _train(step, loss):
    return {"kind": "train", "step": step, "loss": loss, "moe": []}


def test_read_metrics_splits_sorts_and_tolerates_truncation(tmp_path):
    lines = [
        json.dumps(_train(10, 3.0)),
        json.dumps({"kind": "eval", "step": 10, "val_loss": 3.1}),
        json.dumps(_train(20, 2.5)),
        json.dumps({"kind": "bench", "step": 20}),  # unknown kinds are ignored
        "",
        '{"kind": "train", "step": 30, "lo',  # crash mid-write
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines))
    train, evals = read_metrics(path)
    assert [r["step"] for r in train] == [10, 20]
    assert [r["val_loss"] for r in evals] == [3.1]
    assert read_metrics(tmp_path) == (train, evals)  # a run directory works too


def test_read_metrics_resumed_run_keeps_latest_record_per_step(tmp_path):
    first = [_train(10, 3.0), _train(20, 2.5), _train(30, 2.4)]
    resumed = [_train(30, 2.3), _train(40, 2.2)]  # resumed from the step-20 checkpoint
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first + resumed))
    train, _ = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in train] == [(10, 3.0), (20, 2.5), (30, 2.3), (40, 2.2)]


def test_read_metrics_skips_a_cut_line_that_a_resumed_run_appended_to(tmp_path):
    text = json.dumps(_train(10, 3.0)) + "\n" + '{"kind": "train", "step": 20, "lo'
    text += json.dumps(_train(20, 2.6)) + "\n" + json.dumps(_train(30, 2.4)) + "\n"
    (tmp_path / "metrics.jsonl").write_text(text)
    train, _ = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in train] == [(10, 3.0), (30, 2.4)]


def test_read_metrics_missing_file(tmp_path):
    with pytest.raises(ValueError, match="no metrics file"):
        read_metrics(tmp_path)


# --- TensorBoard ------------------------------------------------------------------------------


def test_tensorboard_writer_is_a_noop_without_tensorboard(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now fails
    messages = []
    writer = TensorBoardWriter(tmp_path, log=messages.append)
    assert not writer.enabled
    assert len(messages) == 1 and "pip install tensorboard" in messages[0]
    writer.write({"kind": "train", "step": 1, "loss": 2.0})
    writer.close()
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_writer_writes_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = TensorBoardWriter(tmp_path)
    assert writer.enabled
    moe = {"layer": 1, **_summary([8, 4, 4, 0], entropy=0.7)}
    writer.write({"kind": "train", "step": 5, "loss": 2.5, "lr": 1e-3, "mfu": None, "moe": [moe]})
    writer.write({"kind": "eval", "step": 5, "val_loss": 2.75})
    writer.close()

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss/train", "loss/val", "optim/lr", "moe/1/max_mean", "moe/1/entropy"} <= tags
    assert "perf/mfu" not in tags and "moe/1/drop_frac" not in tags  # None values are skipped
    (point,) = events.Scalars("moe/1/max_mean")
    assert point.step == 5 and point.value == pytest.approx(2.0)
    assert events.Scalars("loss/val")[0].value == pytest.approx(2.75)


def test_scalar_tags_name_each_source_of_a_mix():
    train = {"step": 4, "loss": 2.0, "mfu": None, "tokens_per_source": {"web": 70, "code": 30}}
    train["epoch_per_source"] = {"web": 1, "code": 0}
    assert scalar_tags(train) == {
        "loss/train": 2.0,
        **{"data/tokens/web": 70, "data/tokens/code": 30},
        **{"data/epoch/web": 1, "data/epoch/code": 0},
    }
    assert scalar_tags({"step": 4, "epoch": 2}) == {"data/epoch": 2}
    evals = {"step": 4, "val_loss": 2.5, "val_loss_per_source": {"web": 2.0, "code": 3.0}}
    assert scalar_tags(evals) == {"loss/val": 2.5, "loss/val/web": 2.0, "loss/val/code": 3.0}
    evals = {"step": 4, "val_loss": 2.5, "eval_sets": {"wiki": 3.5}, "tasks": {"qa": {"acc": 0.5}}}
    assert scalar_tags(evals) == {"loss/val": 2.5, "loss/eval/wiki": 3.5, "tasks/qa/acc": 0.5}
