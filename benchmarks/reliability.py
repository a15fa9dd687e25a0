"""Fault injection: every fault moetrain claims to survive, injected, counted, and checked for loss.

Each scenario plants one kind of fault in a CPU run of the `tiny` preset (a SIGKILL at a random
moment or in the middle of a checkpoint, a rank dying under torchrun, a full disk, bit rot, a
hostile checkpoint, NaN/inf and loss spikes, broken inputs, data replaced under a run, a second
run in a used run directory, corrupt checkpoints at rotation) and compares the outcome with a
fault-free run: "data lost" counts steps whose final logged loss differs from the fault-free
run's or is missing (all steps when the final weights differ bitwise), "work redone" the steps
computed twice because they came after the last complete checkpoint. The markdown table it prints
is the one in docs/reliability.md:

    python benchmarks/reliability.py                  # about a minute on a 2-core CPU
    python benchmarks/reliability.py --kills 20 --fuzz 2000 --out /tmp/reliability

This file runs the scenarios and prints the table; the scenarios themselves are in
benchmarks/faultlab/, one module per kind of fault.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch
from faultlab.harness import Outcome
from faultlab.inputs import config_fuzz, hostile_inputs
from faultlab.numerical import numerical_faults
from faultlab.processes import kill_anywhere, rank_death
from faultlab.run_dirs import concurrent_runs, corrupt_rotation, data_replaced
from faultlab.storage import bit_rot, disk_full, unwritable_run_dir
from faultlab.untrusted import hostile_checkpoints


def table(rows: list[Outcome]) -> str:
    lines = [
        "| fault | how it is injected | injected | survived | data lost (steps) | work redone (steps) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.fault} | {r.injection} | {r.injected} | {r.survived} | {r.lost} | {r.redone} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10, help="random SIGKILLs of one run")
    parser.add_argument("--fuzz", type=int, default=500, help="random configs to try")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/reliability"))
    args = parser.parse_args(argv)
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    cache = args.out / "cache"
    os.environ["MOETRAIN_CACHE"] = str(cache)
    started = time.time()
    steps = 4 * args.kills + 14  # room for every kill to make progress
    rows = [*kill_anywhere(args.out, cache, kills=args.kills, steps=steps, seed=args.seed)]
    rows.append(rank_death(args.out, cache))
    rows += [disk_full(args.out), unwritable_run_dir(args.out), bit_rot(args.out)]
    rows.append(hostile_checkpoints(args.out))
    rows += numerical_faults(args.out)
    rows += [hostile_inputs(args.out), config_fuzz(args.fuzz)]
    rows += [data_replaced(args.out), concurrent_runs(args.out, cache), corrupt_rotation(args.out)]
    print(table(rows))
    print(
        f"\n{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, {time.time() - started:.0f} s: "
        f"python benchmarks/reliability.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    )
    failed = [r.fault for r in rows if r.survived != r.injected or r.lost]
    if failed:
        print(f"\nNOT SURVIVED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
