"""What a user meets after the first run, through the command line: progress in a log file, a
run that outlasts its data, relative paths (eval sets and task files too, read from another
directory), a tokenizer named by another path, a validation share the token directory does not
have, extending a run (each parameter kind's LR), the router's learned bias on resume, and a
requeued fine-tune (--init-from with --resume). One tiny run (2 steps on a small token directory
that one step reads through) is shared by the module."""

import contextlib
import io
import json
import re
import shutil
import sys

import pytest
import yaml

from moetrain.cli import main
from moetrain.config.presets import tiny
from moetrain.data import resolve_data_paths
from moetrain.data.tokenizer_files import byte_tokenizer_json
from moetrain.train.trainer import Trainer

RUN = ["--set", "train.steps=2", "--set", "train.log_every=1", "--set", "train.eval_every=0"]
RUN += ["--set", "train.warmup_steps=0", "--set", "moe.bias_update_rate=0.01"]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """(work directory, run directory, train command, stdout lines) of a 2-step tiny run started
    in the work directory on the relative token directory `tok`, prepared with one
    tokenizer.json and trained with a byte-identical copy of it at another path."""
    work = tmp_path_factory.mktemp("work")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(work)
        for name in ("a", "b"):  # the same tokenizer file in two places
            (work / name).mkdir()
            (work / name / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json()))
        # one document of 1,100 bytes, half of it for val: 8 windows of 65 tokens in each split
        (work / "book.txt").write_text("".join(f"line {i:04d} of the book\n" for i in range(50)))
        prepare = ["prepare", "book.txt", "--out", "tok", "--val-fraction", "0.5", "--quiet"]
        assert main([*prepare, "--tokenizer", "a/tokenizer.json"]) == 0
        command = ["train", "--preset", "tiny", "--run-dir", "run", *RUN]
        command += ["--set", "data.path=tok", "--set", "data.tokenizer=b/tokenizer.json"]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(command) == 0
    yield work, work / "run", command, out.getvalue().splitlines()


def test_first_run_progress_epochs_and_resolved_paths(first_run, capsys, monkeypatch):
    work, run_dir, _, lines = first_run
    # a log file gets step/total, tokens/s and the time left (#41.13)
    first = next(line for line in lines if line.startswith("step"))
    assert re.search(r"^step 1/2  loss .* tok/s .*  eta \d+:\d\d$", first), first
    # the data wraps after every step: recorded in the metrics and said at each pass (#41.8)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "train"] == [1, 2]
    assert sum("the training data ran out by step" in line for line in lines) == 2
    # the tokenizer was accepted by content (#41.6); paths are stored absolute (#41.5)
    data = yaml.safe_load((run_dir / "config.yaml").read_text())["data"]
    assert data["path"] == str(work / "tok") and data["tokenizer"] == str(work / "b/tokenizer.json")
    monkeypatch.chdir(work.parent)
    assert main(["eval", "--checkpoint", str(run_dir), "--sequences", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2


def test_val_fraction_of_a_token_directory_is_refused(first_run, capsys, monkeypatch):
    work, _, command, _ = first_run
    monkeypatch.chdir(work)
    other = ["--run-dir", "other", "--set", "data.val_fraction=0.1"]
    assert main([*command, *other, "--quiet"]) == 2
    assert "data.val_fraction (0.1) is not the split of" in capsys.readouterr().err


def test_extending_a_run_says_what_the_lr_does_and_refuses_a_jump(first_run, capsys, tmp_path):
    _, run_dir, _, _ = first_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    resume = ["train", "--resume", "--quiet", "--run-dir", str(copy), "--set", "train.steps=4"]
    assert main(resume) == 2  # cosine over 4 steps: the LR climbs back from its floor
    err = capsys.readouterr().err
    assert re.search(r"the LR goes from 0\.0003 \(step 2\) to 0\.00097\d* at step 3", err), err
    assert "--allow-lr-increase" in err and "train.lr=0.0003" in err
    # the Trainer API acts on the same check
    config = yaml.safe_load((copy / "config.yaml").read_text())
    config["train"]["steps"] = 4
    with pytest.raises(ValueError, match="a jump above the LR the run last trained with"):
        Trainer(type(tiny()).from_dict(config), copy, resume=True, progress=False)
    assert main([*resume, "--allow-lr-increase"]) == 0
    assert "train.steps: 2 -> 4; the LR goes from 0.0003 (step 2)" in capsys.readouterr().err


def test_raising_the_experts_lr_on_resume_is_refused_like_the_lr(first_run, capsys, tmp_path):
    """Extended at the LR it last trained with (the refusal's own advice), with the experts' LR
    raised tenfold: refused, naming the experts' LR, unless --allow-lr-increase."""
    _, run_dir, _, _ = first_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    resume = ["train", "--resume", "--quiet", "--run-dir", str(copy), "--set", "train.steps=4"]
    resume += ["--set", "train.schedule=constant", "--set", "train.lr=0.0003"]
    resume += ["--set", "train.warmup_steps=0", "--set", "train.expert_lr_mult=10"]
    assert main(resume) == 2
    err = capsys.readouterr().err
    raised = "the expert LR (train.expert_lr_mult 1 -> 10) goes from 0.0003 (step 2) to 0.003"
    assert f"--resume: {raised} at step 3" in err and "a jump above the LR" in err, err
    assert "leave train.expert_lr_mult at 1" in err and "--allow-lr-increase" in err
    assert main([*resume, "--allow-lr-increase"]) == 0
    err = capsys.readouterr().err
    assert "the LR goes from 0.0003 (step 2) to 0.0003 at step 3" in err, err
    assert f"(constant); {raised} at step 3" in err, err


def test_a_resume_cannot_drop_the_learned_router_bias(first_run, capsys):
    _, run_dir, _, _ = first_run
    resume = ["train", "--resume", "--quiet", "--run-dir", str(run_dir)]
    assert main([*resume, "--set", "moe.bias_update_rate=0"]) == 2
    assert "moe.bias_update_rate cannot change between 0 and > 0" in capsys.readouterr().err
    # another positive rate: the learned bias is loaded (zero at initialization)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["moe"]["bias_update_rate"] = 0.02
    trainer = Trainer(type(tiny()).from_dict(config), run_dir, resume=True, progress=False)
    assert all(m.router.expert_bias_E.abs().sum() > 0 for m in trainer.model.moe_layers())
    trainer.shutdown()


def _losses(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}  # the last of a step


def test_a_requeued_fine_tune_starts_from_init_from_then_resumes_its_own(first_run, monkeypatch):
    """A requeued fine-tuning job repeats `--init-from CKPT --resume`: its first start trains
    from CKPT's weights (as the same run without --resume does, loss for loss), a later start
    from its own newest checkpoint (resuming bitwise, not reloading CKPT)."""
    work, run_dir, command, _ = first_run
    monkeypatch.chdir(work)
    steps = ["--quiet", "--set", "train.checkpoint_every=1"]

    def train(run_dir: str, *extra: str) -> dict[int, float]:
        assert main([*(run_dir if c == "run" else c for c in command), *steps, *extra]) == 0
        return _losses(work / run_dir)

    reference = train("fresh", "--init-from", "run")
    assert _losses(run_dir)[1] != reference[1]  # random weights: CKPT's run's first loss
    assert train("requeued", "--init-from", "run", "--resume") == reference
    shutil.rmtree(work / "requeued" / "checkpoints" / "step-2")  # killed after saving step 1
    assert train("requeued", "--init-from", "run", "--resume") == reference  # step 2 again


def _text_dir(where, name: str, word: str) -> None:
    """A token directory `where/name` of 24 lines of `word`, in the byte tokenizer of `a/`."""
    (where / f"{name}.txt").write_text("".join(f"{word} {i:03d}\n" for i in range(24)))
    prepare = ["prepare", str(where / f"{name}.txt"), "--out", str(where / name), "--quiet"]
    assert main([*prepare, "--tokenizer", str(where / "a/tokenizer.json")]) == 0


def _task(path, word: str) -> None:
    items = [{"context": f"{word} {i}", "choices": [" 1", " ab"], "answer": 0} for i in range(3)]
    path.write_text("".join(json.dumps(item) + "\n" for item in items))


def test_relative_eval_sets_and_task_files_name_the_same_files_from_anywhere(
    first_run, tmp_path, capsys, monkeypatch
):
    """A run started with relative data.eval_sets and train.eval_tasks files records them
    absolute: a resume with its YAML again resumes, and `eval` and `--resume` from another
    directory that holds directories and files of the same names score the run's own."""
    work, _, _, _ = first_run
    monkeypatch.chdir(work)
    _text_dir(work, "wiki", "wiki line")
    _task(work / "mine.jsonl", "x =")
    (work / "eval.yaml").write_text(
        yaml.safe_dump(
            {
                "preset": "tiny",
                "data": {"path": "tok", "eval_sets": [{"name": "wiki", "path": "wiki"}]},
                "train": {
                    "steps": 4,
                    "log_every": 1,
                    "eval_every": 2,
                    "checkpoint_every": 2,
                    "schedule": "constant",
                    "eval_tasks": ["mine.jsonl"],
                },
            }
        )
    )
    run = work / "run-eval"
    train = ["train", "--quiet", "--run-dir", str(run)]
    assert main([*train, "eval.yaml"]) == 0
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    assert recorded["data"]["eval_sets"] == [{"name": "wiki", "path": str(work / "wiki")}]
    assert recorded["train"]["eval_tasks"] == [str(work / "mine.jsonl")]
    final = _records(run, "eval")[4]
    shutil.rmtree(run / "checkpoints" / "step-4")  # a requeue repeats its command: it resumes
    assert main([*train, "eval.yaml", "--resume"]) == 0
    assert _records(run, "eval")[4] == final

    elsewhere = tmp_path / "elsewhere"  # the same names, other contents
    for name in ("a", "tok"):
        shutil.copytree(work / name, elsewhere / name)
    _text_dir(elsewhere, "wiki", "other text")
    _task(elsewhere / "mine.jsonl", "print(")
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main([*train, str(work / "eval.yaml"), "--resume"]) == 2  # its paths name these
    assert "data.eval_sets" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(run)]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert (scored["eval_sets"], scored["tasks"]) == (final["eval_sets"], final["tasks"])
    shutil.rmtree(run / "checkpoints" / "step-4")
    assert main([*train, "--resume"]) == 0
    assert _records(run, "eval")[4] == final


def test_built_in_task_names_stay_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "continuation").mkdir()  # a file of that name does not hide the built-in task
    config = tiny().with_overrides(["train.eval_tasks=[continuation, tasks/mine.jsonl]"])
    tasks = resolve_data_paths(config).train.eval_tasks
    assert tasks == ("continuation", str(tmp_path / "tasks/mine.jsonl"))


def _records(run_dir, kind: str) -> dict[int, dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if r["kind"] == kind}  # the last of a step


def test_eval_per_item_records_agree_with_the_task_scores(first_run, tmp_path, capsys):
    """`eval --tasks FILE --per-item OUT`: one line per item, in file order, with its answer;
    the predictions are the argmax of the log-likelihoods (total and per character) and their
    hit rates are the reported acc and acc_norm."""
    _, run, _, _ = first_run
    words = [" ab", " the book", " cd", " of the", " zq"]  # total and per character differ
    items = [
        {
            "context": f"line {i:04d} of",
            "choices": (words[i % 5 :] + words[: i % 5])[: 2 + i % 4],
            "answer": (3 * i) % (2 + i % 4),
        }
        for i in range(12)
    ]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    out = tmp_path / "items.jsonl"
    capsys.readouterr()
    command = ["eval", "--checkpoint", str(run), "--sequences", "2", "--tasks"]
    assert main([*command, str(tmp_path / "qa.jsonl"), "--per-item", str(out)]) == 0
    score = json.loads(capsys.readouterr().out)["tasks"]["qa"]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["task"], r["item"], r["answer"]) for r in rows] == [
        ("qa", i, item["answer"]) for i, item in enumerate(items)
    ]
    for r, item in zip(rows, items, strict=True):
        assert len(r["loglik"]) == len(item["choices"]) and all(x < 0 for x in r["loglik"])
        lengths = [len(c) for c in item["choices"]]
        assert r["loglik_per_char"] == [x / n for x, n in zip(r["loglik"], lengths, strict=True)]
        assert r["prediction"] == r["loglik"].index(max(r["loglik"]))
        assert r["prediction_norm"] == r["loglik_per_char"].index(max(r["loglik_per_char"]))
        assert r["correct"] == (r["prediction"] == r["answer"])
        assert r["correct_norm"] == (r["prediction_norm"] == r["answer"])
    assert sum(r["correct"] for r in rows) / len(rows) == score["acc"]
    assert sum(r["correct_norm"] for r in rows) / len(rows) == score["acc_norm"]
    assert main([*command[:5], "--per-item", str(out)]) == 2  # the run has no tasks
    assert "--per-item writes task items" in capsys.readouterr().err


def test_export_names_every_missing_optional_package_at_once(
    first_run, tmp_path, capsys, monkeypatch
):
    """The run's tokenizer is a tokenizer.json: its export needs safetensors and tokenizers, and
    without both one message names both; with the byte tokenizer only safetensors."""
    _, run, _, _ = first_run
    for name in ("safetensors", "tokenizers"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    export = ["export", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]
    capsys.readouterr()
    assert main(export) == 2
    err = capsys.readouterr().err
    assert "moetrain export needs the optional packages `safetensors` and `tokenizers`" in err
    assert "pip install safetensors tokenizers (or pip install 'moetrain[hf]')" in err
    assert main([*export, "--tokenizer", "byte"]) == 2
    err = capsys.readouterr().err
    assert (
        "needs the optional package `safetensors`, not installed: pip install safetensors " in err
    )
    assert not (tmp_path / "hf").exists()
