"""What a routing costs expert parallelism: the busiest rank's load and NoSync's drop rate, for
recorded routes (a routes file: moetrain/train/routes.py) next to uniform and random routing.

Letters: N forwards, L MoE layers, T tokens of a micro-batch, K top-k, E experts, G ranks of the
expert-parallel group, e = E / G experts a rank (contiguous blocks, as parallel/expert.py places
them).
G consecutive recorded forwards stand for the G ranks' micro-batches of one step (a recording is
one rank's: its later micro-batches take the other ranks' places). For each such group and layer:
the busiest rank's routed rows over the mean, and the routes NoSyncDispatcher drops at a
capacity factor, by its own rule (`keep_counts` on the [source, rank, local expert] counts, with
`no_sync_capacities`). Uniform routing gives every expert T K / E routes of each micro-batch
(token t's k-th route to expert (t K + k) mod E); random draws K distinct experts a token.
`--write` makes a routes file of either for a preset, so that `moetrain bench --routing FILE`
times uniform, random and recorded routing the same way (all replayed).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from moetrain.config import RunConfig
from moetrain.model.transformer import Transformer
from moetrain.moe.capacity import no_sync_capacities
from moetrain.parallel.ep_dispatch import keep_counts

CAPACITY_FACTORS = (1.0, 1.25, 2.0)


@dataclass
class RouteLoad:
    mean_load: float  # busiest rank's rows / mean rows, mean over (group, layer)
    worst_load: float
    drop_rate: dict[float, float]  # capacity factor -> dropped routes / routes
    samples: int  # (group, layer) pairs


def route_load(
    routes_NLTK: torch.Tensor, num_experts: int, ep: int, factors=CAPACITY_FACTORS
) -> RouteLoad:
    """The statistics of `routes_NLTK` at `ep` ranks (whole groups of `ep` forwards only)."""
    N, L, T, K = routes_NLTK.shape
    E, G = num_experts, ep
    if N < G or E % G:
        raise ValueError(f"need at least ep ({G}) forwards and ep dividing {E} experts, got {N}")
    groups = N // G
    ids_BGLN = routes_NLTK[: groups * G].long().view(groups, G, L, T * K)
    counts_BGLE = torch.zeros(groups, G, L, E, dtype=torch.int64)
    counts_BGLE.scatter_add_(3, ids_BGLN, torch.ones_like(ids_BGLN))
    counts_BLGE = counts_BGLE.transpose(1, 2).reshape(groups * L, G, E)
    rows_SG = counts_BLGE.sum(1).view(-1, G, E // G).sum(2).double()
    load_S = rows_SG.max(1).values / rows_SG.mean(1)
    drops = {}
    for cf in factors:
        capacity, block_rows = no_sync_capacities(T, K, G, E, cf)
        kept = sum(
            int(keep_counts(counts_GE.view(G, G, E // G), capacity, block_rows).sum())
            for counts_GE in counts_BLGE
        )
        drops[cf] = 1 - kept / (groups * L * G * T * K)
    return RouteLoad(float(load_S.mean()), float(load_S.max()), drops, groups * L)


def uniform_routes(N: int, L: int, T: int, K: int, num_experts: int) -> torch.Tensor:
    ids_TK = torch.arange(T * K).view(T, K) % num_experts
    return ids_TK.expand(N, L, T, K).clone()


def random_routes(N: int, L: int, T: int, K: int, num_experts: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    noise = torch.rand(N, L, T, num_experts, generator=generator)
    return noise.topk(K, dim=-1).indices


def table(routes_NLTK: torch.Tensor, num_experts: int, ep: int, label: str) -> str:
    """A markdown table: the recording, uniform and random routing of its shape."""
    shape = tuple(routes_NLTK.shape)
    rows = [
        (label, routes_NLTK),
        ("uniform", uniform_routes(*shape, num_experts)),
        ("random", random_routes(*shape, num_experts)),
    ]
    cfs = " | ".join(f"drops at cf {cf}" for cf in CAPACITY_FACTORS)
    lines = [
        f"| routing (ep {ep}) | busiest rank / mean | worst | {cfs} | samples |",
        "|---" * (4 + len(CAPACITY_FACTORS)) + "|",
    ]
    for name, routes in rows:
        r = route_load(routes, num_experts, ep)
        drops = " | ".join(f"{100 * r.drop_rate[cf]:.2f}%" for cf in CAPACITY_FACTORS)
        lines.append(f"| {name} | {r.mean_load:.3f} | {r.worst_load:.3f} | {drops} | {r.samples} |")
    return "\n".join(lines)


def write_routes(config: RunConfig, kind: str, forwards: int, path: str) -> None:
    """A routes file of `config`'s shape (one micro-batch a step) with `kind` (uniform or random)
    routing: what `moetrain bench --routing FILE` replays to time every routing the same way."""
    with torch.device("meta"):
        num_layers = len(Transformer(config).moe_layers())
    t, moe = config.train, config.moe
    T, E = t.micro_batch_size * t.seq_len, moe.num_experts
    make = uniform_routes if kind == "uniform" else random_routes
    routes = make(forwards, num_layers, T, moe.top_k, E).to(torch.int16)
    shape = {"accum_steps": 1, "num_experts": E, "top_k": moe.top_k, "tokens": T}
    record = {"first_step": 1, "steps": forwards, "layers": num_layers, "rank": 0, **shape}
    torch.save({"routes": routes, **record}, path)


def main(argv: list[str] | None = None) -> None:
    from moetrain.config.presets import PRESETS, get_preset
    from moetrain.train.routes import load_routes

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("routes", help="a routes file or a run's routes/ directory")
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument(
        "--write",
        choices=["uniform", "random"],
        help="write a routes file of this routing for --preset to ROUTES instead",
    )
    parser.add_argument("--preset", choices=list(PRESETS))
    parser.add_argument("--forwards", type=int, default=16)
    args = parser.parse_args(argv)
    if args.write:
        if args.preset is None:
            parser.error("--write needs --preset")
        write_routes(get_preset(args.preset), args.write, args.forwards, args.routes)
        return
    recorded = load_routes(args.routes, args.rank)
    print(table(recorded["routes"], recorded["num_experts"], args.ep, "recorded"))


if __name__ == "__main__":
    main()
