"""Per-rank peak memory of a layout, measured with every rank on one GPU (parallel.backend=gloo),
against the planner's prediction for that rank (`moetrain train --dry-run`'s estimate).

    python benchmarks/multirank_memory.py --preset olmoe-1b-7b --layers 4 --ep 2 4

Each layout runs dp = ep ranks (world = ep) on GPU 0 with the Trainer as a user gets it
(compiled blocks, Triton kernels, bf16 parameters, fp32 masters, moments and gradient buffers),
random tokens, a few steps; each rank reports `torch.cuda.max_memory_allocated` (its own caching
allocator: per process, so per rank). Memory does not depend on the interconnect; speed does,
and is not reported.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile

import torch
import torch.multiprocessing as mp

GIB = 2**30


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, overrides, preset, run_dir, results):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
    )  # fmt: skip
    from moetrain.dry_run import dry_run, layout_from_config
    from moetrain.presets import get_preset
    from moetrain.train.trainer import Trainer

    config = get_preset(preset).with_overrides(overrides)
    predicted = dry_run(config, layout_from_config(config, world), rank, overhead_gib=0.0)
    trainer = Trainer(config, run_dir, device="cuda", progress=False)
    it = iter(trainer.train_loader)
    for _ in range(3):
        trainer.train_step(it)
    torch.cuda.synchronize()
    results[rank] = (torch.cuda.max_memory_allocated() / GIB, predicted.memory.peak / GIB)
    trainer.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="olmoe-1b-7b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args()
    print("| preset | layers | ep (= dp) | dispatcher | rank | measured GiB | planner GiB | planner / measured |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for ep in args.ep:
        overrides = [
            f"model.num_layers={args.layers}", f"parallel.ep={ep}", "parallel.backend=gloo",
            "data.random_tokens=true", "train.eval_every=0", "train.checkpoint_every=0",
            "train.log_every=1000", *args.set,
        ]  # fmt: skip
        ctx = mp.get_context("spawn")
        with ctx.Manager() as manager, tempfile.TemporaryDirectory() as run_dir:
            results = manager.dict()
            port = _port()
            procs = [
                ctx.Process(
                    target=_rank, args=(r, ep, port, overrides, args.preset, run_dir, results)
                )  # fmt: skip
                for r in range(ep)
            ]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            dispatcher = next((o.split("=")[1] for o in args.set if o.startswith("moe.dispatcher")), "auto")  # fmt: skip
            for rank in sorted(results.keys()):
                measured, planned = results[rank]
                print(f"| {args.preset} | {args.layers} | {ep} | {dispatcher} | {rank} | {measured:.2f} | {planned:.2f} | {planned / measured:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
