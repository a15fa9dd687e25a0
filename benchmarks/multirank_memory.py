"""Per-rank peak memory of each compared layout against the planner's model of it
(moetrain.tools.plan.compare.layout_memory), every rank of a layout on GPU 0.

    python benchmarks/multirank_memory.py --preset ref-47b --layers 2 --micro-batch-size 2 \
        --ranks 2 --layouts resident resident-replicated fsdp2

Resident experts run dp = ep = --ranks ranks over gloo on one GPU (each rank its own process
and caching allocator, so `torch.cuda.max_memory_allocated` is per rank) with NoSync buffers of
1.25 T K rows, ShardedAdamW or the replicated AdamW. FSDP2 runs --fsdp-ranks ranks (default 1:
FSDP2 over one rank is not applied, parallel/data.py; the model then holds the whole state and
no gathered copies, which is what the FSDP2 model predicts at n = 1; its terms in n are the
arithmetic of tools/plan/fsdp.py). Eager (parallel.compile=false) and without a CUDA graph: the
activation model counts eager autograd's bytes. Predictions leave out the overhead (CUDA
context, NCCL buffers), which the allocator does not see. Prints a table; each layout's result
as soon as it is measured.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile

import torch
import torch.multiprocessing as mp

GIB = 2**30
LAYOUTS = {
    "resident": ["train.optimizer=sharded"],
    "resident-replicated": ["train.optimizer=adamw"],
    "fsdp2": ["parallel.data_parallel=fsdp", "train.optimizer=adamw"],
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, overrides, preset, run_dir, name, device, results):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
    )  # fmt: skip
    from moetrain.config.presets import get_preset
    from moetrain.tools.dry_run import layout_from_config
    from moetrain.tools.plan.compare import layout_memory
    from moetrain.tools.plan.layout import GPUS, Cluster
    from moetrain.tools.plan.rank_compute import VARIANTS
    from moetrain.train.trainer import Trainer

    config = get_preset(preset).with_overrides(overrides)
    variant = VARIANTS[{"resident-replicated": "resident, replicated AdamW"}.get(name, name)]
    cluster = Cluster(gpu=GPUS["h200"], num_gpus=world, overhead_gib=0)
    predicted = layout_memory(config, variant, layout_from_config(config, world), cluster, 1.25)
    trainer = Trainer(config, run_dir, device=device, progress=False)
    it = iter(trainer.train_loader)
    for _ in range(3):
        trainer.train_step(it)
    cuda = device == "cuda"  # the CPU runs the code path only (tests): no allocator statistics
    measured = torch.cuda.max_memory_allocated() / GIB if cuda else float("nan")
    results[rank] = (measured, predicted.peak / GIB)
    trainer.shutdown()


def run(preset: str, name: str, world: int, overrides: list[str], device: str) -> dict:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, tempfile.TemporaryDirectory() as run_dir:
        results = manager.dict()
        port = _port()
        args = (world, port, overrides, preset, run_dir, name, device, results)
        procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        return dict(results)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="ref-47b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2, help="dp = ep of the resident layouts")
    parser.add_argument("--fsdp-ranks", type=int, default=1)
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    print("| layout | preset | layers | micro-batch | ranks | rank | measured GiB | planner GiB | planner / measured |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.layouts:
        fsdp = name == "fsdp2"
        world = args.fsdp_ranks if fsdp else args.ranks
        overrides = [
            f"model.num_layers={args.layers}", f"train.micro_batch_size={args.micro_batch_size}",
            "parallel.backend=gloo", "parallel.compile=false", "train.cuda_graph=false",
            "data.random_tokens=true", "train.eval_every=0", "train.checkpoint_every=0",
            "train.log_every=1000", *LAYOUTS[name],
        ]  # fmt: skip
        if not fsdp:
            overrides += [f"parallel.ep={world}", "moe.dispatcher=no_sync", "moe.capacity_factor=1.25"]  # fmt: skip
        results = run(args.preset, name, world, [*overrides, *args.set], args.device)
        for rank, (measured, planned) in sorted(results.items()):
            print(f"| {name} | {args.preset} | {args.layers} | {args.micro_batch_size} | {world} | {rank} | {measured:.2f} | {planned:.2f} | {planned / measured:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
