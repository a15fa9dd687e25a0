"""Gradients into flat buckets during backward, each bucket launched once all its gradients are
in: the one protocol behind GradientSync (parallel/data.py: all-reduce) and ShardedAdamW
(optim/sharded.py: reduce-scatter).

A `GradBucket` holds its parameters' gradients in one flat buffer, a slot each, in one of two modes:
- view (buffer of the parameters' dtype): `.grad` is the slot's view, so autograd accumulates
  micro-batches in place; a `.grad` made afresh (after `zero_grad`) is copied in when the slot
  is finalized.
- accumulate (a wider buffer, e.g. fp32 for bf16 parameters): the post-accumulate-grad hook adds
  each backward's `.grad` into the slot and frees it; the step's first is copied (no zeroing).
`BucketedGrads` launches, outside `no_sync()`, strictly in bucket order every bucket whose slots
are all final, so all ranks issue the same collectives in the same order. Hooks reach their owner
through a weak reference (`weak_grad_hook`): a strong one made a cycle the garbage collector did
not free, leaking every Trainer's buffers.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moetrain.kernels.accumulate_triton import accumulate_


def weak_grad_hook(owner: Any, fn: Callable[..., None], *args: Any) -> Callable:
    """hook(param) calling fn(owner, param, *args) while `owner` lives. `args` must not refer
    to the parameters (pass indices), or the cycle is back."""
    ref = weakref.ref(owner)

    def hook(param: torch.Tensor) -> None:
        target = ref()
        if target is not None:
            fn(target, param, *args)

    return hook


def split_into_buckets(
    params: Sequence[Any], key: Callable[[Any], Hashable], nbytes: Callable[[Any], int], size: float
) -> list[list[Any]]:
    """`params` (in the order backward produces their gradients) into buckets of one key each:
    one open bucket per key, closed once it holds `size` bytes. Buckets come in closing order
    (the order they fill), the ones still open last."""
    closed, open_buckets = [], {}
    for item in params:
        members = open_buckets.setdefault(key(item), [])
        members.append(item)
        if sum(map(nbytes, members)) >= size:
            closed.append(open_buckets.pop(key(item)))
    return closed + list(open_buckets.values())


@dataclass(eq=False, kw_only=True)
class GradBucket:
    params: list[nn.Parameter]
    grads_flat: torch.Tensor  # the gradients, in the accumulation and reduction dtype
    starts: list[int]  # slot i is grads_flat[starts[i] : starts[i] + params[i].numel()]
    accumulate: bool  # accumulate mode (else view mode): see the module docstring
    group: Any = None  # the ProcessGroup of the bucket's collective; None: nothing to reduce
    ready: list[bool] = field(init=False)  # the slot's gradient is final for this step
    unwritten: list[bool] = field(init=False)  # accumulate mode: nothing in the slot this step
    launched: bool = False
    work: Any = None  # the launched collective, waited for by the owner

    def __post_init__(self) -> None:
        self.ready = [False] * len(self.params)
        self.unwritten = [True] * len(self.params)

    def grad_view(self, slot: int) -> torch.Tensor:
        start, param = self.starts[slot], self.params[slot]
        return self.grads_flat[start : start + param.numel()].view_as(param)

    def add_grad(self, slot: int) -> None:
        """Accumulate mode: add this backward's `.grad` into the slot (copy the step's first:
        one fused pass on the GPU) and free it."""
        param = self.params[slot]
        if param.grad is not None:
            accumulate_(self.grad_view(slot), param.grad, first=self.unwritten[slot])
            self.unwritten[slot] = False
            param.grad = None

    def finalize(self, slot: int) -> None:
        """Put the slot's final gradient of this step into the buffer (zero if it got none: a
        parameter unused on this rank contributes zero) and mark it ready."""
        param, view = self.params[slot], self.grad_view(slot)
        if self.accumulate:
            self.add_grad(slot)  # a .grad written without the hook (a pipeline's weight pass)
            if self.unwritten[slot]:
                view.zero_()
                self.unwritten[slot] = False
        else:
            if param.grad is None:
                view.zero_()
            elif param.grad.data_ptr() != view.data_ptr():
                view.copy_(param.grad)
            param.grad = view
        self.ready[slot] = True


class BucketedGrads:
    """The launch protocol over `self.buckets` (see the module docstring). An owner calls
    `_init_buckets` once and implements `_launch(bucket)`, which starts the bucket's collective
    and returns its work (or None)."""

    buckets: list[GradBucket]

    def _init_buckets(self, buckets: list[GradBucket]) -> None:
        self.buckets = buckets
        self._sync_enabled = True
        self._next_launch = 0  # buckets before this index are launched
        for b, bucket in enumerate(buckets):
            for slot, param in enumerate(bucket.params):
                param.register_post_accumulate_grad_hook(
                    weak_grad_hook(self, BucketedGrads._on_grad_ready, b, slot)
                )

    def _launch(self, bucket: GradBucket) -> Any:
        raise NotImplementedError

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient-accumulation micro-steps: gradients accumulate locally, nothing is launched."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _on_grad_ready(self, param: nn.Parameter, b: int, slot: int) -> None:
        bucket = self.buckets[b]
        if bucket.launched or bucket.ready[slot]:
            raise RuntimeError(
                "a gradient changed after it was final for the step: run every backward of a "
                "step but the last under no_sync(), and finish the step (the optimizer's step() "
                "or the gradient sync's finish()) before the next backward"
            )
        if bucket.accumulate:
            bucket.add_grad(slot)
        if self._sync_enabled:
            bucket.finalize(slot)
            self._launch_in_order()

    def _launch_in_order(self, force: bool = False) -> None:
        """Launch the next buckets while all their slots are final (all of them with `force`,
        finalizing what backward left)."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if force:
                for slot, ready in enumerate(bucket.ready):
                    if not ready:
                        bucket.finalize(slot)
            elif not all(bucket.ready):
                return
            bucket.work = self._launch(bucket)
            bucket.launched = True
            self._next_launch += 1

    def launch_remaining(self) -> None:
        """Finalize and launch every bucket backward did not (unused parameters, no_sync steps,
        gradients set by hand). Idempotent within a step."""
        self._launch_in_order(force=True)

    def wait(self) -> None:
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None

    def end_step(self, *, unwritten: bool = True) -> None:
        """Ready for the next step's backwards; with `unwritten`, the next backward's gradient
        replaces what accumulate-mode slots hold instead of adding to it."""
        for bucket in self.buckets:
            bucket.ready = [False] * len(bucket.params)
            bucket.launched = False
            if unwritten:
                bucket.unwritten = [True] * len(bucket.params)
        self._next_launch = 0
