"""A flag that is set while activation checkpointing recomputes a forward pass.

Code with side effects in forward (statistics counters, the random-routing draw counter) consults
`is_recomputing()` so that a recomputed forward counts nothing twice and draws the same random
experts as the original forward. `moetrain.parallel` enters `recomputing()` through the
checkpoint's context_fn; nothing here knows about checkpointing itself.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_state = threading.local()


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    previous = getattr(_state, "active", False)
    _state.active = True
    try:
        yield
    finally:
        _state.active = previous


def is_recomputing() -> bool:
    return getattr(_state, "active", False)
