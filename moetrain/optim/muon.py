"""Muon (MomentUm Orthogonalized by Newton-Schulz) for the weight matrices, the replicated AdamW
for everything else (optim/muon_params.py says which is which and why).

Per matrix W with gradient G (clipped by the global norm), momentum buffer M, step lr:
    M <- mu M + G;  U <- G + mu M (Nesterov; M without);  O <- NewtonSchulz(U)
    W <- W (1 - lr wd) - lr x update_rms x sqrt(max(rows, cols)) x O
The scale is Moonlight's RMS match (`MatrixLayout.update_scale`), so `train.lr` and
`train.weight_decay` mean what they mean for AdamW, and every group's lr_mult applies. The
orthogonalization runs batched: every matrix of one shape (all experts of a weight, gate and up
apart, and the same-shaped matrices of other weights) in one `newton_schulz` call.
`muon_update_` is that math on a list of `MuonTensor`s, shared with the sharded Muon
(optim/muon_sharded.py). A true `skip` (device bool) keeps weights and buffers as they were; the
step has no host sync, and `lr` may be a device scalar (a CUDA-graphed step).

`Muon` keeps the optimizer interface (`no_sync()`, `finish_grad_sync()`, `step(lr,
max_grad_norm, skip) -> grad_norm`, `zero_grad()`, `state_dict()`, `load_state_dict()`,
`reset_masters()`) around an `AdamW` that owns the gradient sync, the global norm over all
parameters and the other parameters' update.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moetrain.config import TrainConfig
from moetrain.optim.adamw import AdamW
from moetrain.optim.clip import clip_coefficient, grad_of
from moetrain.optim.muon_params import MatrixLayout, matrix_layout
from moetrain.optim.newton_schulz import newton_schulz

MAX_BATCH_ELEMENTS = 2**27  # matrices of one shape are batched up to this many elements a call


@dataclass(frozen=True)
class MuonSettings:
    """Muon's hyper-parameters (the train.muon_* fields, resolved)."""

    momentum: float
    nesterov: bool
    ns_steps: int
    ns_dtype: torch.dtype
    update_rms: float

    @classmethod
    def from_config(cls, train: TrainConfig) -> MuonSettings:
        return cls(
            momentum=train.muon_momentum,
            nesterov=train.muon_nesterov,
            ns_steps=train.muon_ns_steps,
            ns_dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[train.muon_ns_dtype],
            update_rms=train.muon_update_rms,
        )


@dataclass
class MuonTensor:
    """One tensor of matrices to update: `weight` (fp32 master, parameter or a view of a shard),
    its `grad` and `momentum` buffer (the same shape), and how it is a batch of matrices."""

    weight: torch.Tensor
    grad: torch.Tensor
    momentum: torch.Tensor
    layout: MatrixLayout
    lr_mult: float
    weight_decay: float


@torch.no_grad()
def muon_update_(
    tensors: Sequence[MuonTensor],
    lr: float | torch.Tensor,
    settings: MuonSettings,
    *,
    skip: torch.Tensor,
    grad_scale: float | torch.Tensor | None = None,
) -> None:
    """One Muon step on `tensors` in place (module docstring); each gradient is multiplied by
    `grad_scale` as it is read (the clip factor, over an averaging divisor). Where `skip` is
    true nothing changes."""
    mu = settings.momentum
    inputs = []
    for t in tensors:  # (1) momentum, (2) what is orthogonalized
        g = t.grad.float() if grad_scale is None else t.grad.float() * grad_scale
        momentum = mu * t.momentum + g
        t.momentum.copy_(torch.where(skip, t.momentum, momentum))
        inputs.append(g + mu * momentum if settings.nesterov else momentum)
    # (3) orthogonalize: the matrices of one shape together, up to MAX_BATCH_ELEMENTS a call
    updates: list[torch.Tensor | None] = [None] * len(tensors)
    for batch in matrix_batches(tensors):
        matrices = [tensors[i].layout.to_matrices(inputs[i]) for i in batch]
        out = newton_schulz(torch.cat(matrices), settings.ns_steps, settings.ns_dtype)
        for i, part in zip(batch, out.split([m.shape[0] for m in matrices]), strict=True):
            updates[i] = tensors[i].layout.from_matrices(part, tensors[i].weight.shape)
    # (4) decoupled weight decay and the scaled orthogonal step
    for t, update in zip(tensors, updates, strict=True):
        step_lr = lr * t.lr_mult
        scale = t.layout.update_scale(t.weight.shape, settings.update_rms)
        new = t.weight * (1 - step_lr * t.weight_decay) - (step_lr * scale) * update
        t.weight.copy_(torch.where(skip, t.weight, new))


def matrix_batches(tensors: Sequence[MuonTensor]) -> list[list[int]]:
    """Indices of `tensors` grouped by matrix shape, each group cut at MAX_BATCH_ELEMENTS (a
    tensor larger than that is a batch alone)."""
    by_shape: dict[tuple[int, int], list[list[int]]] = {}
    sizes: dict[tuple[int, int], int] = {}
    for i, t in enumerate(tensors):
        shape = t.layout.matrix_shape(t.weight.shape)
        numel = t.weight.numel()
        batches = by_shape.setdefault(shape, [[]])
        if batches[-1] and sizes[shape] + numel > MAX_BATCH_ELEMENTS:
            batches.append([])
            sizes[shape] = 0
        batches[-1].append(i)
        sizes[shape] = sizes.get(shape, 0) + numel
    return [batch for batches in by_shape.values() for batch in batches]


class Muon:
    """Muon for the matrices of `param_groups` (the Muon half of `split_param_groups`), `adamw`
    for the rest. `adamw` must hold the gradient sync and a norm over every parameter (both
    halves): its `step` returns that norm, from which Muon clips and decides to skip."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        adamw: AdamW,
        settings: MuonSettings,
        *,
        master_weights: bool,
    ) -> None:
        self.adamw, self.settings = adamw, settings
        self.params = [p for g in param_groups for p in g["params"]]
        self.names = [n for g in param_groups for n in g["param_names"]]
        self.hyper = [(g["lr_mult"], g["weight_decay"]) for g in param_groups for _ in g["params"]]
        self.layouts = [matrix_layout(n, p.ndim) for n, p in zip(self.names, self.params, strict=True)]  # fmt: skip
        assert all(layout is not None for layout in self.layouts)
        self.use_masters = master_weights and any(p.dtype != torch.float32 for p in self.params)
        self.masters = (
            [p.detach().float() for p in self.params] if self.use_masters else list(self.params)
        )
        self.momenta = [torch.zeros_like(w) for w in self.masters]

    @property
    def kernel(self) -> str:
        """The AdamW half's update kernel (a CUDA graph needs the Triton one)."""
        return self.adamw.kernel

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.adamw.no_sync()

    def finish_grad_sync(self) -> None:
        self.adamw.finish_grad_sync()

    def step(
        self,
        lr: float | torch.Tensor,
        max_grad_norm: float = 0.0,
        skip: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """AdamW's step (which computes the global norm), then Muon's with the same clip factor
        and skip decision. Returns the norm before clipping, on the device."""
        grad_norm = self.adamw.step(lr, max_grad_norm, skip)
        bad = ~torch.isfinite(grad_norm)
        skip = bad if skip is None else skip | bad
        clip = clip_coefficient(grad_norm.float(), max_grad_norm) if max_grad_norm > 0 else None
        tensors = [
            MuonTensor(weight, grad, momentum, layout, lr_mult, weight_decay)
            for weight, grad, momentum, layout, (lr_mult, weight_decay) in zip(
                self.masters,
                map(grad_of, self.params),
                self.momenta,
                self.layouts,
                self.hyper,
                strict=True,
            )
            if grad is not None  # a parameter without a gradient is left alone (as torch's)
        ]
        muon_update_(tensors, lr, self.settings, skip=skip, grad_scale=clip)
        if self.use_masters:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)
        return grad_norm

    def zero_grad(self) -> None:
        self.adamw.zero_grad()
        for p in self.params:
            p.grad = None
            if getattr(p, "main_grad", None) is not None:
                p.main_grad = None

    def state_dict(self) -> dict[str, Any]:
        """{"adamw": AdamW's state, "muon": {name: {"momentum"[, "master"]}}}, local tensors
        (the trainer makes expert slices global)."""
        muon = {}
        for name, master, momentum in zip(self.names, self.masters, self.momenta, strict=True):
            muon[name] = {"momentum": momentum, **({"master": master} if self.use_masters else {})}
        return {"adamw": self.adamw.state_dict(), "muon": muon}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.adamw.load_state_dict(state["adamw"])
        saved = state["muon"]
        for name, param, master, momentum in zip(
            self.names, self.params, self.masters, self.momenta, strict=True
        ):
            if name not in saved:
                raise ValueError(f"Muon's state has no entry for parameter {name}")
            momentum.copy_(saved[name]["momentum"])
            if self.use_masters:  # without a saved master, the parameter's value is its master
                master.copy_(saved[name].get("master", param))
        if self.use_masters:
            torch._foreach_copy_(self.params, self.masters)

    @torch.no_grad()
    def reset_masters(self) -> None:
        """Copy the parameters into the fp32 masters (after loading weights from elsewhere)."""
        self.adamw.reset_masters()
        if self.use_masters:
            torch._foreach_copy_(self.masters, self.params)
