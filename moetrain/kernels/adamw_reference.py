"""Plain-torch AdamW with the signature and semantics of `adamw_triton.multi_tensor_adamw_`.

The twin the Triton kernel is tested against, a per-tensor loop: fp32 per element in the
kernel's order (torch's single-tensor AdamW, decoupled weight decay), bias corrections in fp64
from the step tensor; any device, no host sync (a nonzero `found_inf` applies through
`torch.where`). The caller advances the step only on steps that count: `step += 1 - found_inf`.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def adamw_reference_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    masters: list[torch.Tensor] | None,
    step: torch.Tensor,
    *,
    lr: float,
    weight_decay: float,
    beta1: float,
    beta2: float,
    eps: float,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """AdamW on each tensor in place; see `multi_tensor_adamw_` for the arguments."""
    step_size = (lr / (1 - beta1 ** step.double())).float()
    bc2_sqrt = (1 - beta2 ** step.double()).sqrt().float()
    skip = None if found_inf is None else found_inf != 0
    if masters is None:
        masters = [None] * len(params)
    for p, grad, m, v, master in zip(params, grads, exp_avgs, exp_avg_sqs, masters, strict=True):
        g = grad.float() if grad_scale is None else grad.float() / grad_scale
        w = (p if master is None else master).float()
        w = w * (1 - lr * weight_decay)
        m_new = beta1 * m.float() + (1 - beta1) * g
        v_new = beta2 * v.float() + (1 - beta2) * g * g
        denom = v_new.sqrt() / bc2_sqrt + eps
        w = w - step_size * m_new / denom
        targets = [(m, m_new), (v, v_new), (p, w)] + ([(master, w)] if master is not None else [])
        for dst, new in targets:
            new = new.to(dst.dtype)
            dst.copy_(new if skip is None else torch.where(skip, dst, new))
