"""How a run stops early. SIGTERM (a scheduler's preemption) and Ctrl-C only set a flag: the step
in flight finishes, and the ranks agree after each step, over a gloo (CPU) group, whether any was
asked to stop, so that all stop after the same step and save together. `TrainingStopped` is the
error every rank raises when the run cannot go on.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import torch
import torch.distributed as dist

from moetrain.parallel.mesh import ParallelDims

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingStopped(RuntimeError):
    """Raised on every rank when training cannot continue: too many non-finite steps (after
    saving), or another run took the run directory over (without saving)."""


class StopRequests:
    def __init__(self, dims: ParallelDims) -> None:
        self.requested = False
        self._group = dist.new_group(backend="gloo") if dims.world_size > 1 else None

    @contextlib.contextmanager
    def caught(self) -> Iterator[None]:
        """SIGTERM and SIGINT request a stop while inside; the previous handlers afterwards."""
        previous = {s: signal.signal(s, self._request) for s in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _request(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.requested = True

    def agree(self, lost: bool) -> tuple[bool, bool]:
        """(stop, lost) as every rank must act on them: each is true when it is on any rank
        (`lost`: this rank's run lock was found lost)."""
        flags = torch.tensor([int(self.requested), int(lost)])
        if self._group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flags[0]), bool(flags[1])
