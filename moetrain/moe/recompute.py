"""What activation checkpointing's recompute must know: that it is one, and what its forward drew.

Forward side effects (statistics, the random-routing draw counter) consult `is_recomputing()` so
a recompute counts nothing twice. Values a forward takes from a counter go on the checkpoint's
`ForwardTape` through `forward_value`, and the recompute reads them back in order, however many
other forwards ran in between (pipeline schedules). parallel/parallelize.py makes one tape per
checkpointed call and enters `recording` / `recomputing` through the checkpoint's context_fn.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

_state = threading.local()


class ForwardTape:
    """The values one checkpointed forward took, in order, and the recompute's read position."""

    def __init__(self) -> None:
        self.values: list[int] = []
        self.read = 0


@contextlib.contextmanager
def recording(tape: ForwardTape) -> Iterator[None]:
    """A checkpointed forward: `forward_value` records what it hands out on `tape`."""
    previous = getattr(_state, "tape", None)
    _state.tape = tape
    try:
        yield
    finally:
        _state.tape = previous


@contextlib.contextmanager
def recomputing(tape: ForwardTape | None = None) -> Iterator[None]:
    """The recompute of a checkpointed forward; `forward_value` replays `tape` from its start."""
    previous = getattr(_state, "active", False), getattr(_state, "tape", None)
    _state.active, _state.tape = True, tape
    if tape is not None:
        tape.read = 0
    try:
        yield
    finally:
        _state.active, _state.tape = previous


def is_recomputing() -> bool:
    return getattr(_state, "active", False)


def forward_value(fresh: Callable[[], int]) -> int:
    """`fresh()` in a plain forward (recorded when a checkpointed forward records); in a
    recompute, the value the original forward took at the same position."""
    tape = getattr(_state, "tape", None)
    if is_recomputing():
        if tape is None or tape.read >= len(tape.values):
            raise RuntimeError(
                "a recomputed forward asked for a value its original forward did not record "
                "(recompute without a ForwardTape, or a forward that changed between the two)"
            )
        tape.read += 1
        return tape.values[tape.read - 1]
    value = fresh()
    if tape is not None:
        tape.values.append(value)
    return value
