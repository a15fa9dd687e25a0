"""Which layers each pipeline stage holds: shared by the pipeline split (`moetrain.parallel`) and
the planner (`moetrain.tools.plan`, which must not import torch). No torch here.
"""

from __future__ import annotations

import functools

INTERLEAVED_CHUNKS = 2  # model chunks per rank under interleaved_1f1b


def stage_layer_ranges(num_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges of the pp pipeline stages, sizes differing by at most one. The
    extra layers go first to the stages just before the last, then to the last, and to stage 0
    (most micro-batches in flight, and the embedding) last: 10 layers on 4 stages: 2, 3, 3, 2."""
    if pp < 1:
        raise ValueError(f"parallel.pp ({pp}) must be >= 1")
    if pp > num_layers:
        raise ValueError(f"parallel.pp ({pp}) must be <= model.num_layers ({num_layers})")
    return list(_stage_layer_ranges(num_layers, pp))


@functools.lru_cache(maxsize=256)
def _stage_layer_ranges(num_layers: int, pp: int) -> tuple[range, ...]:
    base, extra = divmod(num_layers, pp)
    first_served = list(range(pp - 2, 0, -1)) + [pp - 1, 0]  # who gets an extra layer first
    gets_extra = set(first_served[:extra])
    ranges, start = [], 0
    for s in range(pp):
        size = base + (s in gets_extra)
        ranges.append(range(start, start + size))
        start += size
    return tuple(ranges)
