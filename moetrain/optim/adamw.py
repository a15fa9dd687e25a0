"""Replicated AdamW for one process or plain data parallelism, with optional fp32 masters.

The trainer's optimizer interface (ShardedAdamW has the same): `no_sync()`, `finish_grad_sync()`,
`step(lr, max_grad_norm, skip) -> grad_norm`, `zero_grad()`, `state_dict()`, `load_state_dict()`,
`reset_masters()`. Gradient communication is `grad_sync`'s (parallel/data.py GradientSync), the
global norm `norm_fn`'s. The update is torch's AdamW (fused on CUDA; foreach on CPU, bitwise
reproducible on resume), on fp32 masters for bf16 parameters; or with `kernel="triton"` one
multi-tensor kernel per group (kernels/adamw_triton.py) that reads the bf16 gradients and writes
master, moments and parameter in one pass, torch still owning the state. Clipping is applied as
the kernels read the gradients (`grad_scale`; in place on CPU). A true `skip` (device bool) makes
the step change nothing, without a host sync.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch

from moetrain.optim.clip import clip_coefficient, grad_of


class AdamW:
    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        *,
        betas: tuple[float, float],
        eps: float,
        master_weights: bool,
        fused: bool,
        norm_fn: Callable[[], torch.Tensor],
        grad_sync: Any = None,
        kernel: str = "torch",
    ) -> None:
        self.norm_fn, self.grad_sync = norm_fn, grad_sync
        self.params = [p for g in param_groups for p in g["params"]]
        self.use_masters = master_weights and any(p.dtype != torch.float32 for p in self.params)
        groups = []
        for g in param_groups:
            params = g["params"]
            if self.use_masters:
                params = [p.detach().float().requires_grad_() for p in params]
            groups.append(
                {
                    **{k: v for k, v in g.items() if k not in ("params", "param_names")},
                    "params": params,
                    "param_names": g["param_names"],
                }
            )
        self.masters = [p for g in groups for p in g["params"]] if self.use_masters else None
        self.fused = fused
        if kernel not in ("torch", "triton"):
            raise ValueError(f"AdamW kernel must be 'torch' or 'triton', got {kernel!r}")
        if kernel == "triton" and not fused:
            raise ValueError("the Triton AdamW kernel runs on CUDA only (fused=True)")
        self.kernel = kernel
        self.opt = torch.optim.AdamW(
            groups,
            lr=0.0,
            betas=betas,
            eps=eps,
            fused=fused or None,
            foreach=None if fused else True,
        )

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.grad_sync.no_sync() if self.grad_sync is not None else contextlib.nullcontext()

    def finish_grad_sync(self) -> None:
        if self.grad_sync is not None:
            self.grad_sync.finish()

    def step(
        self,
        lr: float | torch.Tensor,
        max_grad_norm: float = 0.0,
        skip: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Clip (max_grad_norm > 0), then update unless `skip` or the norm is not finite.
        Returns the gradient norm before clipping, on the device. `lr` may be an fp64 device
        scalar (a CUDA-graphed step; the Triton kernel reads it there)."""
        grad_norm = self.norm_fn()
        bad = ~torch.isfinite(grad_norm)
        skip = bad if skip is None else skip | bad
        clip = clip_coefficient(grad_norm.float(), max_grad_norm) if max_grad_norm > 0 else None
        self._update(lr, skip, clip)
        return grad_norm

    def _update(
        self, lr: float | torch.Tensor, skip: torch.Tensor, clip: torch.Tensor | None
    ) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr * group["lr_mult"]
        if self.kernel == "triton" and all(grad_of(p) is not None for p in self.params):
            self._triton_update(skip, clip)
            return
        if isinstance(lr, torch.Tensor):
            raise RuntimeError(
                "AdamW: a device learning rate (a CUDA-graphed step) needs the Triton kernel with "
                "a gradient for every parameter; set train.cuda_graph=false"
            )
        if self.kernel == "triton":  # a parameter without a gradient: torch's semantics from now on
            warnings.warn(
                "AdamW: a parameter has no gradient; the Triton kernel needs every one, "
                "falling back to torch's fused AdamW for the rest of the run",
                stacklevel=2,
            )
            self.kernel = "torch"
        if self.use_masters:
            for master, p in zip(self.masters, self.params, strict=True):
                grad = grad_of(p)
                master.grad = None if grad is None else grad.float()
        else:  # torch's kernels want gradients of the parameters' dtype in .grad
            for p in self.params:
                if p.grad is None and grad_of(p) is not None:
                    p.grad = grad_of(p).to(p.dtype)
        targets = self.masters if self.use_masters else self.params
        if self.fused:
            self.opt.found_inf = skip.float()
            if clip is not None:
                self.opt.grad_scale = clip.reciprocal()
            self.opt.step()
            del self.opt.found_inf
            self.opt.__dict__.pop("grad_scale", None)
        else:
            if clip is not None:  # per group: FSDP2's expert and dense gradients differ in mesh
                for group in self.opt.param_groups:
                    grads = [t.grad for t in group["params"] if t.grad is not None]
                    if grads:
                        torch._foreach_mul_(grads, clip)
            before = [t.detach().clone() for t in targets]
            states = [{k: v.clone() for k, v in self.opt.state[t].items()} for t in targets]
            self.opt.step()
            with torch.no_grad():
                for t, old, state in zip(targets, before, states, strict=True):
                    t.copy_(torch.where(skip, old, t))
                    for k, v in state.items():
                        self.opt.state[t][k].copy_(torch.where(skip, v, self.opt.state[t][k]))
        if self.use_masters:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)

    def _triton_update(self, skip: torch.Tensor, clip: torch.Tensor | None) -> None:
        from moetrain.kernels.adamw_triton import multi_tensor_adamw_

        self.init_state()
        found_inf = skip.float()
        grad_scale = None if clip is None else clip.reciprocal()
        model_params = iter(self.params)
        for group in self.opt.param_groups:
            # one launch per dtype signature within the group (one in practice)
            launches: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for target in group["params"]:
                p = next(model_params)
                key = (p.dtype, grad_of(p).dtype, self.opt.state[target]["exp_avg"].dtype)
                launches.setdefault(key, []).append((p, target))
            beta1, beta2 = group["betas"]
            for pairs in launches.values():
                params = [p for p, _ in pairs]
                states = [self.opt.state[t] for _, t in pairs]
                steps = [state["step"] for state in states]
                # a list of device scalars: the (list, Tensor) overload reads it on the host
                torch._foreach_add_(steps, [1.0 - found_inf] * len(steps))  # all stay equal
                multi_tensor_adamw_(
                    params,
                    [grad_of(p) for p in params],
                    [state["exp_avg"] for state in states],
                    [state["exp_avg_sq"] for state in states],
                    [t for _, t in pairs] if self.use_masters else None,
                    steps[0],
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    grad_scale=grad_scale,
                    found_inf=found_inf,
                )
        # The kernel wrote the parameters through raw pointers, which autograd's version counters
        # do not see; anything keyed on `param._version` (autograd's check that a tensor saved
        # for backward was not changed in place) must.
        torch.autograd.graph.increment_version(self.params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
            if getattr(p, "main_grad", None) is not None:
                p.main_grad = None

    def state_dict(self) -> dict[str, Any]:
        """Keyed by parameter name: {name: {"step", "exp_avg", "exp_avg_sq"[, "master"]}}."""
        out: dict[str, Any] = {}
        for group in self.opt.param_groups:
            for name, t in zip(group["param_names"], group["params"], strict=True):
                state = {k: v for k, v in self.opt.state.get(t, {}).items()}
                if self.use_masters:
                    state["master"] = t.detach()
                out[name] = state
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for group in self.opt.param_groups:
            for name, t in zip(group["param_names"], group["params"], strict=True):
                entry = state.get(name, {})
                if "master" in entry:
                    with torch.no_grad():
                        t.copy_(entry["master"])
                moments = {k: v for k, v in entry.items() if k != "master"}
                if moments:
                    self.opt.state[t] = moments
        if self.use_masters:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)

    @torch.no_grad()
    def reset_masters(self) -> None:
        """Copy the parameters into the fp32 masters (after loading weights from elsewhere)."""
        if self.use_masters:
            torch._foreach_copy_(self.masters, self.params)

    def init_state(self) -> None:
        """Create zero moments so that `state_dict()` has every tensor DCP must load into."""
        for group in self.opt.param_groups:
            for t in group["params"]:
                if t not in self.opt.state or not self.opt.state[t]:
                    self.opt.state[t] = {
                        "step": torch.zeros(
                            (), dtype=torch.float32, device=t.device if self.fused else "cpu"
                        ),
                        "exp_avg": torch.zeros_like(t, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(t, memory_format=torch.preserve_format),
                    }
