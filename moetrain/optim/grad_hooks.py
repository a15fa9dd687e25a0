"""Gradient hooks that do not keep their owner alive.

A parameter holds its post-accumulate-grad hooks, and a hook that refers to its owner (a gradient
sync or an optimizer, which refer back to the parameters and hold their flat gradient buffers)
closes a cycle through the tensor's hooks that Python's garbage collector does not free: every
Trainer built in one process (a benchmark sweep, a notebook) kept its buffers on the GPU. These
hooks reach their owner through a weak reference; once the owner is gone they do nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch


def weak_grad_hook(owner: Any, fn: Callable[..., None], *args: Any) -> Callable:
    """hook(param) calling fn(owner, param, *args) while `owner` lives. `args` must not refer
    to the parameters (pass indices), or the cycle is back."""
    ref = weakref.ref(owner)

    def hook(param: torch.Tensor) -> None:
        target = ref()
        if target is not None:
            fn(target, param, *args)

    return hook
