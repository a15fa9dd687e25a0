"""torch.distributed helpers below every layer that communicates (optim, parallel, checkpoint):
the calls whose names changed between the torch versions moetrain supports, and group sizes.

torch 2.13 added `all_gather_single` and `reduce_scatter_single` for the flat collectives that
torch 2.11 and 2.12 only have as `all_gather_into_tensor` and `reduce_scatter_tensor`; among the
functional collectives (`torch.distributed._functional_collectives`, which torch.compile traces)
2.13 renamed `all_gather_tensor` to `all_gather_single` (the old name warns). Every flat gather
and reduce-scatter of the package goes through here, so one place knows the names.
The name is looked up at each call (not at import), so tests that wrap `torch.distributed`'s
functions to count collectives see these calls too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup


def all_gather_flat_name() -> str:
    """The name of the flat all-gather in this torch."""
    return "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def reduce_scatter_flat_name() -> str:
    """The name of the flat reduce-scatter in this torch."""
    return (
        "reduce_scatter_single"
        if hasattr(dist, "reduce_scatter_single")
        else "reduce_scatter_tensor"
    )


def all_gather_flat(
    out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup | None, async_op: bool = False
):
    """out (G * n elements) = the concatenation of every rank's inp (n elements), rank order."""
    return getattr(dist, all_gather_flat_name())(out, inp, group=group, async_op=async_op)


def reduce_scatter_flat(
    out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup | None, async_op: bool = False
):
    """out (n elements) = chunk `rank` of the sum over ranks of inp (G * n elements)."""
    return getattr(dist, reduce_scatter_flat_name())(out, inp, group=group, async_op=async_op)


def functional_all_gather(inp: torch.Tensor, gather_dim: int, group: ProcessGroup) -> torch.Tensor:
    """Every rank's `inp` concatenated along `gather_dim` (rank order), as a functional
    collective: a new tensor, traceable by torch.compile."""
    name = "all_gather_single" if hasattr(funcol, "all_gather_single") else "all_gather_tensor"
    return funcol.wait_tensor(getattr(funcol, name)(inp, gather_dim, group))


def group_size(group: ProcessGroup | None) -> int:
    """Ranks in `group`; None stands for no group (one process)."""
    return 1 if group is None else dist.get_world_size(group)
