"""A user error (`ValueError`) of a job of several processes, printed once, not once per rank.

A config or data error is usually raised on every rank at once. Under torchrun the ranks agree
on who prints through the launcher's own store (TORCHELASTIC_USE_AGENT_STORE: it exists before
any process group, so errors at start-up count too): the first rank to fail prints, the others
stay silent. Without that store (Slurm, an older launcher, the store unreachable) rank 0
prints. One process always prints. Torch is imported only on this path.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

STORE_TIMEOUT_S = 10.0  # the agent's store answers at once when it exists


def report_error(message: str, environ: Mapping[str, str] | None = None) -> None:
    """Print `message` to stderr if this process is the one of its job that reports errors."""
    env = os.environ if environ is None else environ
    world, rank = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1"))), _rank(env)
    if world <= 1 or _first_to_fail(env, rank):
        print(message, file=sys.stderr)


def _rank(env: Mapping[str, str]) -> int:
    return int(env.get("RANK", env.get("SLURM_PROCID", "0")))


def _first_to_fail(env: Mapping[str, str], rank: int) -> bool:
    """Whether this rank is the first of its torchrun job (this restart) to report an error; with
    no launcher store to ask, whether it is rank 0."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in env:
        return rank == 0
    from datetime import timedelta

    import torch.distributed as dist

    try:
        store = dist.TCPStore(
            env.get("MASTER_ADDR", "localhost"),
            int(env["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=STORE_TIMEOUT_S),
        )
        key = f"moetrain/errors/{env.get('TORCHELASTIC_RUN_ID', '')}/"
        key += env.get("TORCHELASTIC_RESTART_COUNT", "0")
        return store.add(key, 1) == 1
    except (RuntimeError, OSError, ValueError):  # no store after all: fall back to rank 0
        return rank == 0
