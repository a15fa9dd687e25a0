"""One optimizer step's forward and backward passes: each accumulation micro-batch's mean
cross-entropy scaled by 1/accum (the MoE layers' auxiliary losses at the same scale), under
`no_sync` but for the last; returns the mean loss as a device tensor (no host read).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from moetrain.model.transformer import Transformer

Batch = tuple[torch.Tensor, torch.Tensor]


def set_aux_grad_scale(model: Transformer, scale: float) -> None:
    for layer in model.moe_layers():
        layer.aux_grad_scale = scale


def forward_backward(
    model: Transformer,
    batches: Iterator[Batch],
    accum_steps: int,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> torch.Tensor:
    set_aux_grad_scale(model, 1.0 / accum_steps)
    loss_sum = None
    for micro in range(accum_steps):
        inputs_BS, targets_BS = next(batches)
        last = micro == accum_steps - 1
        ctx = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
        with ctx:
            loss = model.loss(model(inputs_BS), targets_BS)
            (loss / accum_steps).backward()
        loss = loss.detach()
        loss_sum = loss if loss_sum is None else loss_sum + loss
    return loss_sum / accum_steps
