"""The route table's statistics against plain loops over the routes (moetrain.tools.bench.route_table)."""

import math
from pathlib import Path

import pytest
import torch

from moetrain.tools.bench.route_table import (
    CAPACITY_FACTORS,
    main,
    random_routes,
    route_load,
    uniform_routes,
)
from moetrain.train.routes import load_routes


def _kept_by_loop(ids_GTK, E: int, cf: float) -> int:
    """NoSync's rule route by route: expert capacity first (sources in rank order, tokens in
    order), then each (source -> rank) block's rows (its experts in order, tokens in order)."""
    G, T, K = ids_GTK.shape
    e = E // G
    capacity = math.ceil(round(cf * G * T * K / E, 6))
    block_rows = min(math.ceil(round(cf * T * K / G, 6)), T * min(K, e))
    taken = [0] * E
    survivors = {}  # (source, expert) -> routes past the expert capacity
    for s in range(G):
        for t in range(T):
            for k in range(K):
                x = int(ids_GTK[s, t, k])
                if taken[x] < capacity:
                    taken[x] += 1
                    survivors[s, x] = survivors.get((s, x), 0) + 1
    kept = 0
    for s in range(G):
        for d in range(G):
            rows = 0
            for x in range(d * e, (d + 1) * e):
                fits = min(survivors.get((s, x), 0), block_rows - rows)
                rows += fits
            kept += rows
    return kept


@pytest.mark.parametrize("E,K,G", [(8, 2, 4), (16, 4, 2), (8, 3, 8)])
def test_load_and_drops_match_plain_loops_on_skewed_random_routes(E, K, G):
    N, L, T = 2 * G, 2, 24
    # skewed: low experts more likely, so every capacity factor drops something
    noise = torch.rand(N, L, T, E) * torch.linspace(2.0, 0.5, E)
    routes = noise.topk(K, dim=-1).indices.to(torch.int16)
    result = route_load(routes, E, G)
    loads, kept = [], dict.fromkeys(CAPACITY_FACTORS, 0)
    for group in range(N // G):
        for layer in range(L):
            ids_GTK = routes[group * G : (group + 1) * G, layer]
            rows = [0] * G
            for x in ids_GTK.flatten().tolist():
                rows[x // (E // G)] += 1
            loads.append(max(rows) / (sum(rows) / G))
            for cf in CAPACITY_FACTORS:
                kept[cf] += _kept_by_loop(ids_GTK, E, cf)
    assert result.mean_load == pytest.approx(sum(loads) / len(loads))
    assert result.worst_load == pytest.approx(max(loads))
    for cf in CAPACITY_FACTORS:
        assert result.drop_rate[cf] == pytest.approx(1 - kept[cf] / routes.numel())
    assert result.drop_rate[1.0] > result.drop_rate[2.0] >= 0


def test_uniform_routing_is_balanced_and_drops_nothing_random_does_drop():
    uniform = route_load(uniform_routes(8, 2, 64, 2, 8), 8, 8)
    assert uniform.mean_load == 1.0 and set(uniform.drop_rate.values()) == {0.0}
    random = route_load(random_routes(8, 2, 64, 2, 8), 8, 8)
    assert random.mean_load > 1.0 and random.drop_rate[1.0] > random.drop_rate[2.0]


def test_the_committed_routes_file_prints_its_table(capsys):
    path = Path(__file__).parent.parent / "benchmarks" / "data" / "demo_routes.pt"
    recorded = load_routes(path)
    assert recorded["routes"].dtype == torch.int16 and recorded["num_experts"] == 8
    main([str(path), "--ep", "8"])
    out = capsys.readouterr().out
    assert "| recorded |" in out and "| uniform | 1.000 | 1.000 | 0.00% |" in out


def test_a_written_uniform_routes_file_replays_in_bench(tmp_cache, tmp_path):
    from moetrain.config.presets import tiny
    from moetrain.tools.bench.harness import warmed_trainer

    path = str(tmp_path / "uniform.pt")
    main([path, "--write", "uniform", "--preset", "tiny", "--forwards", "3"])
    with warmed_trainer(tiny(), "mixed", warmup=3, routing=path, device="cpu") as (trainer, _):
        stats = trainer.model.moe_layers()[0].read_stats()["tokens_per_expert"]
    config = tiny()
    T, K, E = (
        config.train.micro_batch_size * config.train.seq_len,
        config.moe.top_k,
        config.moe.num_experts,
    )
    assert stats.tolist() == [3 * T * K // E] * E  # three forwards, every expert alike
