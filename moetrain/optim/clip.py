"""Global gradient norm and clipping, counting every parameter element exactly once: replicas
hold equal gradients, expert-parallel ranks different experts and pipeline stages different
layers, so norm^2 = (dense^2 + expert^2 summed over ep) summed over pp. All share
`clip_coefficient` (the arithmetic of `torch.nn.utils.clip_grad_norm_`); no host sync.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from moetrain.kernels import sum_of_squares_triton

EXPERT = "expert"


def params_with_kinds(param_groups: Sequence[dict[str, Any]]) -> list[tuple[torch.Tensor, str]]:
    """(parameter, kind) pairs from `build_param_groups` output."""
    return [(p, group["kind"]) for group in param_groups for p in group["params"]]


def grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """A parameter's gradient for the optimizer step: `param.main_grad` where the gradient sync
    keeps it in a buffer of another dtype (fp32 for bf16 parameters, moetrain.parallel.data;
    autograd refuses a `.grad` whose dtype is not the parameter's), else `param.grad`."""
    main = getattr(param, "main_grad", None)
    return param.grad if main is None else main


def sum_of_squares(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squared elements over `tensors`, as an fp32 scalar on `device` (0 when empty).
    One Triton launch on GPU (moetrain.kernels.sum_of_squares_triton), foreach norms elsewhere."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    if tensors[0].is_cuda and sum_of_squares_triton.supports(list(tensors)):
        return sum_of_squares_triton.multi_tensor_sum_of_squares(list(tensors))
    norms = torch._foreach_norm(list(tensors), 2, dtype=torch.float32)
    return torch.stack(norms).square().sum()


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor `torch.nn.utils.clip_grad_norm_` multiplies gradients by (at most 1)."""
    return (max_norm / (total_norm + 1e-6)).clamp(max=1.0)


def global_grad_norm(
    params_with_kinds: Iterable[tuple[torch.Tensor, str]],
    *,
    ep_group: ProcessGroup | None = None,
    pp_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """L2 norm of all synchronized gradients, the same on every rank. `ep_group`: the ranks
    holding different experts of one stage; `pp_group`: the same position in each pipeline stage
    (None when that degree is 1). A parameter without a gradient counts as zero."""
    dense, expert = [], []
    device = torch.device("cpu")
    for param, kind in params_with_kinds:
        device = param.device
        grad = grad_of(param)
        if grad is not None:
            (expert if kind == EXPERT else dense).append(grad)
    dense_sq = sum_of_squares(dense, device)
    expert_sq = sum_of_squares(expert, device)
    if ep_group is not None:
        dist.all_reduce(expert_sq, group=ep_group)
    total_sq = dense_sq + expert_sq
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt()


def sharded_grad_norm(
    params_with_kinds: Iterable[tuple[torch.Tensor, str]],
    *,
    ep_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """L2 norm of FSDP2's DTensor gradients as a plain scalar, the same on every rank. Dense
    weights are sharded over dp and experts over edp, two meshes one norm cannot mix: each mesh's
    norm is torch's `get_total_norm` (made whole by `full_tensor`), and the experts' squares are
    summed over `ep_group`."""
    by_mesh: dict[tuple[bool, Any], list[torch.Tensor]] = {}
    device = torch.device("cpu")
    for param, kind in params_with_kinds:
        device = param.device
        if param.grad is not None:
            key = (kind == EXPERT, getattr(param.grad, "device_mesh", None))
            by_mesh.setdefault(key, []).append(param.grad)
    squares = {kind: torch.zeros((), dtype=torch.float32, device=device) for kind in (False, True)}
    for (expert, _), grads in by_mesh.items():
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares[expert] = squares[expert] + norm.float().square()
    if ep_group is not None:
        dist.all_reduce(squares[True], group=ep_group)
    return (squares[False] + squares[True]).sqrt()


def clip_grad_norm_(
    params_with_kinds: Iterable[tuple[torch.Tensor, str]],
    max_norm: float,
    *,
    ep_group: ProcessGroup | None = None,
    pp_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most `max_norm`; returns the norm
    before clipping. Same arithmetic as `torch.nn.utils.clip_grad_norm_` (norm + 1e-6)."""
    pairs = list(params_with_kinds)
    total_norm = global_grad_norm(pairs, ep_group=ep_group, pp_group=pp_group)
    grads = [g for g in (grad_of(p) for p, _ in pairs) if g is not None]
    if grads:
        torch._foreach_mul_(grads, clip_coefficient(total_norm, max_norm))
    return total_norm
