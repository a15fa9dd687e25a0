"""Learning-rate schedules as pure functions of the (0-based) optimizer step: a linear warmup,
then cosine or linear decay to `min_lr_ratio * lr`, constant, or wsd (warmup-stable-decay: the
decay takes the last `decay_fraction` of the steps, so more steps move it to the new end and a run
resumed before its decay continues without a jump). `lr_change` says what a resume's changed
schedule or LR multipliers do to each parameter kind's LR and refuses an unasked-for jump.
"""

from __future__ import annotations

import math

from moetrain.config import TrainConfig
from moetrain.optim.param_groups import lr_mults

SCHEDULE_FIELDS = ("steps", "lr", "min_lr_ratio", "warmup_steps", "schedule", "decay_fraction")


def lr_at(step: int, train: TrainConfig) -> float:
    peak, floor = train.lr, train.lr * train.min_lr_ratio
    if step < train.warmup_steps:
        return peak * (step + 1) / train.warmup_steps
    if train.schedule == "constant":
        return peak
    total = max(train.steps - 1, 1)
    if train.schedule == "wsd":
        decay_start = _decay_start(train)
        if step < decay_start:
            return peak
        progress = (step - decay_start) / max(total - decay_start, 1)
        return peak + (floor - peak) * min(progress, 1.0)
    progress = min((step - train.warmup_steps) / max(total - train.warmup_steps, 1), 1.0)
    if train.schedule == "linear":
        return peak + (floor - peak) * progress
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _decay_start(train: TrainConfig) -> int:
    return max(train.warmup_steps, int(train.steps * (1 - train.decay_fraction)))


def lr_change(old: TrainConfig, new: TrainConfig, step: int, allow_increase: bool) -> str | None:
    """What the LR does after `step` completed steps when a resume changes the schedule or a
    parameter kind's multiplier (`param_groups.lr_mults`) from `old` to `new` (None when neither
    changed or no step is left): per kind that changed (the schedule's LR, which the dense
    parameters train at; an expert or router multiplier), its last value and its values at the
    new schedule's next step and its corners up to `new.steps`, by the step numbers logs use
    (the LR of log step n is lr_at(n - 1)). A kind's next LR above both its last one and what
    `old` would have given it (a re-warm: the loss rises) is a ValueError unless
    `allow_increase`; the error's advice, given back verbatim, passes this check."""
    if step >= new.steps:
        return None
    schedule_changed = any(getattr(old, f) != getattr(new, f) for f in SCHEDULE_FIELDS)
    old_mults, new_mults = lr_mults(old), lr_mults(new)
    kinds = [k for k in new_mults if old_mults[k] != new_mults[k]]
    if schedule_changed:
        kinds.insert(0, "dense")
    if not kinds:
        return None
    notes, rising = [], []
    for kind in kinds:
        note, jumps = _group_change(kind, old, new, step, old_mults[kind], new_mults[kind])
        notes.append(note)
        if jumps:
            rising.append((kind, note))
    if rising and not allow_increase:
        raise ValueError(
            f"--resume: {'; '.join(note for _, note in rising)}: a jump above the LR the run "
            "last trained with, which re-warms it (the loss rises). Pass --allow-lr-increase "
            "(Trainer(..., allow_lr_increase=True)) if that is meant; "
            + "; ".join(_how_to_keep(kind, old, step) for kind, _ in rising)
        )
    return "; ".join(notes)


def _group_change(
    kind: str, old: TrainConfig, new: TrainConfig, step: int, old_mult: float, new_mult: float
) -> tuple[str, bool]:
    """(what the LR of parameters of `kind` does, whether it jumps up) on resume at `step`:
    its next value and its corners (the end of the warmup, the start of a wsd decay, the last
    step) among the steps the run still trains."""
    corners = {new.warmup_steps - 1, new.steps - 1}
    if new.schedule == "wsd":
        corners.add(_decay_start(new) - 1)
    last = lr_at(step - 1, old) * old_mult if step > 0 else None
    following = lr_at(step, new) * new_mult
    digits = _digits_apart(last, following) if last is not None else 3
    points = [f"{following:.{digits}g} at step {step + 1}"]
    points += [
        f"{lr_at(c, new) * new_mult:.3g} at step {c + 1}"
        for c in sorted(corners)
        if step < c < new.steps
    ]
    was = f"from {last:.{digits}g} (step {step}) " if last is not None else ""
    what = "the LR"  # the dense parameters' multiplier is 1: the schedule's own
    if kind != "dense":
        what = f"the {kind} LR (train.{kind}_lr_mult {old_mult:g} -> {new_mult:g})"
    note = f"{what} goes {was}to {', then '.join(points)} ({new.schedule})"
    would = lr_at(step, old) * old_mult
    jumps = last is not None and following > max(last, would) * (1 + 1e-9)
    return note, jumps


def _digits_apart(a: float, b: float) -> int:
    """Significant digits (3 or more) that show two LRs as different when they differ by more
    than the jump check's tolerance (float noise stays hidden)."""
    digits, apart = 3, abs(a - b) > 1e-9 * max(abs(a), abs(b))
    while apart and digits < 17 and f"{a:.{digits}g}" == f"{b:.{digits}g}":
        digits += 1
    return digits


def _how_to_keep(kind: str, old: TrainConfig, step: int) -> str:
    """How to resume without the jump of `kind`'s LR."""
    if kind != "dense":
        mult = lr_mults(old)[kind]
        shown = f"{mult:g}" if float(f"{mult:g}") == mult else repr(mult)
        return f"to keep the {kind} LR, leave train.{kind}_lr_mult at {shown}"
    last = lr_at(step - 1, old)
    if last <= 0:
        return "the run last trained at an LR of 0 (train.min_lr_ratio 0), so any LR is a jump"
    return (
        f"to go on at the current LR, --set train.schedule=constant --set train.lr="
        f"{at_most(last)} --set train.warmup_steps=0. A wsd schedule extends without a jump "
        "while the run has not reached its decay"
    )


def at_most(value: float) -> str:
    """The shortest decimal of 3 or more significant digits that does not exceed `value`: an LR
    printed as advice, which the jump check must accept when given back verbatim (`.3g` alone
    may round it up)."""
    for digits in range(3, 17):
        text = f"{value:.{digits}g}"
        if float(text) <= value:
            return text
    return repr(value)  # round-trips exactly
