"""Learning-rate schedules as pure functions of the (0-based) optimizer step: a linear warmup,
then cosine or linear decay to `min_lr_ratio * lr`, constant, or wsd (warmup-stable-decay: the
decay takes the last `decay_fraction` of the steps, so more steps move it to the new end and a run
resumed before its decay continues without a jump). `lr_change` says what a resume's changed
schedule does to the LR and refuses an unasked-for jump.
"""

from __future__ import annotations

import math

from moetrain.config import TrainConfig

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
    """What the LR does after `step` completed steps when a resume changes the schedule from
    `old` to `new` (None when no schedule field changed or no step is left): its last value and
    its values at the new schedule's next step and corners, by the step numbers logs use (the
    LR of log step n is lr_at(n - 1)). A next LR above both the last one and what `old` would
    have used (a re-warm: the loss rises) is a ValueError unless `allow_increase`."""
    if step >= new.steps or all(getattr(old, f) == getattr(new, f) for f in SCHEDULE_FIELDS):
        return None
    corners = {new.warmup_steps - 1, new.steps - 1}
    if new.schedule == "wsd":
        corners.add(_decay_start(new) - 1)
    points = [f"{lr_at(step, new):.3g} at step {step + 1}"]
    points += [f"{lr_at(c, new):.3g} at step {c + 1}" for c in sorted(corners) if c > step]
    last = lr_at(step - 1, old) if step > 0 else None
    was = f"from {last:.3g} (step {step}) " if last is not None else ""
    note = f"the LR goes {was}to {', then '.join(points)} ({new.schedule})"
    rising = last is not None and lr_at(step, new) > max(last, lr_at(step, old)) * (1 + 1e-9)
    if rising and not allow_increase:
        raise ValueError(
            f"--resume: {note}: a jump above the LR the run last trained with, which re-warms "
            "it (the loss rises). Pass --allow-lr-increase (Trainer(..., allow_lr_increase="
            f"True)) if that is meant; to go on at the current LR, --set train.schedule=constant "
            f"--set train.lr={last:.3g} --set train.warmup_steps=0. A wsd schedule extends "
            "without a jump while the run has not reached its decay"
        )
    return note
