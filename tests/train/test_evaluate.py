"""Evaluation (moetrain/train/evaluate.py): fixed sequences, equal to a plain reference, the same
at every evaluation and at dp=2 x ep=2 as in one process; multiple-choice tasks; eval sets."""

import json
import os

import numpy as np
import pytest
import torch
from conftest import run_distributed, two_source_mix

from moetrain.config.presets import tiny
from moetrain.data import ByteTokenizer, open_data, prepare
from moetrain.data.heldout import WindowRows, heldout_windows, open_eval_set
from moetrain.data.tasks import Task, TaskRows, continuation_task, read_task
from moetrain.model.transformer import build_model
from moetrain.train.evaluate import Evaluator, score_rows

SEQ = 64


def _model(*overrides: str):
    config = tiny().with_overrides(["train.eval_sequences=13", *overrides])
    return build_model(config), config


def _task(num_items: int = 7) -> Task:
    rng = np.random.default_rng(3)
    words = ["alpha", "beta", "gamma", "delta", "the end", "return x"]
    contexts = tuple(f"item {i}: " + " ".join(rng.choice(words, 30)) for i in range(num_items))
    choices = tuple(tuple(f" {w}" for w in rng.choice(words, 2 + i % 3)) for i in range(num_items))
    answers = tuple(int(rng.integers(len(c))) for c in choices)
    return Task("words", contexts, choices, answers)


def _write_task(task: Task, path) -> None:
    items = zip(task.contexts, task.choices, task.answers, strict=True)
    lines = [json.dumps({"context": c, "choices": list(o), "answer": a}) for c, o, a in items]
    path.write_text("".join(line + "\n" for line in lines))


@torch.no_grad()
def _reference_logliks(model, task: Task) -> list[list[float]]:
    """Each choice's log-likelihood after its context, from one unpadded forward per pair."""
    tok, out = ByteTokenizer(), []
    for context, options in zip(task.contexts, task.choices, strict=True):
        row = []
        for choice in options:
            target = tok.encode(choice)
            ids = torch.tensor(([tok.eos_id] + tok.encode(context) + target)[-(SEQ + 1) :])
            logp = model.logits(model(ids[None, :-1])).float().log_softmax(-1)[0]
            picked = logp[-len(target) :].gather(1, torch.tensor(target)[:, None])
            row.append(picked.sum().item())
        out.append(row)
    return out


def test_evaluation_is_fixed_and_equals_a_plain_reference(tmp_path):
    """The val loss is the mean NLL over the 13 windows heldout_windows picks, whatever the
    micro-batch; a second evaluation gives bitwise the same record; task scores and
    accuracies are those of unpadded forwards of each (context, choice)."""
    task = _task()
    _write_task(task, tmp_path / "words.jsonl")
    model, config = _model(f"train.eval_tasks=[{tmp_path / 'words.jsonl'}]")
    tokens = np.random.default_rng(0).integers(0, 256, 50 * SEQ + 1)
    evaluator = Evaluator(config, model, ByteTokenizer(), tokens, eval_sets={"again": [tokens]})
    first, second = evaluator.run(5), evaluator.run(5)
    assert first == second and first["eval_sets"]["again"] == first["val_loss"]

    windows = heldout_windows(50, 13)
    assert len(set(windows.tolist())) == 13 and windows[-1] >= 45  # spread over the split
    batch = torch.from_numpy(np.stack([tokens[w * SEQ : w * SEQ + SEQ + 1] for w in windows]))
    model.eval()
    with torch.no_grad():
        reference = model.loss(model(batch[:, :-1]), batch[:, 1:]).item()
    assert first["val_loss"] == pytest.approx(reference, rel=1e-6)
    rows = WindowRows([tokens], SEQ, 13, "tokens")
    sums = [score_rows(model, rows, micro) for micro in (3, 8)]
    torch.testing.assert_close(sums[0], sums[1], rtol=1e-6, atol=0)

    expected = _reference_logliks(model, task)
    scored = -score_rows(model, evaluator.tasks[0], 4)
    got = [
        [scored[r].item() for r in rows_i if r >= 0] for rows_i in evaluator.tasks[0].choice_rows
    ]
    for a, b in zip(got, expected, strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    acc = np.mean([np.argmax(b) == t for b, t in zip(expected, task.answers, strict=True)])
    lengths = [[len(c) for c in options] for options in task.choices]
    norm = [np.array(b) / n for b, n in zip(expected, lengths, strict=True)]
    acc_norm = np.mean([np.argmax(b) == t for b, t in zip(norm, task.answers, strict=True)])
    assert first["tasks"]["words"] == {"acc": acc, "acc_norm": acc_norm}


def _score_at_step_0(rank, world, run_dir, cache, overrides):
    os.environ["MOETRAIN_CACHE"] = cache
    from moetrain.train.trainer import Trainer

    config = tiny().with_overrides(overrides + ([] if world == 1 else ["parallel.ep=2"]))
    trainer = Trainer(config, run_dir, progress=False)
    return trainer.evaluator.run(0)


def test_dp2_ep2_evaluation_equals_one_process(tmp_path):
    """Two ranks (ep=2, the all-to-all dispatcher) deal the 13 windows, the eval set's windows
    and the task's pairs between them, padded to equal micro-batches: the record equals one
    process's, which scores them all. Not bit for bit: at ep=2 each rank's expert products run
    on half the experts, whose other shapes may accumulate in another order (a relative ~1e-9
    seen on 2-core CPUs); every row still has exactly one contributor, so a row scored twice or
    dropped shows as a difference of whole windows, far above the 1e-6 tolerance."""
    cache = str(tmp_path / "cache")
    web = two_source_mix(tmp_path).split("path: ")[1].split(",")[0]
    task = tmp_path / "words.jsonl"
    task = tmp_path / "words.jsonl"
    _write_task(_task(), task)
    overrides = [
        "train.eval_sequences=13",
        "train.micro_batch_size=2",
        "moe.dispatcher=all_to_all",
        f"data.eval_sets=[{{name: web, path: {web}}}]",
        f"train.eval_tasks=[{task}]",
    ]
    two = run_distributed(_score_at_step_0, 2, str(tmp_path / "two"), cache, overrides)
    one = _score_at_step_0(0, 1, str(tmp_path / "one"), cache, overrides)
    assert set(one) == {"kind", "step", "val_loss", "eval_sets", "tasks"}
    for record in two:
        assert _flat(record) == pytest.approx(_flat(one), rel=1e-6, abs=0)


def _flat(record: dict, prefix: str = "") -> dict:
    """A nested record's leaves under dotted keys (pytest.approx compares flat mappings)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_task_files_and_the_built_in_task(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text('{"context": "a", "choices": [" b", " c"], "answer": 1}\n\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"qa.jsonl:3: an item must be an object"):
        read_task(path)
    path.write_text('{"context": "a", "choices": [" b", " c"], "answer": 2}\n')
    with pytest.raises(ValueError, match=r"qa.jsonl:1: \"answer\" must be the index"):
        read_task(path)
    with pytest.raises(ValueError, match="neither a file nor a built-in task"):
        read_task(tmp_path / "missing.jsonl")
    task = continuation_task()
    assert len(task.contexts) == 200 and {len(c) for c in task.choices} == {4}
    assert 0.15 < np.mean(np.array(task.answers) == 0) < 0.35  # the right choice moves around
    with pytest.raises(ValueError, match="cannot be scored in rows of train.seq_len"):
        TaskRows(task, ByteTokenizer(), 8)  # 16-character choices


@pytest.mark.parametrize("val_fraction", [0.03, 0.05, 0.08])
def test_the_built_in_task_comes_from_the_runs_held_out_documents(val_fraction, module_cache):
    """Every passage of the run's `continuation` items (context and right choice) lies in a
    document of the val split the run's loader holds out, none of which it trains on."""
    model, config = _model(f"data.val_fraction={val_fraction}", "train.eval_tasks=[continuation]")
    train, val, tokenizer = open_data(config.data, config.model.vocab_size)
    task = Evaluator(config, model, tokenizer, val).tasks[0].task

    def documents(tokens: np.ndarray) -> list[bytes]:  # byte ids; EOS ends each document
        ends = np.flatnonzero(tokens == tokenizer.eos_id)
        return [d.astype(np.uint8).tobytes() for d in np.split(tokens, ends + 1)[:-1]]

    held_out, trained = documents(np.asarray(val)), set(documents(np.asarray(train)))
    for context, choices, answer in zip(task.contexts, task.choices, task.answers, strict=True):
        passage = (context + choices[answer]).encode()
        sources = [doc for doc in held_out if passage in doc]
        assert sources and not any(doc in trained for doc in sources), passage


def test_eval_sets_are_checked(tmp_path, tmp_cache):
    """An eval set must speak the run's vocabulary and must not be its training data."""
    config = tiny()
    (tmp_path / "docs.jsonl").write_text('{"text": "hello there"}\n' * 40)
    other = prepare([tmp_path / "docs.jsonl"], tmp_path / "other", progress=False)
    arrays = open_eval_set(config.data, other, 320, "data.eval_sets (other)")
    assert sum(len(a) for a in arrays) == 40 * len("hello there") + 40
    web = two_source_mix(tmp_path).split("path: ")[1].split(",")[0]
    on_web = config.with_overrides([f"data.path={web}"]).data
    with pytest.raises(ValueError, match="holds the tokens the run trains on"):
        open_eval_set(on_web, web, 320, "data.eval_sets (web)")
    meta = json.loads((tmp_path / "other" / "meta.json").read_text())
    (tmp_path / "other" / "meta.json").write_text(json.dumps({**meta, "eos_id": 0}))
    with pytest.raises(ValueError, match=r"data.eval_sets \(other\) has \(tokenizer"):
        open_eval_set(config.data, other, 320, "data.eval_sets (other)")
