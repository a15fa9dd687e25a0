"""Multiple-choice tasks for downstream evaluation: read, build in, and cut into scoring rows.

An item is a context, two or more choices and the right one's index; the model picks the choice
of highest log-likelihood after the context (`acc`) or per character (`acc_norm`), scored by
train/evaluate.py. A user's task is a JSON-lines file named by its stem, one item a line:
{"context": "The capital of France is", "choices": [" Paris", " Rome"], "answer": 0}. Context
and choice are tokenized separately and joined after the tokenizer's EOS (so a choice carries
its leading space). A row over seq_len loses context from the left; a choice over seq_len
tokens is an error. Built in: `continuation` (offline, from the embedded corpus's documents
held out at the run's data.val_fraction, the loader's val split, so never a document the run
trains on): the true continuation of a passage among 4 spans, 200 items.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moetrain.data.corpus import embedded_documents
from moetrain.data.heldout import IGNORE
from moetrain.data.loader import EMBEDDED_VAL_FRACTION
from moetrain.data.tokens import split_documents


@dataclass(frozen=True)
class Task:
    name: str
    contexts: tuple[str, ...]
    choices: tuple[tuple[str, ...], ...]
    answers: tuple[int, ...]


def load_tasks(
    specs: tuple[str, ...] | list[str], val_fraction: float = EMBEDDED_VAL_FRACTION
) -> list[Task]:
    """Each spec is a built-in task's name or a JSON-lines file; names must differ. A built-in
    task takes the embedded corpus's documents held out at `val_fraction` (the run's
    `loader.embedded_val_fraction`)."""
    tasks = [BUILTIN[s](val_fraction) if s in BUILTIN else read_task(s) for s in specs]
    names = [t.name for t in tasks]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"two evaluation tasks are named {name!r}: {', '.join(specs)}")
    return tasks


def read_task(path: str | Path) -> Task:
    """A task from a JSON-lines file; a ValueError names the file and line of a bad item."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"evaluation task {path} is neither a file nor a built-in task ({', '.join(BUILTIN)})"
        )
    contexts, choices, answers = [], [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            context, options, answer = _item(json.loads(line))
        except (json.JSONDecodeError, ValueError) as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
        contexts.append(context)
        choices.append(options)
        answers.append(answer)
    if not contexts:
        raise ValueError(f"evaluation task {path} holds no items")
    return Task(path.stem, tuple(contexts), tuple(choices), tuple(answers))


def _item(item: Any) -> tuple[str, tuple[str, ...], int]:
    if not isinstance(item, dict):
        raise ValueError('an item must be an object {"context", "choices", "answer"}')
    context, choices, answer = item.get("context"), item.get("choices"), item.get("answer")
    if not isinstance(context, str):
        raise ValueError(f'"context" must be a string, got {context!r}')
    if not isinstance(choices, list) or len(choices) < 2:
        raise ValueError(f'"choices" must be a list of two or more strings, got {choices!r}')
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"every choice must be a non-empty string, got {choices!r}")
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise ValueError(f'"answer" must be the index of a choice, 0..{len(choices) - 1}')
    return context, tuple(choices), answer


@functools.cache  # a Task is immutable; reading the corpus takes seconds
def continuation_task(
    val_fraction: float = EMBEDDED_VAL_FRACTION,
    num_items: int = 200,
    num_choices: int = 4,
    seed: int = 0,
) -> Task:
    """The built-in task: 256 characters of a document held out at `val_fraction`, then its
    next 16 characters or 16 characters of another held-out document, all cut at a space."""
    split = split_documents(embedded_documents(), val_fraction)
    docs = [d for label, d in split if label == "val"]
    docs = [d for d in docs if len(d) >= 2048]
    if len(docs) < num_choices:
        raise ValueError("the embedded corpus holds too few documents for the built-in task")
    rng = np.random.default_rng(seed)
    context_chars, choice_chars = 256, 16

    def span_start(doc: str) -> int:  # a space at least context_chars in, room for a choice
        while True:
            start = doc.find(" ", int(rng.integers(context_chars, len(doc) - 2 * choice_chars)))
            if 0 <= start <= len(doc) - choice_chars:
                return start

    contexts, choices, answers = [], [], []
    while len(contexts) < num_items:
        picked = rng.choice(len(docs), size=num_choices, replace=False)
        starts = [span_start(docs[i]) for i in picked]
        spans = [docs[i][s : s + choice_chars] for i, s in zip(picked, starts, strict=True)]
        if len(set(spans)) < num_choices:
            continue
        answer = int(rng.integers(num_choices))
        spans[0], spans[answer] = spans[answer], spans[0]
        contexts.append(docs[picked[0]][starts[0] - context_chars : starts[0]])
        choices.append(tuple(spans))
        answers.append(answer)
    return Task("continuation", tuple(contexts), tuple(choices), tuple(answers))


BUILTIN = {"continuation": continuation_task}


class TaskRows:
    """A task's (context, choice) pairs as scoring rows of seq_len tokens: row r of item i is
    `choice_rows[i, j]` for its choice j (-1 past an item's last choice); the choice's tokens
    are scored, the context's and the padding's are IGNORE."""

    def __init__(self, task: Task, tokenizer: Any, seq_len: int) -> None:
        self.task = task
        eos = tokenizer.eos_id
        prefix = [eos] if eos is not None else []
        pairs = [(i, c) for i, options in enumerate(task.choices) for c in options]
        self.num_rows = len(pairs)
        self._inputs = np.full((self.num_rows, seq_len), eos or 0, dtype=np.int64)
        self._targets = np.full((self.num_rows, seq_len), IGNORE, dtype=np.int64)
        contexts = [prefix + list(tokenizer.encode(c)) for c in task.contexts]
        for row, (item, choice) in enumerate(pairs):
            tokens = list(tokenizer.encode(choice))
            if not 0 < len(tokens) <= seq_len or not contexts[item]:
                raise ValueError(
                    f"task {task.name}, item {item}: a choice of {len(tokens)} tokens after a "
                    f"context of {len(contexts[item])} cannot be scored in rows of train.seq_len "
                    f"({seq_len}) tokens (a choice needs 1 to seq_len, the context at least 1)"
                )
            ids = (contexts[item] + tokens)[-(seq_len + 1) :]
            n = len(ids) - 1
            self._inputs[row, :n] = ids[:-1]
            self._targets[row, n - len(tokens) : n] = ids[-len(tokens) :]
        width = max(len(options) for options in task.choices)
        self.choice_rows = np.full((len(task.choices), width), -1, dtype=np.int64)
        self.choice_chars = np.ones((len(task.choices), width))
        row = 0
        for i, options in enumerate(task.choices):
            self.choice_rows[i, : len(options)] = np.arange(row, row + len(options))
            self.choice_chars[i, : len(options)] = [len(c) for c in options]
            row += len(options)
        self.answers = np.asarray(task.answers, dtype=np.int64)

    def rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._inputs[indices], self._targets[indices]
