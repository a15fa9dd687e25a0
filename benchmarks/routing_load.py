"""The load a briefly trained router puts on expert-parallel ranks: max / mean routed rows per
rank, the `--expert-load` of `moetrain bench --project` and `moetrain plan`.

    python benchmarks/routing_load.py --steps 200 --ep 8 [--device cuda]

Trains a small OLMoE-style model (64 experts, top-8, the default balance losses) on the embedded
corpus with the Trainer, then routes held-out batches: each batch is ep ranks' micro-batches of
--tokens tokens, the experts sit on the ranks in contiguous blocks (parallel/expert.py), and a
rank receives the routes of all ep micro-batches to its experts. Prints, per checkpoint of the
training, the mean and the worst over layers and batches of (busiest rank's rows / mean rows).
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from moetrain.config.presets import get_preset
from moetrain.train.trainer import Trainer


def rank_load(trainer: Trainer, ep: int, batches: int, tokens: int) -> list[float]:
    """max / mean rows per rank, one value per (batch, MoE layer)."""
    model, counts = trainer.model, []
    hooks = [
        layer.router.register_forward_hook(lambda m, a, out: counts.append(out.tokens_per_expert_E))
        for layer in model.moe_layers()
    ]
    seq = trainer.config.train.seq_len
    data = iter(trainer.val_loader)
    loads = []
    with torch.no_grad():
        for _ in range(batches):
            rows = []
            while sum(r.shape[0] * r.shape[1] for r in rows) < ep * tokens:
                rows.append(next(data)[0])
            counts.clear()
            model(torch.cat(rows)[: ep * tokens // seq])
            for per_expert in counts:
                per_rank = per_expert.float().view(ep, -1).sum(1)
                loads.append((per_rank.max() / per_rank.mean()).item())
    for hook in hooks:
        hook.remove()
    return loads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=50, help="measure every this many steps")
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048, help="a rank's micro-batch")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    config = get_preset("demo").with_overrides(
        [
            "moe.num_experts=64", "moe.top_k=8", "moe.expert_hidden=64", "train.eval_every=0",
            "train.checkpoint_every=0", f"train.steps={args.steps}", "train.log_every=1000",
        ]
    )  # fmt: skip
    print("| step | mean max/mean rows per rank | worst | samples (batches x layers) |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(config, run_dir, device=args.device, progress=False)
        it = iter(trainer.train_loader)
        for step in range(args.steps + 1):
            if step % args.every == 0:
                loads = rank_load(trainer, args.ep, args.batches, args.tokens)
                mean = sum(loads) / len(loads)
                print(f"| {step} | {mean:.3f} | {max(loads):.3f} | {len(loads)} |", flush=True)
            if step < args.steps:
                trainer.train_step(it)


if __name__ == "__main__":
    main()
