"""Learning-rate schedules as pure functions of the step (0-based optimizer step).

All share a linear warmup from ~0 to `lr` over `warmup_steps`, then:
- cosine: cosine decay to `min_lr_ratio * lr` at the last step
- linear: linear decay to `min_lr_ratio * lr`
- wsd: warmup-stable-decay: constant, then linear decay over the last `decay_fraction` of steps
- constant
"""

from __future__ import annotations

import math

from moetrain.config import TrainConfig


def lr_at(step: int, train: TrainConfig) -> float:
    peak, floor = train.lr, train.lr * train.min_lr_ratio
    if step < train.warmup_steps:
        return peak * (step + 1) / train.warmup_steps
    if train.schedule == "constant":
        return peak
    total = max(train.steps - 1, 1)
    if train.schedule == "wsd":
        decay_start = max(train.warmup_steps, int(train.steps * (1 - train.decay_fraction)))
        if step < decay_start:
            return peak
        progress = (step - decay_start) / max(total - decay_start, 1)
        return peak + (floor - peak) * min(progress, 1.0)
    progress = min((step - train.warmup_steps) / max(total - train.warmup_steps, 1), 1.0)
    if train.schedule == "linear":
        return peak + (floor - peak) * progress
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))
