"""Evaluation: a run's validation loss, its evaluation sets and its multiple-choice tasks, scored
on the same rows at every evaluation and in every layout (docs/design.md "Evaluation scores fixed
rows, in any layout").

Row i goes to dp rank i mod dp, in micro-batches of the training shape padded with unscored rows,
so every rank runs the same forwards (EP and pipeline collectives need it). A row's summed NLL
lands in its own slot of a float64 vector summed over dp and pp: one contributor a slot, so the
sum is exact. One host read per evaluation; nothing is checkpointed. The record is
metrics.jsonl's "eval" kind (train/metrics_jsonl.py). `evaluate_checkpoint` is `moetrain eval`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moetrain.checkpoint import manager
from moetrain.config import RunConfig
from moetrain.data import check_same_data, open_data, source_labels
from moetrain.data.heldout import IGNORE, WindowRows, open_eval_set
from moetrain.data.loader import embedded_val_fraction
from moetrain.data.tasks import Task, TaskRows, load_tasks
from moetrain.model.transformer import Transformer
from moetrain.parallel.data import all_reduce_stats
from moetrain.parallel.mesh import ParallelDims
from moetrain.parallel.pipeline import Pipeline

LOGIT_TOKENS = 2048  # tokens whose fp32 logits exist at once while scoring


def token_nll(model: Transformer, h_BSD: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood (fp32) of each target given the final hidden states; 0 where the
    target is IGNORE. The logits are formed LOGIT_TOKENS tokens at a time."""
    h_TD, targets_T = h_BSD.reshape(-1, h_BSD.shape[-1]), targets_BS.reshape(-1)
    nll = []
    for start in range(0, len(targets_T), LOGIT_TOKENS):
        logits_CV = model.logits(h_TD[start : start + LOGIT_TOKENS]).float()
        t_C = targets_T[start : start + LOGIT_TOKENS]
        picked_C = logits_CV.gather(1, t_C.clamp(min=0)[:, None]).squeeze(1)
        nll.append(torch.where(t_C >= 0, logits_CV.logsumexp(1) - picked_C, 0.0))
    return torch.cat(nll).view_as(targets_BS)


def _slot_sums(model: Transformer, h_BSD: torch.Tensor, packed_BS1: torch.Tensor, num_slots: int):
    """Each row's summed NLL in its slot (the packed last column) of a num_slots + 1 vector (the
    last slot takes the padding rows)."""
    sums_B = token_nll(model, h_BSD, packed_BS1[:, :-1]).double().sum(1)
    out = torch.zeros(num_slots + 1, dtype=torch.float64, device=h_BSD.device)
    return out.index_add_(0, packed_BS1[:, -1], sums_B)


def score_rows(
    model: Transformer,
    rows: WindowRows | TaskRows,
    micro_batch: int,
    dims: ParallelDims | None = None,
    pipeline: Pipeline | None = None,
) -> torch.Tensor:
    """The summed NLL of every row (float64, on the device), on every rank."""
    num, dp, rank = rows.num_rows, (dims.dp if dims else 1), (dims.dp_rank if dims else 0)
    device = next(model.parameters()).device
    accum = pipeline.layout.accum_steps if pipeline is not None else 1
    num_micro = math.ceil(math.ceil(math.ceil(num / dp) / micro_batch) / accum) * accum
    slots = np.full(num_micro * micro_batch, num, dtype=np.int64)  # num: padding
    mine = np.arange(rank, num, dp)
    slots[: len(mine)] = mine
    sources = np.where(slots < num, slots, mine[0] if len(mine) else 0)  # padding repeats a row

    def micro_batches():
        for start in range(0, len(slots), micro_batch):
            slot_B = slots[start : start + micro_batch]
            inputs_BS, targets_BS = rows.rows(sources[start : start + micro_batch])
            targets_BS = np.where(slot_B[:, None] < num, targets_BS, IGNORE)
            packed = np.concatenate([targets_BS, slot_B[:, None]], axis=1)
            yield torch.from_numpy(inputs_BS).to(device), torch.from_numpy(packed).to(device)

    score_fn = partial(_slot_sums, model, num_slots=num)
    if pipeline is not None:
        outputs = pipeline.score(micro_batches(), num_micro // accum, score_fn)
    else:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            outputs = [score_fn(model(inputs), packed) for inputs, packed in micro_batches()]
        model.train(was_training)
    total = torch.zeros(num + 1, dtype=torch.float64, device=device)
    for part in outputs:
        total += part
    if dims is not None:
        all_reduce_stats([total], dims)
        if dims.pp_group is not None:
            dist.all_reduce(total, group=dims.pp_group)
    return total[:num]


class Evaluator:
    """A run's evaluation: its validation rows, evaluation sets and tasks, scored by `run`.
    `val` is `open_data`'s val tokens (one array, or one per source of a mix, the record then
    showing each and their weighted mean), or {label: token arrays} to score instead."""

    def __init__(
        self,
        config: RunConfig,
        model: Transformer,
        tokenizer: Any,
        val: Any,
        *,
        eval_sets: dict[str, list[np.ndarray]] | None = None,
        dims: ParallelDims | None = None,
        pipeline: Pipeline | None = None,
    ) -> None:
        t = config.train
        self.model, self.dims, self.pipeline, self.weights = model, dims, pipeline, None
        if config.data.sources and not isinstance(val, dict):
            self.weights = [s.weight for s in config.data.sources]
            val = {label: [v] for label, v in zip(source_labels(config.data), val, strict=True)}
        elif not isinstance(val, dict):
            val = {"val": [val]}
        self.micro_batch, self.seq_len = t.micro_batch_size, t.seq_len

        def windows(arrays: list[np.ndarray], what: str) -> WindowRows:
            return WindowRows(arrays, t.seq_len, t.eval_sequences, what)

        self.val = {label: windows(a, f"the val split of {label}") for label, a in val.items()}
        if eval_sets is None:
            eval_sets = {
                s.name: open_eval_set(
                    config.data, s.path, config.model.vocab_size, f"data.eval_sets ({s.path})"
                )
                for s in config.data.eval_sets
            }
        self.eval_sets = {name: windows(a, f"eval set {name}") for name, a in eval_sets.items()}
        if t.eval_tasks and tokenizer is None:
            raise ValueError(
                f"train.eval_tasks ({', '.join(t.eval_tasks)}) needs a tokenizer, and the run's "
                "data names none (random tokens, or a pre-tokenized corpus prepared without --tokenizer)"
            )
        tasks = load_tasks(t.eval_tasks, embedded_val_fraction(config.data))
        self.tasks = [TaskRows(task, tokenizer, t.seq_len) for task in tasks]

    @property
    def num_sequences(self) -> int:
        """Validation sequences scored (per source of a mix)."""
        return min(rows.num_rows for rows in self.val.values())

    def _loss(self, rows: WindowRows) -> torch.Tensor:
        sums = score_rows(self.model, rows, self.micro_batch, self.dims, self.pipeline)
        return sums.sum() / (rows.num_rows * self.seq_len)

    def _choice_logliks(self, rows: TaskRows) -> torch.Tensor:
        """loglik_IC: each item's choices' log-likelihoods (float64; -inf past its last)."""
        loglik = -score_rows(self.model, rows, self.micro_batch, self.dims, self.pipeline)
        rows_IC = torch.as_tensor(rows.choice_rows, device=loglik.device)
        return torch.where(rows_IC >= 0, loglik[rows_IC.clamp(min=0)], -math.inf)

    @staticmethod
    def _accuracy(rows: TaskRows, loglik_IC: torch.Tensor) -> torch.Tensor:
        """(acc, acc_norm): the right choice has the highest log-likelihood, in total and per
        character."""
        chars_IC, answers_I = (
            torch.as_tensor(x, device=loglik_IC.device) for x in (rows.choice_chars, rows.answers)
        )
        hits = [
            (x.argmax(1) == answers_I).double().mean() for x in (loglik_IC, loglik_IC / chars_IC)
        ]
        return torch.stack(hits)

    def run(self, step: int, *, per_item: bool = False) -> dict[str, Any]:
        """Score everything; the eval record of `step` (the same on every rank). `per_item`
        adds "items": one `task_items` row per task item, in task then item order."""
        values = [self._loss(rows) for rows in (*self.val.values(), *self.eval_sets.values())]
        logliks = [self._choice_logliks(rows) for rows in self.tasks]
        values += [self._accuracy(r, x) for r, x in zip(self.tasks, logliks, strict=True)]
        host = torch.cat([v.reshape(-1) for v in values]).tolist()
        losses, host = host[: len(self.val)], host[len(self.val) :]
        record: dict[str, Any] = {"kind": "eval", "step": step}
        if self.weights is None:
            record["val_loss"] = losses[0]
        else:
            mixed = sum(w * v for w, v in zip(self.weights, losses, strict=True))
            record["val_loss"] = mixed / sum(self.weights)
            record["val_loss_per_source"] = dict(zip(self.val, losses, strict=True))
        if self.eval_sets:
            record["eval_sets"] = dict(zip(self.eval_sets, host, strict=False))
            host = host[len(self.eval_sets) :]
        if self.tasks:
            record["tasks"] = {
                r.task.name: {"acc": host[2 * i], "acc_norm": host[2 * i + 1]}
                for i, r in enumerate(self.tasks)
            }
        if per_item:
            record["items"] = [
                item
                for rows, loglik_IC in zip(self.tasks, logliks, strict=True)
                for item in task_items(rows.task, loglik_IC.cpu().tolist())
            ]
        return record


def task_items(task: Task, loglik_IC: list[list[float]]) -> list[dict[str, Any]]:
    """One record a task item, as `moetrain eval --per-item` writes it: its choices'
    log-likelihoods (total and per character), the choice each picks (`prediction`,
    `prediction_norm`; the first of a tie, as `acc` counts it), the answer and whether each
    prediction is right. The mean of `correct` is the task's acc, of `correct_norm` its acc_norm."""
    items = []
    for i, (choices, answer) in enumerate(zip(task.choices, task.answers, strict=True)):
        loglik = loglik_IC[i][: len(choices)]
        per_char = [x / len(c) for x, c in zip(loglik, choices, strict=True)]
        predicted, predicted_norm = (
            max(range(len(x)), key=x.__getitem__) for x in (loglik, per_char)
        )
        items.append(
            {
                "task": task.name,
                "item": i,
                "loglik": loglik,
                "loglik_per_char": per_char,
                "prediction": predicted,
                "prediction_norm": predicted_norm,
                "answer": answer,
                "correct": predicted == answer,
                "correct_norm": predicted_norm == answer,
            }
        )
    return items


def describe_data(config: RunConfig) -> str:
    d = config.data
    if d.sources:
        return "the val splits of data.sources " + ", ".join(s.path for s in d.sources)
    if d.path is not None:
        return f"the val split of data.path {d.path}"
    return f"the val split of the embedded corpus (data.path unset; tokenizer {d.tokenizer})"


def evaluate_checkpoint(
    checkpoint: str | Path,
    *,
    device: str = "cpu",
    data: str | None = None,
    tasks: list[str] | None = None,
    sequences: int | None = None,
    per_item: str | Path | None = None,
) -> dict[str, Any]:
    """`moetrain eval`: by default what the run's own evaluations score (its val split, eval sets
    and tasks, from the checkpoint's config); `data`: both splits of that token directory
    instead; `tasks` replaces the config's tasks; `per_item`: a JSON-lines file that gets one
    `task_items` record per task item. The result names what it scored."""
    from moetrain.checkpoint.trained_model import checkpoint_tokenizer, load_model

    path = manager.resolve(checkpoint)
    model, config = load_model(path, device)
    trainer_state = json.loads((path / manager.TRAINER_STATE).read_text())
    train = config.train
    if sequences is not None:
        train = dataclasses.replace(train, eval_sequences=sequences)
    if tasks is not None:
        train = dataclasses.replace(train, eval_tasks=tuple(tasks))
    config = dataclasses.replace(config, train=train)
    if per_item is not None and not train.eval_tasks:
        raise ValueError(
            "--per-item writes task items, and the run has no train.eval_tasks: name tasks "
            "with --tasks"
        )
    tokenizer = checkpoint_tokenizer(path, config) if train.eval_tasks else None
    result: dict[str, Any] = {"checkpoint": str(path), "step": trainer_state.get("step")}
    if data is None:
        check_same_data(config.data, trainer_state.get("data_fingerprint"), path)
        val = open_data(config.data, config.model.vocab_size)[1]
        evaluator = Evaluator(config, model, tokenizer, val)
        result["data"] = describe_data(config)
        if "imported_from" in trainer_state and config.data.path is None:
            result["note"] = (
                f"imported from {trainer_state['imported_from']}, the checkpoint names no "
                "training data: this scored the embedded corpus; pass --data DIR to score a "
                "token directory"
            )
    else:
        arrays = open_eval_set(config.data, data, config.model.vocab_size, f"--data ({data})")
        evaluator = Evaluator(config, model, tokenizer, {data: arrays}, eval_sets={})
        result["data"] = f"{data} (both splits)"
    record = evaluator.run(result["step"], per_item=per_item is not None)
    record.pop("kind")
    record.pop("step")
    if per_item is not None:
        items = record.pop("items")
        Path(per_item).write_text("".join(json.dumps(item) + "\n" for item in items))
        result["per_item"] = f"{per_item} ({len(items)} items)"
    return {
        **result,
        "sequences": evaluator.num_sequences,
        **record,
        "perplexity": math.exp(record["val_loss"]),
    }
